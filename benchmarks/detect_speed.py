"""Attention detection time on a 24-layer model beside jax's own lower + compile time.

    JAX_PLATFORMS=cpu python benchmarks/detect_speed.py [--layers 24] [--repeats 3]

Builds a plain-JAX transformer (causal attention + MLP blocks, unrolled `--layers` times,
so the HLO holds every layer), then times, best of `--repeats`:
  jax lower      jax.jit(f).lower(...) (tracing to StableHLO)
  jax compile    lowered.compile() on the host CPU
  HLO text       lowered.as_text(dialect="hlo", debug_info=True)
  parse          hlotool.hlo.parse_module + inline_calls
  detect (HLO)   graph building + matching on the parsed module (`find_matches`)
  detect (jaxpr) make_jaxpr's jaxpr → sites (`detect_jaxpr`; tracing not included)
and prints each with its share of jax's lower + compile time. Target: detection ≤ 10%.
Also checks the answer: exactly one causal site per layer.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hlotool.hlo import parse_module  # noqa: E402
from hlotool.passes.from_hlo import find_matches  # noqa: E402
from hlotool.passes.from_jaxpr import detect_jaxpr  # noqa: E402


def transformer(params, x, heads: int):
    """x [B, L, E]; params: one dict of weights per layer."""
    batch, length, dim = x.shape
    causal = jnp.tril(jnp.ones((length, length), bool))
    for p in params:
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)
        q, k, v = ((h @ p[n]).reshape(batch, length, heads, dim // heads)
                   for n in ("wq", "wk", "wv"))
        s = jnp.einsum("blhd,bmhd->bhlm", q, k) / jnp.sqrt(dim / heads)
        s = jnp.where(causal, s, -1e9)
        o = jnp.einsum("bhlm,bmhd->blhd", jax.nn.softmax(s, axis=-1), v)
        x = x + o.reshape(batch, length, dim) @ p["wo"]
        h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-6)
        x = x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]
    return x


def best(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()

    dim, heads = args.dim, 4
    shapes = {"wq": (dim, dim), "wk": (dim, dim), "wv": (dim, dim), "wo": (dim, dim),
              "w1": (dim, 4 * dim), "w2": (4 * dim, dim)}
    params = [{n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()}
              for _ in range(args.layers)]
    x = jax.ShapeDtypeStruct((2, args.length, dim), jnp.float32)

    def lower():
        jax.clear_caches()  # time jax's real work, not its caches
        return jax.jit(transformer, static_argnums=2).lower(params, x, heads)

    def compile_():
        jax.clear_caches()
        return lower().compile()

    t_lower, lowered = best(lower, args.repeats)
    t_compile = best(compile_, args.repeats)[0] - t_lower
    t_text, text = best(lambda: lowered.as_text(dialect="hlo", debug_info=True), args.repeats)
    t_parse, module = best(lambda: parse_module(text).inline_calls(), args.repeats)
    t_hlo, matches = best(lambda: find_matches(module, "transformer"), args.repeats)
    closed = jax.make_jaxpr(transformer, static_argnums=2)(params, x, heads)
    t_jaxpr, sites = best(lambda: detect_jaxpr(closed, "transformer"), args.repeats)

    for found in ([m.site for m in matches], [s.site for s in sites]):
        if len(found) != args.layers or any(s.mask != "causal" for s in found):
            raise SystemExit(f"expected {args.layers} causal sites, found "
                             f"{[s.mask for s in found]}")

    jax_total = t_lower + t_compile
    instructions = sum(len(c.instructions) for c in module.computations.values())
    print(f"{args.layers}-layer transformer, L={args.length}, E={dim}: {instructions} HLO "
          f"instructions, {len(closed.jaxpr.eqns)} jaxpr equations, {len(matches)} sites\n")
    rows = [("jax lower", t_lower), ("jax compile (cpu)", t_compile),
            ("HLO text (debug info)", t_text), ("parse + inline calls", t_parse),
            ("detect (HLO front end)", t_hlo), ("detect (jaxpr front end)", t_jaxpr)]
    print(f"{'stage':<26}{'seconds':>10}{'% of jax lower+compile':>26}")
    print("-" * 62)
    for name, t in rows:
        print(f"{name:<26}{t:>10.3f}{100 * t / jax_total:>25.1f}%")


if __name__ == "__main__":
    main()
