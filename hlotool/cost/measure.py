"""Measured: time and peak memory of the native and kernel probe programs on this host, each
side in its own process (so one side's peak memory cannot hide the other's), median of repeats
after warm-up calls (compile excluded), each call ended by `block_until_ready`. With
`min_seconds`, short calls are repeated until that much time was timed, so a millisecond
kernel is not judged on three samples.

Each call's minor page faults are counted too: XLA:CPU allocates a call's temporaries afresh
and the OS faults every page of them in again, which for the naive program's L×L buffers is a
large share of its time on a host (see `benchmarks/cost_vs_measured.py`).

platform "cpu" (default) times the CPU's kernel (chunked) on XLA:CPU; "cuda" times the kernel
the registry picks for CUDA (`kernel_for`: cudnn for bfloat16 and float16, pallas_gpu where jax
still ships it, else chunked) on the first CUDA device and also reports its peak device memory
(`memory_stats()["peak_bytes_in_use"]`). `interpret=True` runs the cuda child on the CPU with
that kernel's stand-in (`AttentionKernel.stand_in`: Pallas in interpret mode, cuDNN's jax.nn
call through XLA): a plumbing check, never a timing.

Run as `python -m hlotool.cost.measure SITE_JSON SIDE REPEATS [OPTIONS_JSON]`; prints one
JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hlotool.errors import HlotoolError
from hlotool.site import AttentionSite

if TYPE_CHECKING:
    from hlotool.hardware import Hardware
    from hlotool.kernels import AttentionKernel

# Keep a child under this much predicted memory: the machine is shared.
DEFAULT_LIMIT_BYTES = 12 * 10**9
PLATFORMS = ("cpu", "cuda")
# The chip whose platform picks the kernel a child times (`kernel_for`).
_CHIP = {"cpu": "cpu", "cuda": "h100"}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median wall seconds of a jitted call (compile excluded), the child's peak RSS, the
    median bytes one call faulted in (minor page faults × page size) and, on a device that
    reports it, its peak device memory in use (None otherwise). repeats: timed calls."""

    side: str
    seconds: float
    peak_rss_bytes: int
    repeats: int
    platform: str = "cpu"
    peak_device_bytes: int | None = None
    faulted_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Peak device memory where known, else peak RSS."""
        return self.peak_rss_bytes if self.peak_device_bytes is None else self.peak_device_bytes

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predicted_bytes(site: AttentionSite, side: str) -> int:
    """Memory a side needs at its peak: operands, output and temporaries."""
    from hlotool.cost.model import kernel_temp_bytes, mask_operand_bytes, native_temp_bytes

    item = site.itemsize
    io = item * (site.batch * site.q_len * site.num_q_heads * (site.head_dim + site.v_head_dim)
                 + site.batch * site.kv_len * site.num_kv_heads
                 * (site.head_dim + site.v_head_dim))
    temp = native_temp_bytes(site) if side == "native" else kernel_temp_bytes(site)
    return io + temp + mask_operand_bytes(site)


def measure(site: AttentionSite, side: str, *, repeats: int = 3,
            limit_bytes: int = DEFAULT_LIMIT_BYTES, timeout: float = 600,
            platform: str = "cpu", interpret: bool = False,
            min_seconds: float = 0.0) -> Measurement:
    """Time `side` ("native" or "kernel", the platform's kernel) of `site` in a child process.

    repeats: timed calls at least; min_seconds: keep timing (up to 20 × repeats calls) until
    this much wall time was timed. platform: "cpu" or "cuda" (see the module docstring);
    interpret: run the cuda child on the CPU with the kernel in Pallas interpret mode (a
    correctness check of the plumbing).
    """
    if platform not in PLATFORMS:
        raise HlotoolError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    need = predicted_bytes(site, side)
    if need > limit_bytes:
        raise HlotoolError(f"{side} would need ~{need / 1e9:.1f} GB (limit "
                           f"{limit_bytes / 1e9:.1f} GB): not measured")
    on_device = platform == "cuda" and not interpret
    env = {**os.environ, "JAX_PLATFORMS": "cuda" if on_device else "cpu"}
    if on_device:  # grow on demand: the parent may hold a context on the same GPU
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    options = {"platform": platform, "interpret": interpret, "min_seconds": min_seconds}
    cmd = [sys.executable, "-m", "hlotool.cost.measure", json.dumps(site.to_json()), side,
           str(repeats), json.dumps(options)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HlotoolError(f"measuring {side} took over {timeout:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HlotoolError(f"measuring {side} failed: {last}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Measurement(side, out["seconds"], out["peak_rss_bytes"], out["repeats"], platform,
                       out["peak_device_bytes"], out["faulted_bytes"])


def _site_from_json(doc: dict[str, Any]) -> AttentionSite:
    fields = {f.name for f in dataclasses.fields(AttentionSite)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in doc.items() if k in fields}
    return AttentionSite(**kw)


def _kernel(site: AttentionSite, platform: str, interpret: bool) -> AttentionKernel:
    from hlotool.cost.model import kernel_for
    from hlotool.hardware import HARDWARE

    kernel = kernel_for(site, HARDWARE[_CHIP[platform]])
    return kernel.stand_in() if interpret else kernel


def _child(site: AttentionSite, side: str, repeats: int, platform: str = "cpu",
           interpret: bool = False, min_seconds: float = 0.0) -> dict[str, Any]:
    import jax

    from hlotool.cost.xla import example_arrays, kernel_program, naive_program

    if platform == "cuda" and not interpret and jax.devices()[0].platform != "gpu":
        raise HlotoolError(f"no CUDA device in the child: {jax.devices()}")
    fn, args = (naive_program(site) if side == "native"
                else kernel_program(site, _kernel(site, platform, interpret)))
    arrays = example_arrays(args)
    f = jax.jit(fn)
    for _ in range(1 if platform == "cpu" else 3):  # compile; on a GPU also settle clocks
        f(*arrays).block_until_ready()
    times, faults = [], []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < 20 * repeats):
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        f(*arrays).block_until_ready()
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    stats = jax.devices()[0].memory_stats() or {}
    return {"seconds": statistics.median_high(times), "repeats": len(times),
            "peak_rss_bytes": rss,
            "faulted_bytes": statistics.median_high(faults) * resource.getpagesize(),
            "peak_device_bytes": stats.get("peak_bytes_in_use")}


if __name__ == "__main__":
    site_doc, side_arg, repeats_arg = sys.argv[1:4]
    opts = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    print(json.dumps(_child(_site_from_json(json.loads(site_doc)), side_arg, int(repeats_arg),
                            opts.get("platform", "cpu"), opts.get("interpret", False),
                            opts.get("min_seconds", 0.0))))


def _calibration_site(batch: int, length: int, heads: int, dim: int) -> AttentionSite:
    return AttentionSite(batch=batch, q_len=length, kv_len=length, num_q_heads=heads,
                         num_kv_heads=heads, head_dim=dim, v_head_dim=dim, dtype="float32",
                         scale=dim ** -0.5, causal=True)


# Where `calibrate_host` times both sides: causal layers of small models (the first is the
# bundled examples' at --seq-len 1024), head dims 16 to 64: on XLA:CPU a D=16 contraction and
# a kernel's tile loop run slower per score than at D=64, which one shape alone would not show.
CALIBRATION_SITES = (_calibration_site(2, 1024, 4, 16), _calibration_site(1, 2048, 4, 32),
                     _calibration_site(1, 1024, 4, 64))


def calibrate_host(repeats: int = 5,
                   sites: Sequence[AttentionSite] = CALIBRATION_SITES) -> Hardware:
    """The `cpu` entry with its rates measured on this host, in this process.

    Every call below is timed `repeats` times, in rounds (one call of each per round).
    Matmul: a [8, 1024, 64] x [8, 64, 512] f32 batched dot (one attention tile per head).
    Fresh pages: a 64 MiB result made afresh each call (paged in, zero-filled, written). Both
    from the fastest of their calls: a call slowed by another process would make the
    matmuls alone outlast the programs fitted below.
    Softmax rate and bandwidth: on XLA:CPU the unfused softmax passes are bound by their
    exp/reduce loops and by paging in their freshly mapped L×L buffers, not by DRAM (a pass
    over a held 256 MiB buffer moves 25 GB/s here), and the chunked kernel by the elementwise
    work of its tiles; so the figures the model needs are those at which it best reproduces
    the two programs the benchmarks time: `hlotool.cost.model.fit_host` fits them to the
    median times of the naive program and the chunked kernel at `sites`
    (`hlotool.cost.xla`'s probe programs), each forward and forward + backward: a train
    step's sites are priced both ways, and on XLA:CPU the naive backward costs more per
    pass than its forward while the kernel's costs less, so forward times alone would
    misprice them (measured at the four causal shapes B·L·H·D = 2·1024·4·16, 1·2048·4·32,
    1·1024·4·64, 2·2048·4·16: fitted to forwards, native forward + backward came out
    1.4–2.4× slower than priced, the kernel's 0.67–0.77×; fitted to both, 1.1–2.0× and
    0.78–0.99×, and the forwards 0.64–1.55×).
    """
    import jax
    import jax.numpy as jnp

    from hlotool.cost.model import Timed, fit_host, kernel_for
    from hlotool.cost.xla import example_arrays, kernel_program, naive_program, with_backward
    from hlotool.hardware import get_hardware

    a, b = jnp.ones((8, 1024, 64), jnp.float32), jnp.ones((8, 512, 64), jnp.float32)
    dot = (jax.jit(lambda a, b: jnp.einsum("hqd,hkd->hqk", a, b)), a, b)
    # A fresh 64 MiB result each call: paged in (zero-filled) and written.
    fresh = (jax.jit(lambda x: jnp.broadcast_to(x, (16 * 2**20,)) + 0.0), jnp.float32(1))
    runs = [(site, backward) for site in sites for backward in (False, True)]
    programs = []  # per run, its naive program then its kernel
    for site, backward in runs:
        for fn, args in (naive_program(site),
                         kernel_program(site, kernel_for(site, get_hardware("cpu")))):
            fn = with_backward(fn) if backward else fn
            programs.append((jax.jit(fn), *example_arrays(args)))
    calls = [dot, fresh, *programs]
    for f, *args in calls:
        jax.block_until_ready(f(*args))  # compiled
    # Round after round of every call, so that a spell of load on a shared host slows the
    # matmul as it slows the programs fitted to it.
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for (f, *args), seen in zip(calls, times):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            seen.append(time.perf_counter() - start)
    flops = 2 * 8 * 1024 * 512 * 64 / min(times[0])
    page_in = 64 * 2**20 / min(times[1])
    host = dataclasses.replace(get_hardware("cpu"),
                               matmul_flops={"float32": flops, "bfloat16": flops},
                               fresh_page_rate=page_in,
                               sources=("calibrate_host() on this host",))
    medians = [statistics.median(seen) for seen in times[2:]]
    return fit_host(host, [Timed(site, medians[2 * i], medians[2 * i + 1], backward)
                           for i, (site, backward) in enumerate(runs)])
