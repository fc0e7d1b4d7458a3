"""The one table of hardware figures the cost model prices attention with, per chip.

Every figure is per chip (per device as jax sees it), peak and dense (no sparsity), and cites
where it comes from. TPU figures are the ones the installed jax itself uses
(`jax/_src/pallas/mosaic/tpu_info.py`, jax 0.10.2), cross-checked against the Cloud TPU
system-architecture pages; GPU figures are NVIDIA's datasheets (SXM parts), with the on-chip
shared memory from the CUDA C++ Programming Guide's compute-capability table, which XLA's
GPU specs (`xla/tools/hlo_opt/gpu_specs/*.txtpb`) also record.

`cpu` is this host, not a product: a 2-core AMD EPYC VM. Its figures were measured here, on
an otherwise idle machine, with `benchmarks/cost_vs_measured.py --calibrate`, which runs
`hlotool.cost.measure.calibrate_host` in 5 fresh processes: an XLA:CPU matmul of
attention-block shape and a 64 MiB result paged in afresh, then the softmax rate and the
bandwidth at which the model best reproduces the naive program and the chunked kernel, timed
at three causal shapes (head dims 16, 32, 64): 61–64 GFLOP/s, 3.5–3.7 GB/s of fresh pages,
0.65–0.73 G scores/s and 4.6–5.9 GB/s across the processes; the row holds the medians. They
are what XLA achieves on this host, not the silicon's peak (XLA:CPU's loops do not overlap
arithmetic with memory traffic: `overlaps` False; a pass over a held buffer moves 25 GB/s,
the unfused program's L×L buffers are paged in afresh on every call), and the VM they are
measured on varies: a session before measured matmuls at 107–142 GFLOP/s on a host of the
same name; another host should re-measure them (`hlotool profile` does, per run).

Links between chips (`link_bandwidth`, `link_latency`, `link_ways`) price a sequence split over
devices (`hlotool.cost.split`): what one chip sends its neighbour on a ring along one mesh axis.
TPUs: the Cloud TPU pages give the bidirectional ICI bandwidth per chip and its ports; one port
one way is that over 2 × ports (v5e 400 GB/s over 4 ports: 50 GB/s, as the scaling book's
W_ici = 9e10 B/s bidirectional per link for v5e), and an axis of the torus has a neighbour each
way, which an all-gather uses both of. GPUs: NVLink to the NVSwitch, half the datasheet's
bidirectional figure each way, one path out of the GPU whichever peer it reaches. The hop
latency, 1 µs, is the figure the TPU team gave ASTRA-sim for ICI and a usual one for NVLink.
`cpu`: host devices of one process, whose "link" is a memory copy: 0.885 GB/s, half the
bandwidth an earlier calibration fitted to the naive program alone (a copy reads and writes
each byte); passing 4 MiB per device round 8 host devices with `lax.ppermute` measured
0.57-0.71 GB/s per device here. Each collective there
is one rendezvous of the devices' threads: 200-270 µs for an 8-device `ppermute` or
`all_gather` of 32 bytes on this 2-core VM, which is `link_latency`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hlotool.errors import HlotoolError, lookup

_TPU_INFO = "jax/_src/pallas/mosaic/tpu_info.py (jax 0.10.2)"
_CLOUD_TPU = "cloud.google.com/tpu/docs/system-architecture-tpu-vm"
_CUDA_GUIDE = "CUDA C++ Programming Guide, compute capabilities table (shared memory per SM)"
_ICI_LATENCY = ("astra-sim.github.io/astra-sim-docs/validation/hardware/tpu-validation.html: "
                "ICI link latency 1 us, as per the TPU team")
_NVLINK_LATENCY = "impala-blog.pages.dev/widgets/comm-roofline: NVLink hop latency ~1 us"


class UnknownHardwareError(HlotoolError):
    """A hardware name that is not in `HARDWARE`."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Peak figures of one chip, enough for a roofline.

    matmul_flops: peak matmul FLOP/s by operand dtype, as XLA runs a default-precision dot of
    that dtype (f32 on TPU: one bf16 MXU pass; f32 on Ampere/Hopper: TF32 tensor cores).
    matrix_width: head dims below this leave the matrix unit partly idle (a [.., D] x [D, ..]
    contraction of D < width runs at D/width of peak).
    onchip_bytes: what one kernel instance can keep next to the compute units (VMEM per
    TensorCore, shared memory per SM, L2 per core).
    device_kind: the chip's `jax.Device.device_kind` (TPUs: how a kernel being traced learns
    which chip it is for; a deviceless topology's devices report the same); None elsewhere.
    attention_block: TPUs, the largest query and key tile the TPU attention kernels (splash,
    flash) are given on this chip, where the length allows; None elsewhere.
    softmax_rate: scores per second through a softmax's elementwise work (max, subtract, exp,
    sum, and a tiled kernel's rescaling) where it runs after the matmuls instead of beside
    them: XLA:CPU's loops (fitted, `calibrate_host`). None on TPUs and GPUs, whose exp units
    work beside the matrix unit, so a tiled kernel hides the softmax under its matmuls.
    fresh_page_rate: bytes/s at which a call's temporaries are paged in where every call
    maps them afresh: glibc hands allocations from its largest mmap threshold (32 MiB) up
    back to the OS when freed, so XLA:CPU's temporaries of that size are zero-filled page by
    page on every call (measured, `calibrate_host`). None where an allocator keeps device
    memory (TPUs, GPUs).
    overlaps: whether one op's arithmetic and its memory traffic overlap, so the op costs the
    larger of the two (the roofline: TPUs, GPUs), or run one after the other, so it costs
    their sum (XLA:CPU's loops: with the larger, one bandwidth cannot price the unfused
    program at head dims 16 and 64 alike; with the sum it does within 1.5×, see
    `benchmarks/cost_vs_measured.py`).
    link_bandwidth: bytes/s one chip sends to its neighbour on a ring along one mesh axis, one
    way (ICI port, NVLink, a host memory copy). link_latency: seconds each transfer adds (per
    hop; on `cpu` per collective). link_ways: the directions an all-gather sends in at once
    (2 on a TPU torus axis: both neighbours).
    """

    name: str
    description: str
    platform: str  # jax platform of the kernel registry: "cpu" | "tpu" | "cuda"
    matmul_flops: Mapping[str, float]
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    onchip_bytes: int
    onchip_kind: str
    matrix_width: int
    compile_target: str | None  # hlotool.targets name XLA can compile for here; None: none
    sources: tuple[str, ...]
    device_kind: str | None = None
    attention_block: int | None = None
    softmax_rate: float | None = None
    fresh_page_rate: float | None = None
    overlaps: bool = True
    link_bandwidth: float = 0.0
    link_latency: float = 0.0
    link_ways: int = 1

    def peak_flops(self, dtype: str) -> float:
        """Matmul FLOP/s for operands of `dtype` (float16 falls back to the bfloat16 figure)."""
        if dtype in self.matmul_flops:
            return self.matmul_flops[dtype]
        if dtype == "float16" and "bfloat16" in self.matmul_flops:
            return self.matmul_flops["bfloat16"]
        raise HlotoolError(f"no {dtype} matmul figure for {self.name}")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul_flops"] = dict(self.matmul_flops)
        out["sources"] = list(self.sources)
        return out


# Attention tiles per chip. 512 is the default of the TPU training stacks (axlearn's
# `tpu_block_size`, maxtext's `sa_block_*`); on v6e, whose MXU is 256 wide, axlearn measured
# splash attention 1/3 faster with 1024 (apple/axlearn#958) and sets it for that chip.
_BLOCKS_512 = "axlearn FlashAttention.Config.tpu_block_size and maxtext sa_block_* default: 512"
_BLOCKS_V6E = "apple/axlearn#958: splash block size 1024 on v6e, 1/3 faster than 512"


def _tpu(name, description, bf16, hbm, bw, vmem, width, target, kind, block, ici,
         extra=()) -> Hardware:
    # TPU f32 dots at default precision run as one bf16 pass: same peak as bf16. ici: (bytes/s
    # one port sends one way, its source).
    return Hardware(name, description, "tpu", {"bfloat16": bf16, "float32": bf16}, hbm, bw,
                    vmem, "VMEM per TensorCore", width, target,
                    (_TPU_INFO, _CLOUD_TPU, _BLOCKS_V6E if block > 512 else _BLOCKS_512,
                     ici[1], _ICI_LATENCY, *extra), kind, block,
                    link_bandwidth=ici[0], link_latency=1e-6, link_ways=2)


def _gpu(name, description, bf16, tf32, hbm, bw, smem, nvlink, source) -> Hardware:
    # Tensor-core dots have 16-wide k fragments: smaller head dims waste the unit. nvlink:
    # the datasheet's bidirectional NVLink bytes/s, half of it each way.
    return Hardware(name, description, "cuda", {"bfloat16": bf16, "float32": tf32}, hbm, bw,
                    smem, "shared memory per SM", 16, None,
                    (source, _CUDA_GUIDE, _NVLINK_LATENCY),
                    link_bandwidth=nvlink / 2, link_latency=1e-6)


_KIB, _MIB = 1024, 1024 * 1024

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "cpu", "this host: 2-core AMD EPYC VM, XLA:CPU (measured, see module docstring)",
            "cpu", {"float32": 63.4e9, "bfloat16": 63.4e9}, 24 * 1024**3, 5.65e9,
            1 * _MIB, "L2 per core", 1, "cpu",
            ("measured: benchmarks/cost_vs_measured.py --calibrate (median of 5 processes, "
             "jax 0.10.2; fitted to forward programs only, before calibrate_host took "
             "backward ones too)",
             "link: half an earlier fitted bandwidth (a copy); latency measured "
             "(module docstring)"), softmax_rate=0.69e9, fresh_page_rate=3.64e9,
            overlaps=False, link_bandwidth=0.885e9, link_latency=2e-4,
        ),
        # tpu_info: v4 has 2 TensorCores in megacore; per chip 275 TF, 1.23 TB/s, 32 GiB.
        _tpu("tpu-v4", "TPU v4, one chip (megacore)", 2.75e14, 34_400_000_000, 1.23e12,
             16 * _MIB, 128, None, "TPU v4", 512,
             (50e9, "glennklockwood.com/garden/processors/TPUv4 (from the TPU v4 ISCA 2023 "
                    "paper): ICI 400 Gb/s each direction per link")),
        _tpu("tpu-v5e", "TPU v5e, one chip", 1.97e14, 17_200_000_000, 8.20e11, 128 * _MIB,
             128, "tpu-v5e", "TPU v5 lite", 512,
             (50e9, "cloud.google.com/tpu/docs/v5e: ICI 400 GBps bidirectional per chip, 4 "
                    "ports")),
        # tpu_info says 2.46e12 B/s for v5p; the Cloud TPU v5p page says 2,765 GB/s. The
        # lower figure is what jax's own kernels tune for, so it is the one used here.
        _tpu("tpu-v5p", "TPU v5p, one chip (megacore)", 4.59e14, 103_000_000_000, 2.46e12,
             64 * _MIB, 128, "tpu-v5p", "TPU v5", 512,
             (100e9, "cloud.google.com/tpu/docs/v5p: ICI 1200 GBps bidirectional per chip, "
                     "3D torus (6 ports)"),
             ("cloud.google.com/tpu/docs/v5p: 2,765 GB/s HBM",)),
        _tpu("tpu-v6e", "TPU v6e, one chip", 9.20e14, 34_400_000_000, 1.64e12, 128 * _MIB,
             256, "tpu-v6e", "TPU v6 lite", 1024,
             (100e9, "cloud.google.com/tpu/docs/v6e: ICI 800 GBps bidirectional per chip, 4 "
                     "ports")),
        # NVLink: A100 12 links, H100 and H200 18 links of 50 GB/s (bidirectional) each.
        _gpu("a100", "NVIDIA A100 SXM 80GB", 312e12, 156e12, 80 * 10**9, 2.039e12, 164 * _KIB,
             600e9, "NVIDIA A100 datasheet (SXM4 80GB; NVLink 600 GB/s)"),
        _gpu("h100", "NVIDIA H100 SXM5 80GB", 989e12, 494.5e12, 80 * 10**9, 3.35e12,
             228 * _KIB, 900e9, "NVIDIA H100 datasheet (SXM5; NVLink 900 GB/s; NVIDIA/nccl#1264 "
             "measured 380 of 450 GB/s one way)"),
        _gpu("h200", "NVIDIA H200 SXM 141GB", 989e12, 494.5e12, 141 * 10**9, 4.8e12,
             228 * _KIB, 900e9, "NVIDIA H200 datasheet (SXM; NVLink 900 GB/s: mlcommons "
             "inference v4.1 H200-SXM-141GBx8: 18x 4th Gen NVLink, 900GB/s)"),
    )
}


def get_hardware(name: str | Hardware) -> Hardware:
    """The `Hardware` called `name`; raises `UnknownHardwareError` listing the valid names."""
    if isinstance(name, Hardware):
        return name
    # "target": what the user typed it as (`hlotool cost --target h100`).
    return lookup(HARDWARE, name, "target", UnknownHardwareError)


def for_device_kind(kind: str) -> Hardware | None:
    """The chip whose `jax.Device.device_kind` is `kind`; None for a chip not in the table."""
    return next((h for h in HARDWARE.values() if h.device_kind == kind), None)
