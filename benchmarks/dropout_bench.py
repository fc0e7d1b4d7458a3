"""Dropout in the chunked kernel: the keep mask read whole vs drawn per tile, on this CPU.

    JAX_PLATFORMS=cpu python benchmarks/dropout_bench.py
    JAX_PLATFORMS=cpu python benchmarks/dropout_bench.py --lengths 2048,4096 --repeats 7

Per length (B=1, H=8, D=64, float32, causal, keep_prob 0.9, the mask drawn with
`jax.random.bernoulli` over [B, H, L, L] as flax writes it), the kernel's forward and forward
plus backward, three ways: without dropout; with the program's mask built whole and read by
the kernel (what hlotool did before `kernels/drawn.py`, and what it still does where the
mask cannot be drawn); with the mask drawn per tile (`DrawnMask`). Times are medians of
--repeats calls after a warm-up (wall seconds); "temp" is XLA's compiled temporary memory of
the forward plus backward (`memory_analysis`), where a whole [B, H, L, L] float32 mask shows.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from hlotool.kernels import get
from hlotool.kernels.drawn import DrawnMask

B, H, D, KEEP = 1, 8, 64, 0.9


def _multiplier(length: int):
    def draw(key):
        return jax.random.bernoulli(key, KEEP, (B, H, length, length)).astype(jnp.float32) / KEEP
    return draw


def _functions(mode: str, length: int):
    draw = _multiplier(length)
    cone = jax.make_jaxpr(draw)(jax.random.key(0)).jaxpr
    kernel = get("chunked")

    def attend(q, k, v, key):
        post = {"none": None, "whole": lambda: draw(key),
                "drawn": lambda: DrawnMask.of(cone, (key,), jnp.float32)}[mode]
        return kernel(q, k, v, scale=D ** -0.5, causal=True,
                      post_mask=None if post is None else post())

    def both(q, k, v, key):
        return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, key) ** 2),
                        argnums=(0, 1, 2))(q, k, v)
    return jax.jit(attend), jax.jit(both)


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"B={B} H={H} D={D} float32, causal, keep_prob {KEEP}: seconds (median of "
          f"{args.repeats}); temp = compiled temporaries of fwd+bwd")
    header = ("L", "mask", "fwd", "fwd+bwd", "temp MiB")
    print("  ".join(h.rjust(w) for h, w in zip(header, (6, 6, 7, 8, 9))), flush=True)
    for length in map(int, args.lengths.split(",")):
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(x, (B, length, H, D), jnp.float32) for x in keys)
        inputs = (q, k, v, jax.random.key(9))
        for mode in ("none", "whole", "drawn"):
            forward, both = _functions(mode, length)
            temp = both.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
            row = (str(length), mode, f"{_median_seconds(forward, inputs, args.repeats):.3f}",
                   f"{_median_seconds(both, inputs, args.repeats):.3f}", f"{temp / 2**20:.0f}")
            print("  ".join(c.rjust(w) for c, w in zip(row, (6, 6, 7, 8, 9))), flush=True)


if __name__ == "__main__":
    main()
