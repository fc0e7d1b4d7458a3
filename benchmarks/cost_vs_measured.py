"""Predicted vs measured native/kernel ratio on this host (the cost model's acceptance check).

For each sequence length: the analytic roofline time of native (naive formula) and kernel
(the host's flash kernel, chunked on CPU) on `--target` (default cpu), and the median wall
time and peak RSS of each, each side in its own process. A side whose predicted memory
exceeds --limit-gb is skipped with a note. Done when predicted and measured ratios agree
within 2x.

    python benchmarks/cost_vs_measured.py                      # L = 2K..16K, B=1, H=4, D=64
    python benchmarks/cost_vs_measured.py --lengths 2048 4096 --heads 8
    python benchmarks/cost_vs_measured.py --calibrate          # re-measure the cpu figures

On a GPU host (e.g. H200, jax with CUDA): `--target h200 --platform cuda` times the Pallas GPU
kernel instead of chunked; not run here (no GPU in this session).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hlotool.cost.measure import measure, predicted_bytes  # noqa: E402
from hlotool.cost.model import analytic  # noqa: E402
from hlotool.errors import HlotoolError  # noqa: E402
from hlotool.hardware import measure_host  # noqa: E402
from hlotool.site import AttentionSite  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--target", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit-gb", type=float, default=12.0)
    p.add_argument("--calibrate", action="store_true", help="print measure_host() and exit")
    a = p.parse_args()
    if a.calibrate:
        hw = measure_host()
        print(f"matmul {hw.matmul_flops['float32'] / 1e9:.1f} GFLOP/s, "
              f"unfused attention {hw.hbm_bandwidth / 1e9:.2f} GB/s")
        return
    print(f"B=1 H={a.heads} D={a.dim} float32, target {a.target}, median of {a.repeats}")
    print(f"{'L':>6} {'pred native':>12} {'pred kernel':>12} {'pred ratio':>10} "
          f"{'meas native':>12} {'meas kernel':>12} {'meas ratio':>10} {'RSS native':>10} "
          f"{'RSS kernel':>10} {'agree':>6}")
    for n in a.lengths:
        site = AttentionSite(batch=1, q_len=n, kv_len=n, num_q_heads=a.heads,
                             num_kv_heads=a.heads, head_dim=a.dim, v_head_dim=a.dim,
                             dtype="float32", scale=a.dim ** -0.5)
        pn, pk = (analytic(site, a.target, s).seconds for s in ("native", "kernel"))
        got = {}
        for side in ("native", "kernel"):
            try:
                got[side] = measure(site, side, repeats=a.repeats,
                                    limit_bytes=int(a.limit_gb * 1e9))
            except HlotoolError as e:
                got[side] = e
        if all(not isinstance(m, Exception) for m in got.values()):
            mr = got["native"].seconds / got["kernel"].seconds
            agree = "yes" if 0.5 <= (pn / pk) / mr <= 2 else "NO"
            print(f"{n:>6} {pn:>11.3f}s {pk:>11.3f}s {pn / pk:>10.2f} "
                  f"{got['native'].seconds:>11.3f}s {got['kernel'].seconds:>11.3f}s {mr:>10.2f} "
                  f"{got['native'].peak_rss_bytes / 1e9:>9.2f}G "
                  f"{got['kernel'].peak_rss_bytes / 1e9:>9.2f}G {agree:>6}")
        else:
            why = "; ".join(str(m) for m in got.values() if isinstance(m, Exception))
            print(f"{n:>6} {pn:>11.3f}s {pk:>11.3f}s {pn / pk:>10.2f}  skipped: {why} "
                  f"(native predicted {predicted_bytes(site, 'native') / 1e9:.1f} GB)")


if __name__ == "__main__":
    main()
