"""Native attention vs each CUDA flash kernel hlotool offers, on one GPU: time and peak memory,
forward and forward+backward, outputs compared, one table.

    python benchmarks/gpu_bench.py                         # a CUDA machine, jax[cuda12]
    python benchmarks/gpu_bench.py --lengths 4096 8192 --repeats 10
    JAX_PLATFORMS=cpu python benchmarks/gpu_bench.py --dry-run   # anywhere: the plumbing

Shapes: q [B, L, Hq, D], k/v [B, L, Hkv, D]; by default B=1, Hq=16, Hkv=4 (GQA 4:1), D=128,
bfloat16, causal, L = 1K ... 32K. "native" is the naive formula jitted (`jnp.repeat` of the K/V
heads, the scores masked with `jnp.where`, `jax.nn.softmax`); each kernel is the one hlotool's
CUDA table lists (`hlotool.kernels.registry.PRIORITY["cuda"]`: cudnn, pallas_gpu where jax
still ships it, chunked) that takes the site, called directly.

Each (length, pass, implementation) runs in a process of its own, so its peak device memory
(`memory_stats()["peak_bytes_in_use"]`, the inputs included) is its own; a child that runs out
of memory shows as OOM. Times are the median of --repeats calls after three warm-up calls
(compile excluded), each ended by `block_until_ready`. Outputs (the forward's output; dq, dk,
dv for forward+backward) are compared with native's, or with chunked's where native ran out of
memory: the largest difference over the reference's largest magnitude.

The last lines check issue 40's targets at --target-length (8192): the best kernel at least 2×
native's speed forward+backward, and at least 8× less peak memory.

--dry-run runs on the CPU at tiny shapes (L = 128, Hq=4, Hkv=1, D=64), in this process, each
kernel through its CPU stand-in (cuDNN's jax.nn call through XLA, Pallas in interpret mode):
it checks the plumbing; its times and memory mean nothing. Without --dry-run and without a CUDA
device it exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NO_CUDA = "no CUDA device: jax.devices('gpu') is empty — run this on a GPU machine"
PASSES = ("fwd", "fwd+bwd")
DRY = {"lengths": [128], "heads": 4, "kv_heads": 1, "dim": 64}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU, tiny shapes, each kernel's CPU stand-in, in-process")
    p.add_argument("--lengths", type=int, nargs="+")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="query heads (default 16; 4 dry)")
    p.add_argument("--kv-heads", type=int, help="K/V heads (default 4; 1 dry)")
    p.add_argument("--dim", type=int, help="head dim (default 128; 64 dry)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--target-length", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=600, help="seconds per child")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    dry = DRY if a.dry_run else {"lengths": [1024, 2048, 4096, 8192, 16384, 32768],
                                 "heads": 16, "kv_heads": 4, "dim": 128}
    a.lengths = a.lengths or dry["lengths"]
    a.heads = a.heads or dry["heads"]
    a.kv_heads = a.kv_heads or dry["kv_heads"]
    a.dim = a.dim or dry["dim"]
    return a


def _site(a: argparse.Namespace, length: int):
    from hlotool.site import AttentionSite

    return AttentionSite(batch=a.batch, q_len=length, kv_len=length, num_q_heads=a.heads,
                         num_kv_heads=a.kv_heads, head_dim=a.dim, v_head_dim=a.dim,
                         dtype=a.dtype, scale=a.dim ** -0.5,
                         mask="causal" if a.causal else "none")


def _kernels(site) -> list[str]:
    """The CUDA table's kernels that take `site` (the naive reference left out)."""
    from hlotool.kernels import registry

    return [name for name in registry.PRIORITY["cuda"] if name != "reference"
            and registry.registered(name).supports(site)]


def _program(site, impl: str, dry: bool):
    """(function of q, k, v, example arrays) for one implementation, forward."""
    from hlotool.cost.xla import example_arrays, kernel_program, naive_program
    from hlotool.kernels import registry

    if impl == "native":
        fn, args = naive_program(site)
    else:
        kernel = registry.registered(impl)
        fn, args = kernel_program(site, kernel.stand_in() if dry else kernel)
    return fn, example_arrays(args)


def measure(site, impl: str, which: str, repeats: int, dry: bool, out_path: str | None
            ) -> dict:
    """Median seconds, peak bytes (device where it says, else RSS) and, in `out_path`, the
    outputs compared (float32 .npz)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    fn, arrays = _program(site, impl, dry)
    if which == "fwd":
        run = jax.jit(fn)
    else:
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))), out

        run = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    for _ in range(1 if dry else 3):
        jax.block_until_ready(run(*arrays))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = jax.block_until_ready(run(*arrays))
        times.append(time.perf_counter() - start)
    outs = [result] if which == "fwd" else [*result[0]]
    if out_path:
        np.savez(out_path, *[np.asarray(x, np.float32) for x in outs])
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        peak = stats["peak_bytes_in_use"]
    else:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": statistics.median(times), "peak_bytes": int(peak)}


def _in_child(a, length: int, impl: str, which: str, out_path: str) -> dict:
    spec = json.dumps({"length": length, "impl": impl, "which": which, "out": out_path})
    argv = [sys.executable, os.path.abspath(__file__), "--child", spec,
            "--batch", str(a.batch), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
            "--dim", str(a.dim), "--dtype", a.dtype, "--repeats", str(a.repeats)]
    if not a.causal:
        argv.append("--no-causal")
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over {a.timeout:.0f} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": "OOM" if "RESOURCE_EXHAUSTED" in done.stderr or "out of memory"
                in done.stderr.lower() else last[:80]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _error(path: str, reference: str) -> float:
    import numpy as np

    with np.load(path) as got, np.load(reference) as want:
        worst = 0.0
        for name in want.files:
            x, ref = got[name], want[name]
            worst = max(worst, float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30)))
    return worst


def _cuda_devices():
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.child:
        spec = json.loads(a.child)
        print(json.dumps(measure(_site(a, spec["length"]), spec["impl"], spec["which"],
                                 a.repeats, False, spec["out"])))
        return 0
    if a.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    if a.dry_run:
        device = "DRY RUN: the CPU, each kernel's CPU stand-in; times and memory mean nothing"
    else:
        devices = _cuda_devices()
        if not devices:
            print(NO_CUDA, file=sys.stderr)
            return 2
        device = f"{devices[0].device_kind}, jax {jax.__version__}"
    print(f"{device}\nB={a.batch} Hq={a.heads} Hkv={a.kv_heads} D={a.dim} {a.dtype} "
          f"{'causal' if a.causal else 'no mask'}; median of {a.repeats} calls")
    header = (f"{'L':>6} {'pass':<8} {'impl':<11} {'ms':>9} {'x native':>9} "
              f"{'peak GiB':>9} {'x less mem':>10} {'max err':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for length in a.lengths:
            site = _site(a, length)
            impls = ["native", *_kernels(site)]
            for which in PASSES:
                got = {}
                for impl in impls:
                    out = os.path.join(scratch, f"{length}-{which}-{impl}.npz")
                    try:
                        got[impl] = (measure(site, impl, which, a.repeats, True, out)
                                     if a.dry_run else _in_child(a, length, impl, which, out))
                    except Exception as e:  # noqa: BLE001 - one row's failure, not the table's
                        got[impl] = {"error": f"{type(e).__name__}: {str(e)[:60]}"}
                    got[impl]["out"] = out
                reference = next((i for i in ("native", "chunked")
                                  if "error" not in got.get(i, {"error": 1})), None)
                base = got["native"]
                for impl in impls:
                    m = got[impl]
                    if "error" in m:
                        print(f"{length:>6} {which:<8} {impl:<11} {m['error']}")
                        continue
                    fast = (f"{base['seconds'] / m['seconds']:.2f}" if "error" not in base
                            else "-")
                    less = (f"{base['peak_bytes'] / m['peak_bytes']:.1f}" if "error" not in base
                            else "-")
                    err = ("ref" if impl == reference else
                           f"{_error(m['out'], got[reference]['out']):.1e}" if reference
                           else "-")
                    print(f"{length:>6} {which:<8} {impl:<11} {m['seconds'] * 1e3:>9.3f} "
                          f"{fast:>9} {m['peak_bytes'] / 2**30:>9.3f} {less:>10} {err:>9}")
                    rows.append((length, which, impl, m, base))
    _targets(a, rows)
    return 0


def _targets(a: argparse.Namespace, rows: list) -> None:
    """Issue 40's targets at --target-length, forward+backward: the best kernel ≥ 2× native's
    speed and ≥ 8× less peak memory (not judged where native did not run)."""
    at = [(impl, m, base) for length, which, impl, m, base in rows
          if length == a.target_length and which == "fwd+bwd" and impl != "native"]
    if not at:
        print(f"target (L={a.target_length}, fwd+bwd): not measured")
        return
    impl, m, base = min(at, key=lambda r: r[1]["seconds"])
    if "error" in base:
        print(f"target (L={a.target_length}, fwd+bwd): best {impl}; native did not run "
              f"({base['error']})")
        return
    speed, memory = base["seconds"] / m["seconds"], base["peak_bytes"] / m["peak_bytes"]
    print(f"target (L={a.target_length}, fwd+bwd): best {impl} ×{speed:.2f} native's speed "
          f"(≥ 2: {'yes' if speed >= 2 else 'NO'}), ×{memory:.1f} less peak memory "
          f"(≥ 8: {'yes' if memory >= 8 else 'NO'})")


if __name__ == "__main__":
    sys.exit(main())
