"""Parse speed of `hlotool.hlo.parse_module` on large real modules.

    JAX_PLATFORMS=cpu python benchmarks/hlo_parse_speed.py [--layers 24] [--repeats 20]

Builds a plain-JAX transformer (pre-norm attention + MLP blocks, unrolled `--layers` times),
takes its HLO before optimization (with debug info) and after CPU optimization, and prints
instructions, bytes, best-of-N parse seconds (wall and CPU) and instructions per second for
each, plus the time to print the module back.
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from _transformer import best, param_shapes, transformer  # noqa: E402
from hlotool.hlo import parse_module, print_module  # noqa: E402


def modules(layers: int, dim: int = 64, length: int = 32, heads: int = 4) -> dict[str, str]:
    key = jax.random.PRNGKey(0)
    params = [
        {n: jax.random.normal(jax.random.fold_in(key, i), s) * 0.02
         for n, s in param_shapes(dim).items()}
        for i in range(layers)
    ]
    x = jnp.ones((2, length, dim))
    lowered = jax.jit(transformer, static_argnums=2).lower(params, x, heads)
    return {
        "pre-opt (debug info)": lowered.as_text(dialect="hlo", debug_info=True),
        "CPU post-opt": lowered.compile().as_text(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for label, text in modules(args.layers).items():
        module = parse_module(text)
        count = sum(len(c.instructions) for c in module.computations.values())
        parse_s = best(partial(parse_module, text), args.repeats)[0]
        # CPU time as well: on a busy machine wall time also counts waiting for a core.
        parse_cpu = best(partial(parse_module, text), args.repeats, time.process_time)[0]
        print_s = best(partial(print_module, module), args.repeats)[0]
        rows.append((label, count, len(text.encode()), parse_s, parse_cpu, print_s))
    header = (
        f"{'module':<22} {'instructions':>12} {'bytes':>10} {'parse s':>9} {'instr/s':>10} "
        f"{'parse cpu s':>11} {'instr/cpu s':>11} {'print s':>9}"
    )
    print(
        f"{args.layers}-layer transformer, best of {args.repeats}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(header)
    print("-" * len(header))
    for label, count, nbytes, parse_s, parse_cpu, print_s in rows:
        print(
            f"{label:<22} {count:>12,} {nbytes:>10,} {parse_s:>9.4f} {count / parse_s:>10,.0f} "
            f"{parse_cpu:>11.4f} {count / parse_cpu:>11,.0f} {print_s:>9.4f}"
        )


if __name__ == "__main__":
    main()
