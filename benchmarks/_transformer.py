"""The plain-JAX transformer the HLO benchmarks measure, and a best-of timer.

Imported by the scripts beside it (`python benchmarks/NAME.py` puts this folder on sys.path).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def param_shapes(dim: int) -> dict[str, tuple[int, int]]:
    """One layer's weights: attention projections and a 4x MLP."""
    return {"wq": (dim, dim), "wk": (dim, dim), "wv": (dim, dim), "wo": (dim, dim),
            "w1": (dim, 4 * dim), "w2": (4 * dim, dim)}


def transformer(params, x, heads: int):
    """Pre-norm causal attention + MLP blocks, unrolled so the HLO holds every layer.

    x [B, L, E]; params: one dict of `param_shapes(E)` weights per layer.
    """
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


def best(fn: Callable[[], Any], repeats: int,
         clock: Callable[[], float] = time.perf_counter) -> tuple[float, Any]:
    """(fastest of `repeats` calls by `clock`, the last call's result)."""
    seconds, result = float("inf"), None
    for _ in range(repeats):
        start = clock()
        result = fn()
        seconds = min(seconds, clock() - start)
    return seconds, result
