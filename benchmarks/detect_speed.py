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

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _transformer import best, param_shapes, transformer  # noqa: E402
from hlotool.hlo import parse_module  # noqa: E402
from hlotool.passes.from_hlo import find_matches  # noqa: E402
from hlotool.passes.from_jaxpr import detect_jaxpr  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    args = parser.parse_args()

    dim, heads = args.dim, 4
    params = [{n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in param_shapes(dim).items()}
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
