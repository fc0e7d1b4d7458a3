"""A site whose sequence is split over n devices: what XLA does natively (all-gather K and V onto
every device, then the naive formula on the device's queries) against ring attention
(`hlotool.kernels.ring`: K/V blocks passed round, each step priced as the chunked kernel; on
TPU tokamax's ring splash may run it, `kernels.ring_tokamax`), per device.

Shares. After the batch and head splits (`kernels.sharded.mesh_split`) a device holds
[b, L/n, h, D] of q, k, v and o. The all-gather's compute is the unfused native program
(`model.analytic`, side "native") on a share of [L/n] queries against [L] keys; the ring's
is n steps of the chunked kernel (side "kernel") on [L/n] × [L/n] blocks.

Links (`Hardware.link_*`). All-gather: (n−1) blocks of K and V in, over `link_ways` directions
at once (both neighbours on a TPU torus axis), then the compute: not overlapped. Its latency is
one hop per step of the ring it runs, ⌈(n−1)/ways⌉, or one rendezvous on the host. Ring: step s
computes on one block while the next block arrives, so the steps cost max(compute, hop) each
and the last its compute alone; each of the n−1 hops is one `ppermute`, one way, with its own
latency. Backward (`backward`): the all-gather adds a reduce-scatter of dK and dV, as many
bytes again; the ring runs a second ring of n hops, each moving the K/V block and its f32 dK/dV
accumulators, over backward steps.

Bands. Each step waits for its slowest device, which computes its chunk pairs as the band
shows them (`ring.pair_bands`: whole, through the band shifted to the pair, or not at all).
Under a causal mask the ring deals the sequence zig-zag (`ring.dealt_zigzag`: device r holds
chunks r and 2n−1−r of 2n), so every device computes half a block per step and the causal
saving shows in the wall time; where a block does not halve into tiles its blocks are
contiguous, and device n−1, which sees its diagonal block and n−1 whole ones, sets every step.
Under a sliding window a step computes only the pairs the window reaches. The native share
computes every score of its [L/n, L] share whatever the mask.

Memory per device: all-gather, q and o of the share, K and V gathered whole and the native
temporaries of the share (backward: dO, dQ, and dK, dV whole before their reduce-scatter); ring,
q, k, v, o blocks, two K/V blocks in flight (the one computed on, the one arriving), one step's
kernel temporaries and the f32 running output, max and normalizer (backward: the travelling f32
dK/dV of both blocks and the f32 dQ).

The decision (`SequenceSplit.ring_pays`): the ring where it is no slower, or where the
all-gather does not fit the chip. `cost` shows it per target; `flash_jit(kernel="auto")` keeps
XLA's all-gather per platform where the ring does not pay on the chip that platform runs the
mesh on (`on_mesh`, `mesh_chip`: the mesh's own devices, else the chip flash_jit prices the
platform's kernels on, `decision.chip_for`). By this model the ring loses where its
hops bound it: on the host, 7 rendezvous of ~200 µs against the all-gather's one at short
lengths (L = 64 over 8 devices); on a TPU torus, while each step's block computes faster than
it crosses a link (v5p at L = 2048, f32, D = 64, 8 devices), as the all-gather uses both
neighbours; on GPUs, one path out of each device, only by a hair at tiny lengths.

Left out: XLA:TPU may run the native share as its own online-softmax call (no [L/n, L]
buffers), which would make the all-gather faster and smaller there than priced; XLA may overlap
the gather with other work; small slices (v5p 2x2x2) have no torus wrap-around, so a ring along
an axis crosses it twice; a mesh axis spread over several torus axes or hosts (DCN) is slower;
host devices share one memory, which the fit test does not divide among them; the ring's
per-step merge and kernel launch are not priced beyond the kernel's roofline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax

from hlotool import jaxcompat, kernels
from hlotool.cost.decision import DEFAULT_CHIP, Choice, chip_for, running_platform
from hlotool.cost.model import analytic, kernel_temp_bytes, native_temp_bytes
from hlotool.hardware import Hardware, for_device_kind, get_hardware
from hlotool.kernels import ring
from hlotool.kernels.sharded import left_over, mesh_split
from hlotool.site import AttentionSite, Band
from hlotool.units import format_bytes, format_seconds

_F32 = 4


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One strategy's figures on one device. link_bytes: bytes the device receives over its
    links; link_seconds: their time, latency included; compute_seconds: its roofline work;
    seconds: the whole, with the overlap the strategy has; memory_bytes: peak per device."""

    name: str  # "all-gather" | "ring"
    link_bytes: int
    link_seconds: float
    compute_seconds: float
    seconds: float
    memory_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """All-gather vs ring for one device's share of a site split `devices` ways along its
    sequence, on `chip` with `capacity` bytes of memory per device. ring: None where the ring
    cannot take the site (`refusal` says why)."""

    devices: int
    chip: str
    capacity: int
    backward: bool
    gather: Strategy
    ring: Strategy | None
    refusal: str | None = None

    @property
    def ring_pays(self) -> bool:
        """The ring where it is no slower than the all-gather, or where the all-gather does not
        fit the chip's memory. Memory a program fits in without the ring buys nothing; time
        does (as `decision.verdict` keeps native where the kernel only saves memory)."""
        if self.ring is None:
            return False
        fits = self.gather.memory_bytes <= self.capacity
        return self.ring.seconds <= self.gather.seconds or not fits

    @property
    def why(self) -> str:
        """The decision's reason, one line without the decision."""
        g, r = self.gather, self.ring
        if r is None:
            return f"the ring cannot take it: {self.refusal}"
        if g.memory_bytes > self.capacity:
            return (f"all-gather needs {format_bytes(g.memory_bytes)} per device, more than "
                    f"{self.chip}'s {format_bytes(self.capacity)}")
        if self.ring_pays:
            return (f"ring ×{g.seconds / r.seconds:.1f} faster on {self.chip}, "
                    f"{format_bytes(r.memory_bytes)} per device against "
                    f"{format_bytes(g.memory_bytes)}")
        return (f"all-gather ×{r.seconds / g.seconds:.1f} faster on {self.chip}: the ring's "
                f"{self.devices - 1} hops ({format_seconds(r.link_seconds)}) outweigh its "
                f"overlap with {format_seconds(r.compute_seconds)} of compute")

    def line(self) -> str:
        """"sequence over 8 devices: all-gather 0.50 GiB/device, 120 µs (gather 40 µs); ring
        0.07 GiB/device, 95 µs (link 30 µs) → ring"."""
        g, r = self.gather, self.ring
        out = (f"sequence over {self.devices} devices: all-gather "
               f"{format_bytes(g.memory_bytes)}/device, {format_seconds(g.seconds)} (gather "
               f"{format_seconds(g.link_seconds)}); ")
        if r is None:
            return out + f"no ring ({self.refusal})"
        return out + (f"ring {format_bytes(r.memory_bytes)}/device, {format_seconds(r.seconds)}"
                      f" (link {format_seconds(r.link_seconds)}) → "
                      f"{'ring' if self.ring_pays else 'all-gather'}")

    def to_json(self) -> dict[str, Any]:
        return {"devices": self.devices, "chip": self.chip, "capacity": self.capacity,
                "backward": self.backward,
                "all_gather": self.gather.to_json(),
                "ring": None if self.ring is None else self.ring.to_json(),
                "refusal": self.refusal, "ring_pays": self.ring_pays,
                "choice": "ring" if self.ring_pays else "all-gather", "why": self.why,
                "summary": self.line()}


def price(site: AttentionSite, devices: int, chip: str | Hardware, *,
          backward: bool = False) -> SequenceSplit:
    """All-gather vs ring for `site` (one device's batch and heads, the whole sequence) split
    `devices` ways along its sequence on `chip` (forward, or forward and backward)."""
    hw = get_hardware(chip)
    refusal = ring.refusal(site, devices)
    return SequenceSplit(devices, hw.name, hw.hbm_bytes, backward,
                         _gather(site, devices, hw, backward),
                         None if refusal else _ring(site, devices, hw, backward), refusal)


def on_mesh(mesh: Any, site: AttentionSite, *, chip: str | Hardware | None = None,
            platform: str | None = None, backward: bool = False) -> SequenceSplit | None:
    """`price` for `site` (whole, as the program holds it) on `mesh`: its share after the batch
    and head splits, along the mesh axis left over (`sharded.left_over`), on `chip` (default:
    the chip `platform`, default this process's, runs the mesh on: `mesh_chip`). None where
    no axis splits the sequence or no chip prices the platform."""
    batch, heads = mesh_split(mesh, site.batch, site.num_q_heads, site.num_kv_heads)
    axis = left_over(mesh, batch, heads)
    chip = chip or mesh_chip(mesh, platform or running_platform())
    if axis is None or chip is None:
        return None
    nb = math.prod(mesh.shape[a] for a in batch)
    nh = math.prod(mesh.shape[a] for a in heads)
    local = _scaled(site, batch=site.batch // nb, q_heads=site.num_q_heads // nh,
                    kv_heads=site.num_kv_heads // nh)
    return price(local, mesh.shape[axis], chip, backward=backward)


def gathered_where_cheaper(choices: dict[str, Choice], site: AttentionSite, mesh: Any,
                            backward: bool) -> dict[str, Choice]:
    """`choices`, native on each platform where `mesh` (None: none) splits the site's
    sequence and the ring does not pay against XLA's all-gather on the chip that platform runs
    the mesh on (`on_mesh`). A kernel named, not chosen by price (no verdict), stands."""
    out = dict(choices)
    for platform, choice in choices.items():
        if mesh is None or choice.kernel is None or choice.verdict is None:
            continue
        priced = on_mesh(mesh, site, platform=platform, backward=backward)
        if priced and priced.ring is not None and not priced.ring_pays:
            out[platform] = dataclasses.replace(
                choice, kernel=None, reason=f"keep native (XLA all-gathers K and V: {priced.why})")
    return out


def mesh_chip(mesh: Any, platform: str) -> str | None:
    """The `hlotool.hardware` chip that runs `mesh` on `platform`: its devices' chip where they
    are on that platform (by `device_kind`; a deviceless TPU topology's devices name their
    chip too), else `decision.chip_for(platform)`, the chip flash_jit prices the platform's
    kernels on. None for a platform no chip prices."""
    if isinstance(mesh, jax.sharding.Mesh):  # an abstract mesh has no devices
        device = mesh.devices.flat[0]
        if jaxcompat.canonicalize_platform(device.platform) == platform:
            hw = for_device_kind(device.device_kind)
            if hw is not None:
                return hw.name
    return chip_for(platform) if platform in DEFAULT_CHIP else None


def _scaled(site: AttentionSite, *, batch: int | None = None, q_heads: int | None = None,
            kv_heads: int | None = None, q_len: int | None = None,
            kv_len: int | None = None) -> AttentionSite:
    """`site` with smaller extents; its mask operand's shape [B, H, Lq, Lk] shrinks with
    them (a broadcast dim stays 1)."""
    b = batch or site.batch
    hq, hkv = q_heads or site.num_q_heads, kv_heads or site.num_kv_heads
    lq, lk = q_len or site.q_len, kv_len or site.kv_len
    shape = site.mask_shape
    if shape is not None:
        k = min(len(shape), 4)
        shape = (*shape[:-k], *(min(d, e) for d, e in zip(shape[-k:], (b, hq, lq, lk)[-k:])))
    return dataclasses.replace(site, batch=b, num_q_heads=hq, num_kv_heads=hkv, q_len=lq,
                               kv_len=lk, mask_shape=shape, q_shape=(), k_shape=(), v_shape=())


def _seen_through(site: AttentionSite, way: Band | None) -> AttentionSite:
    """A chunk pair of `site` seen through `way`, the band local to the pair, or whole (None):
    its causal mask and window are that band now."""
    mask = site.mask
    if mask in ("causal", "local"):  # the band is the whole mask
        mask = "none" if way is None else "local"
    return dataclasses.replace(site, causal=False, window=way, mask=mask)


def _blocks(site: AttentionSite, n: int) -> tuple[int, int, int]:
    """Bytes of one device's q, k + v and o blocks ([b, L/n, h, D] each)."""
    rows = site.batch * (site.q_len // n)
    q = rows * site.num_q_heads * site.head_dim * site.itemsize
    kv = rows * site.num_kv_heads * (site.head_dim + site.v_head_dim) * site.itemsize
    o = rows * site.num_q_heads * site.v_head_dim * site.itemsize
    return q, kv, o


def _gather(site: AttentionSite, n: int, hw: Hardware, backward: bool) -> Strategy:
    q, kv, o = _blocks(site, n)
    share = _scaled(site, q_len=site.q_len // n)
    steps = 1 if hw.platform == "cpu" else math.ceil((n - 1) / hw.link_ways)
    passes = 2 if backward else 1  # the backward's reduce-scatter of dK, dV: as many bytes
    link_bytes = passes * (n - 1) * kv
    link = passes * ((n - 1) * kv / (hw.link_bandwidth * hw.link_ways) + steps * hw.link_latency)
    compute = analytic(share, hw, "native", backward=backward).seconds
    memory = passes * (q + o + n * kv) + native_temp_bytes(share, backward=backward)
    return Strategy("all-gather", link_bytes, link, compute, link + compute, memory)


def _ring(site: AttentionSite, n: int, hw: Hardware, backward: bool) -> Strategy:
    q, kv, o = _blocks(site, n)
    block = _scaled(site, q_len=site.q_len // n, kv_len=site.kv_len // n)
    chunked = kernels.registered("chunked")
    fill = -math.inf if site.mask_fill is None else site.mask_fill
    steps = ring.pair_bands(site.band, n, site.q_len, fill)
    chunks = n * (2 if ring.dealt_zigzag(site.band, site.q_len // n) else 1)
    chunk = _scaled(site, q_len=site.q_len // chunks, kv_len=site.kv_len // chunks)

    @functools.cache
    def pair(way, bwd: bool = False) -> float:
        """Seconds of one chunk pair seen `way` (`ring.pair_bands`): forward, or backward."""
        if way == ring.HIDDEN:
            return 0.0
        seen = _seen_through(chunk, way)
        fwd = analytic(seen, hw, "kernel", kernel=chunked).seconds
        if not bwd:
            return fwd
        return analytic(seen, hw, "kernel", backward=True, kernel=chunked).seconds - fwd

    # Each step waits for its slowest device.
    forward = [max(sum(pair(w) for w in ways) for ways in step) for step in steps]
    hop = kv / hw.link_bandwidth + hw.link_latency
    seconds = sum(max(c, hop) for c in forward[:-1]) + forward[-1]
    hops = len(steps) - 1
    link_bytes, link, compute = hops * kv, hops * hop, sum(forward)
    # Running f32 output, max and normalizer, beside one step's kernel temporaries.
    rows = site.batch * site.num_q_heads * (site.q_len // n)
    memory = q + 3 * kv + o + kernel_temp_bytes(block) + _F32 * rows * (site.v_head_dim + 2)
    if backward:
        # A hop per step after the first, each moving K/V and their f32 dK/dV accumulators,
        # then dK/dV home in one more (none where one step was all).
        back = [max(sum(pair(w, True) for w in ways) for ways in step) for step in steps]
        grads = kv * _F32 // site.itemsize  # one block's f32 dK/dV
        hop_b = (kv + grads) / hw.link_bandwidth + hw.link_latency
        home = grads / hw.link_bandwidth + hw.link_latency if (n - hops) % n else 0.0
        seconds += back[0] + sum(max(c, hop_b) for c in back[1:]) + home
        link_bytes += hops * (kv + grads) + (grads if home else 0)
        link += hops * hop_b + home
        compute += sum(back)
        memory += (kernel_temp_bytes(block, backward=True) - kernel_temp_bytes(block)
                   + 2 * kv * _F32 // site.itemsize + o)  # dK/dV of both blocks, dO
    return Strategy("ring", link_bytes, link, compute, seconds, memory)
