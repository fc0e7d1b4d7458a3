"""Pallas TPU flash attention: an adapter over `jax.experimental.pallas.ops.tpu.flash_attention`.

Upstream takes q, k, v as [B, H, L, D] with equal head counts and equal head dims, lengths
divisible by its blocks, head dims ≤ 128 or multiples of 128, an optional dense bias `ab`
[B, H, Lq, Lk] and `SegmentIds`. The adapter bridges the rest:
  - layout: transposes from [B, L, H, D];
  - lengths: pads Lq and Lk up to a multiple of 128 and masks the padded keys with segment ids
    (so L=1000 works); blocks are the largest that divide the padded length, up to the
    chip's `attention_block` (1024 on v6e, 512 elsewhere: `hlotool.hardware`);
  - head dims: zero-pads D and Dv to one common size upstream accepts (zero columns change
    neither the scores nor the kept output columns);
  - GQA/MQA: repeats K/V heads (upstream has no grouped heads; the cost counts the copies);
  - kv_lengths: segment ids (q id 1; kv id 1 below the length, 0 beyond), not a dense bias;
  - boolean masks: folded into the dense bias `ab` as a large negative value;
  - scale: applied to q, since upstream scales the bias together with q·kᵀ;
  - hidden keys: upstream gives them its mask value, not the call's `fill`, so a call that
    hides keys runs here only where `base.hiding_is_exact` shows that changes nothing
    representable (else in the chunked kernel), and rows with no visible key are set to
    what `fill` gives them after the kernel (upstream would average them).
Gradients (dq, dk, dv, dbias) come from upstream's custom VJP; its backward `pallas_call`s,
which upstream builds without a `cost_estimate`, get one (see `_costed`).

Off a TPU it runs only in Pallas' TPU interpret mode
(`with jax.experimental.pallas.tpu.force_tpu_interpret_mode(True):`), slowly. Staged off a
TPU (the TPU branch of `lax.platform_dependent`, an export for TPU), it is traced through
`jaxcompat.for_tpu`: from jax 0.12 on, Mosaic must be told which TPU it lowers for.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hlotool import jaxcompat
from hlotool.hardware import Hardware
from hlotool.kernels._costed import with_backward_costs
from hlotool.kernels._upstream import (
    LANES,
    MASK_VALUE,
    PaddedTpuKernel,
    padded_length,
    probe,
    tiles,
)
from hlotool.kernels.base import (
    Call,
    Features,
    KernelCost,
    Support,
    flash_cost,
    round_up,
    soft_fill_refusal,
    visible_fraction,
)
from hlotool.site import AttentionSite

UPSTREAM = "jax.experimental.pallas.ops.tpu.flash_attention"


def padded_head_dim(d: int, dv: int) -> int:
    """One head dim for q, k and v that upstream accepts: ≤ 128, or a multiple of 128."""
    d = max(d, dv)
    return d if d <= LANES else round_up(d, LANES)


def _backward_estimate(scores: float, d: int, eqn) -> pl.CostEstimate:
    """Upstream's backward kernels: dK/dV recomputes S and forms dV, dP, dK (4 matmuls);
    dQ recomputes S and forms dP, dQ (3); each recomputes exp(S) once. Bytes: operands and
    results once, as upstream counts its forward."""
    kernel = getattr(eqn.params["jaxpr"].debug_info, "func_name", "")
    n_matmuls = 3 if "dq" in kernel else 4
    nbytes = sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize
                 for v in (*eqn.invars, *eqn.outvars) if hasattr(v.aval, "shape"))
    return pl.CostEstimate(flops=int(2 * n_matmuls * scores * d),
                           transcendentals=int(scores), bytes_accessed=int(nbytes))


class PallasTpuFlash(PaddedTpuKernel):
    """JAX's Pallas TPU flash attention behind the common interface."""

    name = "pallas_tpu"
    platforms = ("tpu",)
    hidden_logit = MASK_VALUE
    extras = frozenset({"query_padding"})  # ANDed into its dense mask

    def __init__(self) -> None:
        self._probe = probe(
            UPSTREAM, "flash_attention",
            ("q", "k", "v", "ab", "segment_ids", "causal", "sm_scale", "block_sizes"),
            ("BlockSizes", "SegmentIds"),
        )

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if site.dtype not in ("float32", "bfloat16"):
            return Support.no(f"dtype {site.dtype} unsupported (TPU flash takes float32, "
                              "bfloat16)")
        return soft_fill_refusal(site, features)

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        bq, bk = tiles(site.q_len, site.kv_len, hardware)
        cost = flash_cost(site, block_q=bq, block_k=bk, backward=backward,
                          kv_head_repeat=site.num_q_heads // site.num_kv_heads)
        if site.mask in ("additive", "boolean") or site.query_padding:
            # Upstream reads the dense [B, H, Lq, Lk] f32 bias tile by tile (and writes dbias).
            ab = 4 * site.batch * site.num_q_heads * site.q_len * site.kv_len
            cost += KernelCost(0, 0, ab * (3 if backward else 1), 0)
        return cost

    def _attend_upstream(self, call: Call) -> jax.Array:
        fa = self._probe.module
        call = call.with_query_mask_in_mask()  # it takes any mask, dense
        b, lq, hq, d = call.q.shape
        lk, hkv, dv = call.k.shape[1], call.k.shape[2], call.v.shape[3]
        lq_p, lk_p, d_p = padded_length(lq), padded_length(lk), padded_head_dim(d, dv)

        def prep(x, length, heads):
            x = jnp.swapaxes(x, 1, 2)  # [B, H, L, D]
            if heads != hq:
                x = jnp.repeat(x, hq // heads, axis=1)
            return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]),
                               (0, d_p - x.shape[3])))

        # Upstream scales (q·kᵀ + ab) as a whole; scaling q instead keeps the bias unscaled.
        q = prep(call.q * jnp.asarray(call.scale, call.q.dtype), lq_p, hq)
        k, v = prep(call.k, lk_p, hkv), prep(call.v, lk_p, hkv)

        ab = None
        if call.bias is not None or call.mask is not None:
            ab = jnp.zeros((1, 1, 1, 1), jnp.float32)
            if call.bias is not None:
                ab = ab + call.bias.astype(jnp.float32)
            if call.mask is not None:
                ab = jnp.where(call.mask, ab, MASK_VALUE)
            ab = jnp.broadcast_to(ab, (b, hq, lq, lk))
            ab = jnp.pad(ab, ((0, 0), (0, 0), (0, lq_p - lq), (0, lk_p - lk)))

        segment_ids = None
        if call.kv_lengths is not None or lk_p != lk:
            length = jnp.full((b,), lk) if call.kv_lengths is None else call.kv_lengths
            kv_ids = (jnp.arange(lk_p)[None, :] < jnp.minimum(length, lk)[:, None])
            segment_ids = fa.SegmentIds(q=jnp.ones((b, lq_p), jnp.int32),
                                        kv=kv_ids.astype(jnp.int32))

        bq, bk = tiles(lq_p, lk_p)
        blocks = fa.BlockSizes(
            block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
            block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
            block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq,
        )
        def flash(q, k, v, ab, segment_ids):
            return fa.flash_attention(q, k, v, ab, segment_ids, causal=call.causal,
                                      sm_scale=1.0, block_sizes=blocks)

        scores = b * hq * lq_p * lk_p * visible_fraction(lq_p, lk_p, bq, bk, call.band)
        costed = with_backward_costs(flash, functools.partial(_backward_estimate, scores, d_p))

        def pallas_tpu_flash(q, k, v, ab, segment_ids):
            return costed(q, k, v, ab, aux=segment_ids)

        out = jaxcompat.for_tpu(pallas_tpu_flash)(q, k, v, ab, segment_ids)
        out = jnp.swapaxes(out[:, :, :lq, :dv], 1, 2)  # [B, Lq, Hq, Dv]
        return out
