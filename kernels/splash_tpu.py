"""Splash attention on TPU: an adapter over `jax.experimental.pallas.ops.tpu.splash_attention`.

Splash takes one batch element at a time as q [Hq, Lq, D], k [Hkv, Lk, D], v [Hkv, Lk, Dv]
with grouped K/V heads natively, a static mask object per head (`CausalMask`, ...) whose
fully masked blocks it skips, segment ids, logit soft-capping and per-head sinks; no bias, no
scale (q comes pre-scaled). So masks reach it in kernel terms, never as a dense operand:
  - causal: `CausalMask` (top-left aligned, as the interface), blocks above it skipped;
  - a sliding window (with or without causal): `LocalMask` over the same band, blocks outside
    it skipped;
  - key padding (a boolean mask varying along batch and keys only) and kv_lengths: segment
    ids, q id 1 and kv id 1 where the key is kept, 0 where it is not; the call's own segment
    ids (packed sequences) as they are, a hidden key's id made one no query has;
  - query padding (`query_mask`): a hidden query's id made one no key has, so the row sees
    nothing and gets what the call's fill gives an empty row;
  - lengths: padded up to a multiple of 128, padded keys masked with those segment ids; blocks
    the largest that divide the padded length, up to the chip's `attention_block` (1024 on
    v6e, 512 elsewhere: `hlotool.hardware`), the chip the one traced for;
  - GQA/MQA: K/V heads stay as they are (no repeat);
  - batch: `vmap` of the per-example kernel.
It refuses an additive bias and masks that vary along queries or heads (pallas_tpu takes
those as a dense bias). Hidden keys get splash's mask value, not the call's `fill`, so a call
that hides keys runs here only where `base.hiding_is_exact` shows that changes nothing
representable (else in the chunked kernel), and rows with no visible key are set to what
`fill` gives them after the kernel. Gradients (dq, dk, dv, dsinks) come from upstream's custom
VJP.

Off a TPU it runs in Pallas' interpret mode (`interpret=True`, what the tests use); staged
for a TPU it is traced through `jaxcompat.for_tpu` like the flash kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat
from hlotool.hardware import Hardware
from hlotool.kernels._upstream import (
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
    soft_fill_refusal,
)
from hlotool.site import CAUSAL, AttentionSite

UPSTREAM = "jax.experimental.pallas.ops.tpu.splash_attention"


class SplashTpu(PaddedTpuKernel):
    """JAX's Pallas TPU splash attention behind the common interface.

    interpret: run the kernel in Pallas' interpret mode (any platform, slowly): for tests.
    """

    name = "splash_tpu"
    platforms = ("tpu",)
    hidden_logit = MASK_VALUE
    extras = frozenset({"softcap", "sinks", "window", "segments", "query_padding"})

    def __init__(self, interpret: bool = False) -> None:
        self.interpret = interpret
        self._probe = probe(
            UPSTREAM, "make_splash_mha",
            ("mask", "block_sizes", "attn_logits_soft_cap", "head_shards", "q_seq_shards",
             "interpret"),
            ("BlockSizes", "CausalMask", "FullMask", "LocalMask", "MultiHeadMask",
             "SegmentIds"),
        )

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if site.dtype not in ("float32", "bfloat16"):
            return Support.no(f"dtype {site.dtype} unsupported (splash takes float32, "
                              "bfloat16)")
        if features.bias:
            return Support.no("additive bias unsupported (splash takes none; pallas_tpu "
                              "does)")
        if features.mask and not set(site.mask_axes or "") <= {"B", "K"}:
            return Support.no(f"a boolean mask varying along {site.mask_axes} (splash takes "
                              "causal masks, key and query padding; pallas_tpu takes any "
                              "mask)")
        return soft_fill_refusal(site, features)

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        bq, bk = tiles(site.q_len, site.kv_len, hardware)
        # Segment ids (int32, one per query and key) are all it reads beside q, k, v.
        ids = 4 * site.batch * (site.q_len + site.kv_len) * (2 if backward else 1)
        return flash_cost(site, block_q=bq, block_k=bk, backward=backward) + KernelCost(
            0, 0, ids, 0)

    def _attend_upstream(self, call: Call) -> jax.Array:
        sa = self._probe.module
        b, lq, hq, d = call.q.shape
        lk, dv = call.k.shape[1], call.v.shape[3]
        lq_p, lk_p = padded_length(lq), padded_length(lk)

        def prep(x, length):  # [B, L, H, D] -> [B, H, L_padded, D]
            x = jnp.swapaxes(x, 1, 2)
            return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

        q = prep(call.q * jnp.asarray(call.scale, call.q.dtype), lq_p)
        k, v = prep(call.k, lk_p), prep(call.v, lk_p)

        keep = jnp.broadcast_to(np.arange(lk_p) < lk, (b, lk_p))
        if call.kv_lengths is not None:
            keep = keep & (np.arange(lk_p)[None, :] < call.kv_lengths[:, None])
        if call.mask is not None:  # [B|1, 1, 1, Lk]: `_check` admits key padding only
            keys = jnp.pad(call.mask[:, 0, 0, :], ((0, 0), (0, lk_p - lk)))
            keep = keep & keys
        rows = None  # queries the call keeps; the padded ones are cut off after the kernel
        if call.query_mask is not None:
            rows = jnp.pad(jnp.broadcast_to(call.query_mask, (b, lq)), ((0, 0), (0, lq_p - lq)),
                           constant_values=True)
        segment_ids = None
        if call.segments is not None:
            q_ids, kv_ids = call.segments
            absent = jnp.minimum(jnp.min(q_ids), jnp.min(kv_ids)) - 1  # no query's id
            q_ids = jnp.pad(q_ids, ((0, 0), (0, lq_p - lq)), constant_values=0)
            if rows is not None:
                q_ids = jnp.where(rows, q_ids, absent - 1)  # and no key's
            kv_ids = jnp.pad(kv_ids, ((0, 0), (0, lk_p - lk)))
            segment_ids = sa.SegmentIds(q=q_ids, kv=jnp.where(keep, kv_ids, absent))
        elif (call.kv_lengths is not None or call.mask is not None or lk_p != lk
              or rows is not None):
            q_ids = jnp.ones((b, lq_p), jnp.int32) if rows is None else \
                jnp.where(rows, 1, 2).astype(jnp.int32)
            segment_ids = sa.SegmentIds(q=q_ids, kv=keep.astype(jnp.int32))

        sinks = None
        if call.sinks is not None:  # [B|1, Hq|1, 1, 1]: detection keeps them per head
            sinks = jnp.broadcast_to(call.sinks[:, :, 0, 0], (b, hq)).astype(jnp.float32)

        bq, bk = tiles(lq_p, lk_p)
        blocks = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                               block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                               block_kv_dq=bk)
        shape = (lq_p, lk_p)
        band = call.band
        if band is None:
            per_head = sa.FullMask(shape)
        elif band == CAUSAL:
            per_head = sa.CausalMask(shape)
        else:
            per_head = sa.LocalMask(shape, window_size=band, offset=0)
        kernel = sa.make_splash_mha(
            sa.MultiHeadMask([per_head] * hq), block_sizes=blocks,
            attn_logits_soft_cap=call.softcap, head_shards=1, q_seq_shards=1,
            interpret=self.interpret)

        def one(q, k, v, segment_ids, sinks):
            return kernel(q, k, v, segment_ids=segment_ids, sinks=sinks)

        def splash_tpu(q, k, v, segment_ids, sinks):
            return jax.vmap(one)(q, k, v, segment_ids, sinks)

        attend = splash_tpu if self.interpret else jaxcompat.for_tpu(splash_tpu)
        out = attend(q, k, v, segment_ids, sinks)
        return jnp.swapaxes(out[:, :, :lq, :dv], 1, 2)  # [B, Lq, Hq, Dv]
