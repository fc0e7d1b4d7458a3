"""The naive formula, `softmax(where(visible, cap(scale·q·kᵀ) + bias, fill))·v` with its
variants (post-softmax mask, sinks; `hlotool.kernels.base`): the definition of the kernels'
semantics, the oracle of their tests and the "native" side of comparisons.

It materializes the [B, Hq, Lq, Lk] scores; gradients come from autodiff.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hlotool.hardware import Hardware
from hlotool.kernels.base import (
    AttentionKernel,
    EXTRAS,
    Call,
    Features,
    KernelCost,
    Support,
    naive_cost,
    post_softmax,
    visible_keys,
    zero_invalid_keys,
)
from hlotool.site import AttentionSite


class Reference(AttentionKernel):
    """Naive attention in float32 at HIGHEST matmul precision, any shape and mask."""

    name = "reference"
    platforms = ("cpu", "tpu", "cuda")
    typed_for_shard_map = True
    extras = frozenset(EXTRAS)

    def _check(self, site: AttentionSite, features: Features) -> Support:
        return Support.yes()

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        return naive_cost(site, backward=backward)

    def _attend(self, call: Call) -> jax.Array:
        call = zero_invalid_keys(call)
        b, lq, hq, d = call.q.shape
        hkv = call.k.shape[2]
        f32 = jnp.float32
        q = call.q.astype(f32).reshape(b, lq, hkv, hq // hkv, d)
        hi = jax.lax.Precision.HIGHEST
        s = jnp.einsum("bqhgd,bkhd->bhgqk", q, call.k.astype(f32), precision=hi)
        s = (s * call.scale).reshape(b, hq, lq, -1)
        if call.softcap is not None:
            s = call.softcap * jnp.tanh(s / call.softcap)
        if call.bias is not None:
            s = s + call.bias.astype(f32)
        visible = visible_keys(call)
        if visible is not None:
            s = jnp.where(visible, s, call.fill)
        m = jnp.max(s, axis=-1, keepdims=True)
        sinks = None if call.sinks is None else call.sinks.astype(f32)
        if sinks is not None:
            m = jnp.maximum(m, sinks)
        # A row with no visible key has m = -inf; shifting by 0 keeps its exps at 0, not NaN.
        shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
        p = jnp.exp(s - shift)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        if sinks is not None:
            denom = denom + jnp.exp(sinks - shift)
        p = p / jnp.where(denom == 0, 1.0, denom)
        if call.post_mask is not None:
            p = post_softmax(p, call.post_mask)
        p = p.reshape(b, hkv, hq // hkv, lq, -1)
        out = jnp.einsum("bhgqk,bkhd->bqhgd", p, call.v.astype(f32), precision=hi)
        return out.reshape(b, lq, hq, -1).astype(call.result_dtype)
