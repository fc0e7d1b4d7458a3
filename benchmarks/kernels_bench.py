"""Chunked (blockwise online-softmax) attention vs the naive jitted formula on this CPU.

Each measurement runs in its own process, so peak RSS (`ru_maxrss`) belongs to one kernel at
one length. Every child is capped with RLIMIT_AS; a naive run whose score matrices alone
would pass the cap is not started and shows as "OOM (needs ≈X GB)".

    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --lengths 1024,2048 --cap-gb 8
    JAX_PLATFORMS=cpu python benchmarks/kernels_bench.py --mask window:512 --lengths 8192

Shapes: B=1, H=8, D=64, float32, q/k/v [B, L, H, D]; `--mask` none (default), causal, or
window:W (causal, each query sees its W most recent keys, as Mistral): the naive side applies
it with `jnp.where` over iotas, the chunked kernel skips the blocks outside it. Times exclude compilation
(best of --repeats runs after one warm-up call): wall seconds, and in parentheses the
process's CPU seconds (all threads), which other load on a shared machine inflates less.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

B, H, D = 1, 8, 64
# Live [B, H, L, L] float32 matrices the naive program holds at its peak (scores and
# probabilities forward; plus dP and dS backward), calibrated against measured RSS.
NAIVE_MATRICES = {"fwd": 2.5, "fwd+bwd": 4.5}
BASE_BYTES = 0.6e9  # jax runtime, compiled code, inputs


def _child(impl: str, mode: str, length: int, repeats: int, cap: int, mask: str) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import jax
    import jax.numpy as jnp

    from hlotool.kernels import get

    kernel = get("reference" if impl == "naive" else "chunked")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (B, length, H, D), jnp.float32) for key in keys)
    window = int(mask.split(":")[1]) if mask.startswith("window:") else None
    if impl == "naive":
        def attend(q, k, v):  # the plain formula, as a user writes it
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
            if mask != "none":
                i, j = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
                keep = (j <= i) if window is None else (j <= i) & (j > i - window)
                s = jnp.where(keep, s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    else:
        def attend(q, k, v):
            return kernel(q, k, v, scale=D**-0.5, causal=mask != "none",
                          window=None if window is None else (window - 1, 0))
    if mode == "fwd":
        fn = jax.jit(attend)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2)))
    start = time.perf_counter()
    jax.block_until_ready(fn(q, k, v))
    compile_and_first = time.perf_counter() - start
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(q, k, v))
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": best, "cpu_seconds": best_cpu, "first_call_s": compile_and_first,
            "peak_bytes": peak}


def _run(impl: str, mode: str, length: int, repeats: int, cap: int, mask: str) -> dict:
    if impl == "naive":
        need = NAIVE_MATRICES[mode] * B * H * length * length * 4 + BASE_BYTES
        if need > cap:
            return {"skipped": f"OOM (needs ≈{need / 1e9:.0f} GB)"}
    cmd = [sys.executable, __file__, "--child", impl, mode, str(length), str(repeats),
           str(cap), mask]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1][:80]
        return {"skipped": f"failed under the {cap / 2**30:.0f} GiB cap: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(r: dict) -> tuple[str, str]:
    if "skipped" in r:
        return r["skipped"], "-"
    return (f"{r['seconds']:.2f} s ({r['cpu_seconds']:.2f})",
            f"{r['peak_bytes'] / 2**20:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cap-gb", type=float, default=12.0,
                        help="address-space cap per child process, GiB")
    parser.add_argument("--mask", default="none",
                        help="none, causal or window:W (causal, W keys per query)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, mode, length, repeats, cap, mask = args.child
        print(json.dumps(_child(impl, mode, int(length), int(repeats), int(cap), mask)))
        return
    if not (args.mask in ("none", "causal") or args.mask.startswith("window:")):
        parser.error(f"--mask must be none, causal or window:W, got {args.mask!r}")

    cap = int(args.cap_gb * 2**30)
    print(f"B={B} H={H} D={D} float32, mask {args.mask}; best of {args.repeats} after warm-up; "
          f"children capped at {args.cap_gb:g} GiB; {os.cpu_count()} CPUs")
    header = ("L", "pass", "naive time", "naive peak", "chunked time", "chunked peak",
              "time ratio", "peak ratio")
    widths = (6, 8, 22, 11, 16, 13, 11, 11)
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)), flush=True)
    for length in map(int, args.lengths.split(",")):
        for mode in args.modes.split(","):
            naive = _run("naive", mode, length, args.repeats, cap, args.mask)
            chunked = _run("chunked", mode, length, args.repeats, cap, args.mask)
            ratios = ("-", "-")
            if "skipped" not in naive and "skipped" not in chunked:
                ratios = (f"{chunked['seconds'] / naive['seconds']:.2f}x",
                          f"{chunked['peak_bytes'] / naive['peak_bytes']:.3f}x")
            row = (str(length), mode, *_fmt(naive), *_fmt(chunked), *ratios)
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


if __name__ == "__main__":
    main()
