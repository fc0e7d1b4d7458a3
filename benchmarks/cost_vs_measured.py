"""Predicted vs measured native/kernel ratio (the cost model's acceptance check).

For each sequence length: the analytic roofline time of native (naive formula) and kernel on
`--target`, and the median wall time and peak memory of each, each side in its own process
(`hlotool.cost.measure`), with the relative error of the predicted ratio against the measured
one. A side whose predicted memory exceeds --limit-gb is skipped with a note. Done when
predicted and measured ratios agree within 2x.

On the CPU, --rounds (3) alternates native and kernel processes and takes medians, since one
process on this shared VM can run up to 2x slower than the next; a child repeats short calls
until it has timed at least a second. The table shows the bytes one native call faulted in:
XLA:CPU allocates the L×L temporaries afresh each call and the OS zero-fills every page again.
The `cpu` row's softmax rate and bandwidth are fitted at L = 1K and 2K (`--calibrate`,
`calibrate_host`) and so price those faults at their cost per page there; on a VM whose freed
memory goes back to the hypervisor (free page reporting) while a long call runs, the cost per
page grows with L, which is why native at 16K can measure slower than predicted.

--platform cpu (default): this host's XLA:CPU, the chunked kernel, float32, target `cpu`,
peak RSS. --platform cuda: the first CUDA GPU, the kernel hlotool picks there (cudnn for
bfloat16) on [B, L, H, D], bfloat16, target `h200`, peak device memory (`memory_stats()`);
exits with status 2 when jax has no CUDA device. --dry-run runs the cuda path's children on
the CPU with that kernel's stand-in (cuDNN's jax.nn call through XLA, Pallas in interpret
mode) at a tiny shape: it checks the plumbing, its times mean nothing.

    python benchmarks/cost_vs_measured.py                      # L = 2K..16K, B=1, H=4, D=64
    python benchmarks/cost_vs_measured.py --lengths 2048 4096 --heads 8
    python benchmarks/cost_vs_measured.py --calibrate          # re-measure the cpu figures
    python benchmarks/cost_vs_measured.py --platform cuda      # on an H200, jax[cuda]
    python benchmarks/cost_vs_measured.py --dry-run            # the cuda path, on the CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

NO_CUDA = "no CUDA device: jax.devices('gpu') is empty — run this on a GPU machine"
DRY_LENGTHS, DRY_HEADS = [128, 256], 2


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dry-run", action="store_true",
                   help="run the cuda path on the CPU (the kernel's CPU stand-in, tiny shapes)")
    p.add_argument("--lengths", type=int, nargs="+")
    p.add_argument("--heads", type=int)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--target", help="hardware row to predict with: default cpu, or h200 on cuda")
    p.add_argument("--repeats", type=int, help="timed runs per side: default 3 (cpu), 20 (cuda)")
    p.add_argument("--rounds", type=int,
                   help="native-then-kernel rounds per length, each side a fresh process: "
                        "default 3 (cpu: one process's speed drifts by up to 2x on a shared "
                        "VM), 1 (cuda)")
    p.add_argument("--limit-gb", type=float,
                   help="skip a side predicted to need more: default 12 (cpu), 90%% of the "
                        "target's HBM (cuda)")
    p.add_argument("--calibrate", action="store_true",
                   help="print calibrate_host() (cpu figures) from 5 fresh processes and "
                        "their medians, and exit")
    a = p.parse_args(argv)
    if a.dry_run:
        a.platform = "cuda"
    cuda = a.platform == "cuda"
    a.lengths = a.lengths or (DRY_LENGTHS if a.dry_run else [2048, 4096, 8192, 16384])
    a.heads = a.heads or (DRY_HEADS if a.dry_run else 4)
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.target = a.target or ("h200" if cuda else "cpu")
    a.repeats = a.repeats or (2 if a.dry_run else 20 if cuda else 3)
    a.rounds = a.rounds or (1 if cuda else 3)
    return a


def _cuda_devices() -> list:
    import jax

    try:
        return jax.devices("gpu")
    except Exception:  # jax without a CUDA plugin, or one that finds no device
        return []


def _row(n: int, pn: float, pk: float, rounds: list[dict], skip_note: str
         ) -> tuple[str, float | None]:
    """One length's line (predictions, measurements or why not, ratio error, agreement) and
    the ratio error (None when a side was not measured). `rounds`: per round, each side's
    Measurement (or the error that stopped it). Times are medians over rounds, the measured
    ratio the median of the rounds' ratios, memory the largest over rounds."""
    head = f"{n:>6} {pn:>11.4g}s {pk:>11.4g}s {pn / pk:>10.2f}"
    errors = list(dict.fromkeys(str(m) for r in rounds for m in r.values()
                                if isinstance(m, Exception)))
    if errors:
        return f"{head}  skipped: {'; '.join(errors)} ({skip_note})", None
    native, kernel = ([r[side] for r in rounds] for side in ("native", "kernel"))
    mr = statistics.median(a.seconds / b.seconds for a, b in zip(native, kernel))
    err = _ratio_error(pn / pk, mr)
    agree = "yes" if 0.5 <= (pn / pk) / mr <= 2 else "NO"
    ns, ks = (statistics.median(m.seconds for m in side) for side in (native, kernel))
    nm, km = (max(m.peak_bytes for m in side) / 1e9 for side in (native, kernel))
    faulted = statistics.median(m.faulted_bytes for m in native) / 1e9
    return (f"{head} {ns:>11.4g}s {ks:>11.4g}s {mr:>10.2f} {err:>+9.0%} {nm:>9.3f}G "
            f"{km:>9.3f}G {faulted:>11.2f}G {agree:>6}"), err


def _ratio_error(predicted: float, measured: float) -> float:
    """Relative error of the predicted native/kernel ratio against the measured one."""
    return (predicted - measured) / measured


def _header(a: argparse.Namespace, device: str, memory: str) -> str:
    least = " or more up to 1 s" if a.platform == "cpu" else ""
    lines = [f"B=1 H={a.heads} D={a.dim} {a.dtype}, {device}, target {a.target}",
             f"{a.rounds} round{'s' if a.rounds != 1 else ''} of native then kernel, each a "
             f"fresh process timing {a.repeats} calls{least}; meas: medians over rounds (meas "
             f"ratio: median of each round's ratio); memory: {memory}; faulted/call: native",
             f"{'L':>6} {'pred native':>12} {'pred kernel':>12} {'pred ratio':>10} "
             f"{'meas native':>12} {'meas kernel':>12} {'meas ratio':>10} {'ratio err':>9} "
             f"{'mem native':>10} {'mem kernel':>10} {'faulted/call':>12} {'agree':>6}"]
    return "\n".join(lines)


CALIBRATE_ONCE = """
from hlotool.cost.measure import calibrate_host
hw = calibrate_host(repeats=5)
print(hw.matmul_flops["float32"], hw.softmax_rate, hw.hbm_bandwidth, hw.fresh_page_rate)
"""


def _calibrate(processes: int = 5) -> int:
    """calibrate_host() in fresh processes: on this VM one process's figures differ from the
    next one's by up to ±30%, so the cpu row holds the medians over processes."""
    import subprocess

    units = (("matmul", "GFLOP/s"), ("softmax", "G scores/s"), ("bandwidth", "GB/s"),
             ("page-in", "GB/s"))

    def line(values: list[float]) -> str:
        return ", ".join(f"{name} {v / 1e9:.3g} {unit}" for (name, unit), v in zip(units, values))

    runs = []
    for i in range(processes):
        done = subprocess.run([sys.executable, "-c", CALIBRATE_ONCE], capture_output=True,
                              text=True)
        if done.returncode:
            print(f"process {i + 1}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
            continue
        runs.append(list(map(float, done.stdout.split())))
        print(f"process {i + 1}: {line(runs[-1])}", flush=True)
    if runs:
        print(f"median: {line([statistics.median(r[j] for r in runs) for j in range(4)])}")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    on_gpu = a.platform == "cuda" and not a.dry_run
    if on_gpu:
        # Asked for the GPU explicitly: let jax see it, and keep this process from reserving
        # most of its memory (the children measure there).
        os.environ["JAX_PLATFORMS"] = "cuda"
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from hlotool.cost.measure import measure, predicted_bytes
    from hlotool.cost.model import analytic, kernel_for
    from hlotool.errors import HlotoolError
    from hlotool.hardware import get_hardware
    from hlotool.site import AttentionSite

    if a.calibrate:
        return _calibrate()
    try:
        target = get_hardware(a.target)
    except HlotoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    def site_of(n: int) -> AttentionSite:
        return AttentionSite(batch=1, q_len=n, kv_len=n, num_q_heads=a.heads,
                             num_kv_heads=a.heads, head_dim=a.dim, v_head_dim=a.dim,
                             dtype=a.dtype, scale=a.dim ** -0.5)

    try:
        kernel = kernel_for(site_of(a.lengths[0]), target).name
    except HlotoolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if on_gpu:
        devices = _cuda_devices()
        if not devices:
            print(NO_CUDA, file=sys.stderr)
            return 2
        device, memory = f"{devices[0].device_kind} ({kernel})", "peak GPU bytes in use"
    elif a.dry_run:
        device = f"DRY RUN: {kernel}'s stand-in on the CPU, times mean nothing"
        memory = "peak RSS (no device memory stats on the CPU)"
    else:
        device, memory = "this host's CPU (chunked)", "peak RSS"
    limit_gb = a.limit_gb or (0.9 * target.hbm_bytes / 1e9 if a.platform == "cuda" else 12.0)

    print(_header(a, device, memory), flush=True)
    errors = []
    for n in a.lengths:
        site = site_of(n)
        pn, pk = (analytic(site, target, s).seconds for s in ("native", "kernel"))
        rounds = []
        for _ in range(a.rounds):
            got = {}
            for side in ("native", "kernel"):
                try:
                    got[side] = measure(site, side, repeats=a.repeats,
                                        limit_bytes=int(limit_gb * 1e9), platform=a.platform,
                                        interpret=a.dry_run,
                                        min_seconds=1.0 if a.platform == "cpu" else 0.0)
                except HlotoolError as e:
                    got[side] = e
            rounds.append(got)
            if any(isinstance(m, Exception) for m in got.values()):
                break
        note = f"native predicted {predicted_bytes(site, 'native') / 1e9:.1f} GB"
        line, err = _row(n, pn, pk, rounds, note)
        if err is not None:
            errors.append(err)
        print(line, flush=True)
    if errors:
        mags = [abs(e) for e in errors]
        print(f"ratio error (predicted vs measured): median {statistics.median(mags):.0%}, "
              f"max {max(mags):.0%} over {len(mags)} lengths")
    return 0


if __name__ == "__main__":
    sys.exit(main())
