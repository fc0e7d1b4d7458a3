"""flash_jit vs jax.jit on a small causal decoder: peak memory, run time, trace overhead.

    python benchmarks/flash_jit_bench.py                 # all three tables
    python benchmarks/flash_jit_bench.py --lengths 1024  # only these lengths in table 1

1. Long sequence (default L=8192, B=1, H=8, D=64, f32, 2 layers): each variant runs in its
   own process (peak RSS is per process), compiles, runs once to warm up, then is timed.
   Predicted native peak: one f32 [B, H, L, L] score matrix is 2 GiB at L=8192; XLA keeps
   about two alive, so ~5 GB (keep children under ~12 GB on a shared 24 GB machine).
2. Short sequences (L=128..512): kernel="auto" against native, best of several runs.
3. Trace time of a 24-layer (unrolled) decoder: jax's own tracing (`jax.make_jaxpr`) beside
   `flash_jit(fn).trace`, which traces, detects, decides and rewrites (L=128 and 512).
Uses only the standard library's time/resource/subprocess for measuring.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

H, D = 8, 64


STRUCTURES = ("unrolled", "remat", "scan", "scan-remat")


def decoder(layers: int, structure: str = "unrolled"):
    """fn(x [B, L, H·D], w [layers, 4, H·D, H·D]) -> [B, L, H·D]: pre-norm causal attention
    blocks written the naive way, with a linear layer after each. structure: the blocks one
    after the other ("unrolled"), each under jax.checkpoint ("remat"), a lax.scan over the
    blocks ("scan", as flax's nn.scan(Block) writes it), or a lax.scan over checkpointed
    blocks ("scan-remat", as flax's nn.scan(nn.remat(Block)) writes it)."""
    import jax
    import jax.numpy as jnp

    def attention(q, k, v):
        length = q.shape[1]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    def block(x, wi):
        b, length, e = x.shape
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        q, k, v = (jnp.dot(h, wi[j]).reshape(b, length, H, D) for j in range(3))
        return x + jnp.dot(attention(q, k, v).reshape(b, length, e), wi[3])

    if structure in ("scan", "scan-remat"):
        layer = jax.checkpoint(block) if structure == "scan-remat" else block
        return lambda x, w: jax.lax.scan(lambda x, wi: (layer(x, wi), None), x, w[:layers])[0]
    each = jax.checkpoint(block) if structure == "remat" else block

    def fn(x, w):
        for i in range(layers):
            x = each(x, w[i])
        return x

    return fn


def inputs(length: int, layers: int, batch: int = 1):
    import jax
    import jax.numpy as jnp

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (batch, length, H * D), jnp.float32)
    w = jax.random.normal(kw, (layers, 4, H * D, H * D), jnp.float32) / math.sqrt(H * D)
    return x, w


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(variant: str, length: int, layers: int, repeats: int) -> dict:
    """One variant in this process: compile, warm up, time; peak RSS of the process."""
    import jax

    import hlotool

    fn = decoder(layers)
    x, w = inputs(length, layers)
    x.block_until_ready()
    base = peak_rss_gb()
    jitted = jax.jit(fn) if variant == "native" else hlotool.flash_jit(fn, kernel=variant)
    t = time.perf_counter()
    compiled = jitted.lower(x, w).compile()
    compile_s = time.perf_counter() - t
    compiled(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled(x, w).block_until_ready()
        times.append(time.perf_counter() - t)
    return {"variant": variant, "L": length, "compile_s": compile_s, "run_s": min(times),
            "peak_gb": peak_rss_gb(), "base_gb": base}


def run_child(variant: str, length: int, layers: int, repeats: int) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--lengths", str(length),
           "--layers", str(layers), "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{variant} at L={length} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def long_sequences(lengths: list[int], layers: int, repeats: int) -> None:
    print(f"1. causal decoder, B=1 H={H} D={D} f32, {layers} layers; one process per run")
    rows = [["L", "variant", "compile s", "run s", "peak RSS GB", "RSS before GB",
             "time ratio", "peak ratio"]]
    for length in lengths:
        native = run_child("native", length, layers, repeats)
        fast = run_child("auto", length, layers, repeats)
        for r in (native, fast):
            rows.append([str(length), "jax.jit" if r is native else "flash_jit",
                         f"{r['compile_s']:.2f}", f"{r['run_s']:.3f}", f"{r['peak_gb']:.2f}",
                         f"{r['base_gb']:.2f}", f"{r['run_s'] / native['run_s']:.2f}",
                         f"{r['peak_gb'] / native['peak_gb']:.3f}"])
    print(table(rows))


def short_sequences(lengths: list[int], repeats: int) -> None:
    import jax

    import hlotool

    print(f"\n2. short sequences, kernel='auto' vs native (best of {repeats}), 2 layers")
    rows = [["L", "jax.jit ms", "flash_jit ms", "ratio", "cpu decision"]]
    fn = decoder(2)
    for length in lengths:
        x, w = inputs(length, 2)
        ms = []
        for f in (jax.jit(fn), hlotool.flash_jit(fn)):
            f(x, w).block_until_ready()
            best = math.inf
            for _ in range(repeats):
                t = time.perf_counter()
                f(x, w).block_until_ready()
                best = min(best, time.perf_counter() - t)
            ms.append(best * 1e3)
        decision = hlotool.explain(fn, x, w).sites[0].kernels["cpu"] or "native"
        rows.append([str(length), f"{ms[0]:.2f}", f"{ms[1]:.2f}", f"{ms[1] / ms[0]:.2f}",
                     decision])
    print(table(rows))


def trace_overhead(layers: int = 24, lengths: tuple[int, ...] = (128, 512),
                   repeats: int = 3) -> None:
    import jax

    import hlotool

    print(f"\n3. trace time, {layers}-layer unrolled decoder (best of {repeats}); at L=128 every "
          "platform stays native (short sequence), at L=512 every platform runs a kernel")
    rows = [["L", "jax.make_jaxpr s", "flash_jit(fn).trace s", "rewrite overhead s", "sites",
             "rewritten"]]
    for length in lengths:
        x, w = inputs(length, layers)
        jax_s = fast_s = math.inf
        for _ in range(repeats):
            fn = decoder(layers)  # a fresh function each time: jax caches traces per function
            t = time.perf_counter()
            jax.make_jaxpr(fn)(x, w)
            jax_s = min(jax_s, time.perf_counter() - t)
            t = time.perf_counter()
            hlotool.flash_jit(fn).trace(x, w)  # traces, detects, decides, rewrites
            fast_s = min(fast_s, time.perf_counter() - t)
        report = hlotool.explain(decoder(layers), x, w)
        rows.append([str(length), f"{jax_s:.3f}", f"{fast_s:.3f}", f"{fast_s - jax_s:.3f}",
                     str(len(report.sites)), str(report.rewritten)])
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192])
    parser.add_argument("--short", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=("native", "auto", "chunked"))
    parser.add_argument("--only", choices=("long", "short", "trace"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.lengths[0], args.layers, args.repeats)))
        return
    if args.only in (None, "long"):
        long_sequences(args.lengths, args.layers, args.repeats)
    if args.only in (None, "short"):
        short_sequences(args.short, max(args.repeats, 5))
    if args.only in (None, "trace"):
        trace_overhead()


if __name__ == "__main__":
    main()
