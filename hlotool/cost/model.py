"""The analytic model: FLOPs, HBM bytes, temporaries and a roofline time per side and chip.

Native is the naive formula as XLA runs it unfused (`hlotool.kernels.base.naive_cost`): the
[B, Hq, Lq, Lk] scores and probabilities go through HBM. Kernel is the flash kernel the
registry picks for the chip's platform (splash_tpu, pallas_tpu or dropout_tpu on TPU; cudnn,
pallas_gpu or chunked on a GPU; chunked on the CPU), with that kernel's own block sizes
(`AttentionKernel.cost`).

Roofline. An unfused program runs op after op, each bounded by its own compute or memory
time, so native time is a sum over phases (QKᵀ, softmax, P·V; and for the backward dP, dS, the
three gradient matmuls) of max(matmul FLOPs / peak, bytes / bandwidth). The kernel is one
fused op: max(FLOPs / peak, bytes / bandwidth). On a chip that does not overlap an op's
arithmetic with its memory traffic (`Hardware.overlaps` False: XLA:CPU) each op costs the sum
of the two instead. Elementwise work (max, exp, sum, divide) is counted in `flops` and hidden
under the matmuls or memory traffic where the chip has exp units beside its matrix unit (TPU,
GPU); on the CPU, whose XLA loops run it after the matmuls, each exp costs 1 /
`Hardware.softmax_rate` on top (native's softmax phase, every score a kernel visits, twice in
its backward). Matmuls with head dim below the chip's matrix width run at D / width of peak,
on both sides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from hlotool.errors import HlotoolError
from hlotool.hardware import Hardware, get_hardware
from hlotool.kernels import AttentionKernel, KernelCost, KernelError, first_taking
from hlotool.kernels.base import ScoreBlocks, naive_cost
from hlotool.site import AttentionSite

# "fused": the naive formula as XLA:TPU runs it where its own attention pass takes the site
# (one online-softmax call: no [B, H, Lq, Lk] buffer, every score computed).
Side = Literal["native", "fused", "kernel"]


@dataclasses.dataclass(frozen=True)
class Figures:
    """One side's analytic cost on one chip.

    flops: multiply-adds count 2, elementwise ops 1. hbm_bytes: bytes moved to and from HBM.
    temp_bytes: peak HBM temporaries the attention adds beyond its inputs and outputs.
    onchip_bytes: one kernel instance's working set (0 for native). seconds: roofline time;
    bound: which limit sets it ("compute" or "memory").
    """

    flops: int
    transcendentals: int
    hbm_bytes: int
    temp_bytes: int
    onchip_bytes: int
    seconds: float
    bound: str
    score_blocks: ScoreBlocks | None = None  # a tiled kernel's score tiles per head

    @property
    def intensity(self) -> float:
        """FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes if self.hbm_bytes else float("inf")

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        blocks = fields.pop("score_blocks")
        return {**fields, "intensity": self.intensity,
                "score_blocks": None if blocks is None else blocks.to_json()}


@dataclasses.dataclass(frozen=True)
class Phase:
    """One op of the unfused program: matmul FLOPs and the HBM bytes it moves."""

    name: str
    matmul_flops: int
    hbm_bytes: int
    softmax_scores: int = 0  # scores whose exp this op computes


def _shape_terms(site: AttentionSite) -> tuple[int, int, int, int, int]:
    """(scores S = B·Hq·Lq·Lk, Q bytes, K bytes, V bytes, O bytes)."""
    b, hq, hkv, item = site.batch, site.num_q_heads, site.num_kv_heads, site.itemsize
    scores = b * hq * site.q_len * site.kv_len
    q = b * site.q_len * hq * site.head_dim * item
    k = b * site.kv_len * hkv * site.head_dim * item
    v = b * site.kv_len * hkv * site.v_head_dim * item
    o = b * site.q_len * hq * site.v_head_dim * item
    return scores, q, k, v, o


def native_phases(site: AttentionSite, *, backward: bool = False) -> list[Phase]:
    """The unfused program's ops; their bytes add up to `naive_cost(site).hbm_bytes`.

    Forward: QKᵀ writes S, softmax reads S (and an additive or boolean mask operand, which
    `naive_cost` leaves out) and writes P, P·V reads P. Backward: dP = dO·Vᵀ
    writes dP; dS = P ⊙ (dP − rowsum(dO ⊙ O)) reads P and dP and writes dS; dV = Pᵀ·dO, dQ =
    dS·K, dK = dSᵀ·Q read dS (P for dV rides along in the dS fusion).
    """
    scores, q, k, v, o = _shape_terms(site)
    sb = site.score_bytes
    d, dv = site.head_dim, site.v_head_dim
    phases = [
        Phase("QKᵀ", 2 * scores * d, q + k + sb),
        Phase("softmax", 0, 2 * sb + mask_operand_bytes(site), scores),
        Phase("P·V", 2 * scores * dv, sb + v + o),
    ]
    if backward:
        io = q + k + v + o
        phases += [
            Phase("dP = dO·Vᵀ", 2 * scores * dv, o + v + sb),
            Phase("dS", 0, 3 * sb),
            Phase("dV, dQ, dK", 2 * scores * (dv + 2 * d), sb + 2 * io - (o + v)),
        ]
    return phases


def mask_operand_bytes(site: AttentionSite) -> int:
    """Bytes of the mask or bias operand the naive program reads (f32 bias, bool mask)."""
    if site.mask not in ("additive", "boolean"):
        return 0
    shape = site.mask_shape or (site.batch, site.num_q_heads, site.q_len, site.kv_len)
    return int(np.prod(shape)) * (4 if site.mask == "additive" else 1)


def kernel_for(site: AttentionSite, hardware: Hardware) -> AttentionKernel:
    """The flash kernel `hardware`'s platform runs `site` with: the first of its table that
    takes it (`kernels.first_taking`). Raises KernelError, naming each refusal, when none
    does."""
    kernel, refusals = first_taking(site, hardware.platform)
    if kernel is None:
        raise KernelError(f"no flash kernel takes this site on {hardware.name}: "
                          + "; ".join(map(str, refusals)))
    return kernel


def _softmax_seconds(scores: int, hardware: Hardware) -> float:
    """The softmax's elementwise time where the chip runs it after its matmuls (the CPU);
    0 where it overlaps them (`Hardware.softmax_rate` None)."""
    return scores / hardware.softmax_rate if hardware.softmax_rate else 0.0


# glibc's largest mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): a freed allocation
# of that size or more goes back to the OS, so the next call's is paged in afresh.
MMAP_THRESHOLD = 32 * 1024 * 1024


def fault_seconds(temp_bytes: int, hardware: Hardware) -> float:
    """The time to page in `temp_bytes` of a call's temporaries (`Hardware.fresh_page_rate`):
    0 below the mmap threshold, where the allocator reuses them, or on a chip whose
    allocator keeps its memory. Part of every native price on the CPU already, through its
    fitted bandwidth; `hlotool profile` takes it out for a site that pages nothing in (one
    whose call's earlier site paged the shared buffer in)."""
    if not hardware.fresh_page_rate or temp_bytes < MMAP_THRESHOLD:
        return 0.0
    return temp_bytes / hardware.fresh_page_rate


def native_faulted_bytes(site: AttentionSite, hardware: Hardware, backward: bool) -> int:
    """What the naive program pages in per call on `hardware`: its temporaries as XLA:CPU
    allocates them (`xla.host_temporaries`: one [B, H, Lq, Lk] buffer or two, by shape),
    else the model's count (`native_temp_bytes`); 0 where the allocator keeps memory."""
    if not hardware.fresh_page_rate:
        return 0
    from hlotool.cost.xla import host_temporaries

    compiled = host_temporaries(site, backward) if hardware.platform == "cpu" else None
    return native_temp_bytes(site, backward=backward) if compiled is None else compiled


def _op_seconds(compute: float, memory: float, hardware: Hardware) -> float:
    """One op's time from its compute and memory times (`Hardware.overlaps`)."""
    return max(compute, memory) if hardware.overlaps else compute + memory


def _matmul_rate(site: AttentionSite, hardware: Hardware) -> float:
    fill = min(1.0, min(site.head_dim, site.v_head_dim) / hardware.matrix_width)
    return hardware.peak_flops(site.dtype) * fill


def native_temp_bytes(site: AttentionSite, *, backward: bool = False) -> int:
    """Peak temporaries of the unfused program: S and P (forward); P kept for the backward,
    then dP and dS beside it."""
    return (3 if backward else 2) * site.score_bytes


def kernel_temp_bytes(site: AttentionSite, *, backward: bool = False) -> int:
    """Peak temporaries of a flash kernel: f32 output accumulator and log-sum-exp [B, Hq, Lq]
    (forward); f32 dQ, dK, dV accumulators (backward)."""
    b, hq, hkv, lq, lk = site.batch, site.num_q_heads, site.num_kv_heads, site.q_len, site.kv_len
    temp = 4 * b * hq * lq * (site.v_head_dim + 1)
    if backward:
        temp += 4 * (b * hq * lq * site.head_dim + b * hkv * lk * (site.head_dim + site.v_head_dim))
    return temp


def analytic(
    site: AttentionSite, hardware: str | Hardware, side: Side, *, backward: bool = False,
    kernel: AttentionKernel | None = None,
) -> Figures:
    """`side`'s analytic figures for `site` on `hardware` (forward, or forward + backward).
    kernel: the flash kernel priced for side "kernel" (default: the registry's first that
    takes the site on the chip's platform)."""
    hw = get_hardware(hardware)
    rate = _matmul_rate(site, hw)
    if side == "fused":
        return _fused(site, hw, rate, backward)
    if side == "native":
        cost = naive_cost(site, backward=backward)
        phases = native_phases(site, backward=backward)
        seconds, compute_time = 0.0, 0.0
        for ph in phases:
            c = ph.matmul_flops / rate + _softmax_seconds(ph.softmax_scores, hw)
            m = ph.hbm_bytes / hw.hbm_bandwidth
            seconds += _op_seconds(c, m, hw)
            compute_time += c if c >= m else 0.0
        bound = "compute" if compute_time > seconds / 2 else "memory"
        return Figures(cost.flops, cost.transcendentals, sum(p.hbm_bytes for p in phases),
                       native_temp_bytes(site, backward=backward), 0, seconds, bound)
    if side == "kernel":
        kernel = kernel or kernel_for(site, hw)
        cost: KernelCost = kernel.cost(site, backward=backward, hardware=hw)
        mm = _kernel_matmul_flops(site, cost, backward)
        c = mm / rate + _softmax_seconds(cost.transcendentals, hw)
        m = cost.hbm_bytes / hw.hbm_bandwidth
        return Figures(cost.flops, cost.transcendentals, cost.hbm_bytes,
                       kernel_temp_bytes(site, backward=backward), cost.onchip_bytes,
                       _op_seconds(c, m, hw), "compute" if c >= m else "memory",
                       cost.score_blocks)
    raise HlotoolError(f"side must be 'native' or 'kernel', got {side!r}")


def _fused(site: AttentionSite, hw: Hardware, rate: float, backward: bool) -> Figures:
    """XLA:TPU's online-softmax call for the forward: one op reading q, k, v (and a mask
    operand) and writing the output, computing every score (it skips no masked block); the
    backward, which that pass leaves alone, as the unfused program's phases."""
    cost = naive_cost(site, backward=backward)
    _, q, k, v, o = _shape_terms(site)
    forward = native_phases(site)
    fwd_bytes = q + k + v + o + mask_operand_bytes(site)
    fwd_mm = sum(p.matmul_flops for p in forward)
    seconds = _op_seconds(fwd_mm / rate, fwd_bytes / hw.hbm_bandwidth, hw)
    compute = fwd_mm / rate >= fwd_bytes / hw.hbm_bandwidth
    hbm = fwd_bytes
    for ph in native_phases(site, backward=True)[len(forward):] if backward else ():
        c, m = ph.matmul_flops / rate, ph.hbm_bytes / hw.hbm_bandwidth
        seconds += _op_seconds(c, m, hw)
        hbm += ph.hbm_bytes
    temp = native_temp_bytes(site, backward=True) if backward else kernel_temp_bytes(site)
    return Figures(cost.flops, cost.transcendentals, hbm, temp, 0, seconds,
                   "compute" if compute else "memory")


# The rates `fit_host` fits, each entering the model's times as its reciprocal.
_FITTED = ("softmax_rate", "hbm_bandwidth")


class Timed(NamedTuple):
    """One site's naive program and kernel timed on a host, forward or, where `backward`,
    forward and backward (as in a train step)."""

    site: AttentionSite
    native_seconds: float
    kernel_seconds: float
    backward: bool = False


def fit_host(hardware: str | Hardware, timed: Sequence[Timed]) -> Hardware:
    """`hardware`, a chip whose ops do not overlap (`Hardware.overlaps` False: the CPU), with
    the softmax rate and bandwidth at which the model's times best reproduce `timed`: per
    site, the measured seconds of the naive program and of the platform's first kernel
    that takes it, its matmul rate as given (a plain (site, native, kernel) triple is a
    forward). How this host's row is calibrated
    (`hlotool.cost.measure.calibrate_host`). The bandwidth so fitted is an effective one: it
    takes in paging a call's fresh temporaries in, which the unfused program's L×L buffers
    cost on XLA:CPU (`fault_seconds`).

    There each time is linear in the rates' reciprocals, so this is a linear least squares
    over the relative errors. A rate no timed site depends on keeps its value. Raises
    HlotoolError where no positive rates fit (times below what the matmuls alone take).
    """
    hw = get_hardware(hardware)
    if hw.overlaps or not all(getattr(hw, f) for f in _FITTED):
        raise HlotoolError(f"{hw.name} overlaps compute and memory: its times are not linear "
                           "in its rates")
    x0 = np.array([1 / getattr(hw, f) for f in _FITTED])
    rows, targets = [], []
    for site, native_seconds, kernel_seconds, backward in (Timed(*t) for t in timed):
        kernel = kernel_for(site, hw)

        def times(x: np.ndarray) -> np.ndarray:
            h = dataclasses.replace(hw, **{f: 1 / v for f, v in zip(_FITTED, x)})
            return np.array([analytic(site, h, "native", backward=backward).seconds,
                             analytic(site, h, "kernel", kernel=kernel,
                                      backward=backward).seconds])

        base = times(x0)
        # Seconds per unit of each reciprocal; what is left is the matmuls'.
        slopes = np.stack([(times(x0 + np.eye(len(x0))[i] * x0[i]) - base) / x0[i]
                           for i in range(len(x0))], 1)
        measured = np.array([native_seconds, kernel_seconds])
        rows.append(slopes / measured[:, None])
        targets.append((measured - (base - slopes @ x0)) / measured)
    a, b = np.concatenate(rows), np.concatenate(targets)
    used = np.abs(a).sum(0) > 0
    fitted = x0.copy()
    fitted[used], *_ = np.linalg.lstsq(a[:, used], b - a[:, ~used] @ x0[~used], rcond=None)
    if (fitted <= 0).any():
        raise HlotoolError(f"no positive rates reproduce the {len(timed)} timed program(s) on "
                           f"{hw.name}: their matmuls alone take longer at "
                           f"{hw.peak_flops('float32') / 1e9:.3g} GFLOP/s")
    return dataclasses.replace(hw, **{f: float(1 / v) for f, v in zip(_FITTED, fitted)})


def _kernel_matmul_flops(site: AttentionSite, cost: KernelCost, backward: bool) -> int:
    """The matmul part of a kernel's FLOPs. Kernels count (`kernels.base.flash_cost`) per
    visited score 2·(D + Dv) matmul FLOPs and 5 elementwise forward; the backward adds 2.5×
    the matmuls and 6 elementwise."""
    per_score = 2 * (site.head_dim + site.v_head_dim)
    matmul, elementwise = (3.5 * per_score, 11) if backward else (per_score, 5)
    return int(cost.flops * matmul / (matmul + elementwise))
