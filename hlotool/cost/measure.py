"""Measured: time and peak memory of the native and kernel probe programs on this host, each
side in its own process (so one side's peak RSS cannot hide the other's), median of repeats.

Run as `python -m hlotool.cost.measure SITE_JSON SIDE REPEATS`; prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

from hlotool.errors import HlotoolError
from hlotool.site import AttentionSite

# Keep a child under this much predicted memory: the machine is shared.
DEFAULT_LIMIT_BYTES = 12 * 10**9


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median wall seconds of a jitted call (compile excluded) and the child's peak RSS."""

    side: str
    seconds: float
    peak_rss_bytes: int
    repeats: int

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
            limit_bytes: int = DEFAULT_LIMIT_BYTES, timeout: float = 600) -> Measurement:
    """Time `side` ("native" or "kernel", the host's kernel) of `site` in a child process."""
    need = predicted_bytes(site, side)
    if need > limit_bytes:
        raise HlotoolError(f"{side} would need ~{need / 1e9:.1f} GB (limit "
                           f"{limit_bytes / 1e9:.1f} GB): not measured")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "hlotool.cost.measure", json.dumps(site.to_json()), side,
           str(repeats)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HlotoolError(f"measuring {side} took over {timeout:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HlotoolError(f"measuring {side} failed: {last}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Measurement(side, out["seconds"], out["peak_rss_bytes"], repeats)


def _site_from_json(doc: dict[str, Any]) -> AttentionSite:
    fields = {f.name for f in dataclasses.fields(AttentionSite)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in doc.items() if k in fields}
    return AttentionSite(**kw)


def _child(site: AttentionSite, side: str, repeats: int) -> dict[str, Any]:
    import jax

    from hlotool.cost.model import kernel_for
    from hlotool.cost.xla import example_arrays, kernel_program, naive_program
    from hlotool.hardware import HARDWARE

    fn, args = (naive_program(site) if side == "native"
                else kernel_program(site, kernel_for(site, HARDWARE["cpu"])))
    arrays = example_arrays(args)
    f = jax.jit(fn)
    f(*arrays).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(*arrays).block_until_ready()
        times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"seconds": sorted(times)[len(times) // 2], "peak_rss_bytes": rss}


if __name__ == "__main__":
    site_doc, side_arg, repeats_arg = sys.argv[1:4]
    print(json.dumps(_child(_site_from_json(json.loads(site_doc)), side_arg, int(repeats_arg))))
