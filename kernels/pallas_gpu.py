"""Pallas GPU (Triton) flash attention: an adapter over
`jax.experimental.pallas.ops.gpu.attention.mha`.

Upstream takes [B, L, H, D] with equal head counts and one head dim for q, k, v, lengths
divisible by its blocks (128, or the whole length when shorter), causal masking and ONE
segment-id array [B, L] indexed by both query and key position. The adapter bridges:
  - layout: transposes from [B, H, L, D] when asked;
  - lengths: pads Lq and Lk to one common length that power-of-two Triton blocks tile and
    gives the padded tail its own segment id. That masks padded keys for every real query
    only when Lq ≤ Lk (query i and key i share the id at position i), so Lq > Lk needs an
    Lk that is already tileable;
  - head dims: zero-pads D and Dv to one size;
  - GQA/MQA: repeats K/V heads;
  - hidden keys: upstream gives them its mask value, not the call's `fill`, so a call that
    hides keys runs here only where `base.hiding_is_exact` shows that changes nothing
    representable (else in the chunked kernel).
It refuses (with the reason) what one shared segment-id array cannot express: additive bias,
boolean masks and kv_lengths. Gradients come from upstream's custom VJP.

Upstream builds its `pallas_call`s without a `cost_estimate`, and even with one jax's
Triton lowering discards it (`jax/_src/pallas/triton/pallas_call_registration.py` deletes the
argument), so XLA:GPU sees these calls as opaque; `cost()` is the only estimate.

jax 0.12.0 deprecates this module in favour of tokamax (the probe keeps that notice for
`hlotool doctor` instead of printing it on every import) and jax 0.12.1 removes it: there the
kernel is off, not broken, and CUDA sites go to the next kernel in line. From jax 0.12 on,
exporting it for CUDA from a machine without a GPU needs an abstract GPU to lower for
(`jax.sharding.use_abstract_mesh` with an `AbstractDevice`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hlotool.hardware import Hardware
from hlotool.kernels._upstream import MASK_VALUE, Upstream, UpstreamKernel, probe
from hlotool.kernels.base import (
    Call,
    Features,
    KernelCost,
    Support,
    flash_cost,
    round_up,
    soft_fill_refusal,
)
from hlotool.site import AttentionSite

UPSTREAM = "jax.experimental.pallas.ops.gpu.attention"
# The release that deleted UPSTREAM (0.12.0 deprecated it; tokamax is where it went).
REMOVED_IN = (0, 12, 1)
_BLOCK = 128


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _padded(n: int) -> int:
    """A length upstream's blocks tile: a multiple of 128, or a power of two in [16, 128]
    (Triton tiles are powers of two; its dots need 16)."""
    if n % _BLOCK == 0:
        return n
    return max(16, 1 << (n - 1).bit_length()) if n <= _BLOCK else round_up(n, _BLOCK)


def _plan(lq: int, lk: int) -> tuple[int, int, bool] | None:
    """(padded Lq, padded Lk, needs segment ids), or None when padding cannot be masked."""
    lq_p, lk_p = _padded(lq), _padded(lk)
    if lk_p == lk:  # only queries are padded; their rows are dropped
        return lq_p, lk, False
    if lq > lk:
        return None
    return lk_p, lk_p, True


def _backward_blocks(lq: int, lk: int) -> tuple[int, int] | None:
    """(query, key) blocks of upstream's fused backward, which needs as many query blocks as
    key blocks (Triton tiles are powers of two); None when the lengths allow none."""
    n = min(lq, lk) // min(32, lq, lk)
    if lq % n or lk % n or not (_pow2(lq // n) and _pow2(lk // n)):
        return None
    return lq // n, lk // n


class PallasGpuFlash(UpstreamKernel):
    """JAX's Pallas Triton flash attention (`mha`) behind the common interface.

    interpret: run through Pallas' interpreter (for tests off a GPU).
    """

    name = "pallas_gpu"
    platforms = ("cuda",)
    hidden_logit = MASK_VALUE

    def __init__(self, interpret: bool = False) -> None:
        self.interpret = interpret
        self._probe = probe(
            UPSTREAM, "mha",
            ("q", "k", "v", "segment_ids", "sm_scale", "causal", "block_sizes", "interpret"),
            ("BlockSizes",),
        )
        if self._probe.module is None and self.optional:
            self._probe = Upstream(None, f"jax {jax.__version__} removed {UPSTREAM} (deprecated "
                                   "in 0.12.0 for tokamax); CUDA sites run in the next kernel")

    @property
    def optional(self) -> bool:
        """Off rather than broken (`hlotool doctor`) where jax no longer ships upstream."""
        return tuple(jax.__version_info__[:3]) >= REMOVED_IN

    def stand_in(self) -> PallasGpuFlash:
        return PallasGpuFlash(interpret=True)

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if features.bias or features.mask or features.kv_lengths:
            kind = ("additive bias" if features.bias else
                    "boolean mask" if features.mask else "kv_lengths")
            return Support.no(f"{kind} unsupported (upstream mha takes only causal and one "
                              "segment-id array shared by queries and keys)")
        plan = _plan(site.q_len, site.kv_len)
        if plan is None:
            return Support.no(f"q length {site.q_len} > kv length {site.kv_len}, which needs "
                              "padding to a multiple of 128 or a power of two: padded keys "
                              "cannot be masked")
        if _backward_blocks(plan[0], plan[1]) is None:
            return Support.no(f"padded lengths q {plan[0]}, kv {plan[1]} split into no equal "
                              "number of power-of-two blocks (upstream's fused backward)")
        return soft_fill_refusal(site, features)

    def _hides_keys(self, call: Call) -> bool:
        return super()._hides_keys(call) or _plan(call.q.shape[1], call.k.shape[1])[2]

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        lq_p, lk_p, _ = _plan(site.q_len, site.kv_len) or (site.q_len, site.kv_len, False)
        return flash_cost(site, block_q=min(_BLOCK, lq_p), block_k=min(_BLOCK, lk_p),
                          backward=backward,
                          kv_head_repeat=site.num_q_heads // site.num_kv_heads)

    def _attend(self, call: Call) -> jax.Array:
        b, lq, hq, d = call.q.shape
        lk, dv = call.k.shape[1], call.v.shape[3]
        lq_p, lk_p, segmented = _plan(lq, lk)
        d_p = max(d, dv)

        def prep(x, length):
            if x.shape[2] != hq:
                x = jnp.repeat(x, hq // x.shape[2], axis=2)
            return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0),
                               (0, d_p - x.shape[3])))

        q, k, v = prep(call.q, lq_p), prep(call.k, lk_p), prep(call.v, lk_p)
        segment_ids = None
        if segmented:
            tail = (jnp.arange(lk_p) >= lk).astype(jnp.int32)
            segment_ids = jnp.broadcast_to(tail, (b, lk_p))
        mha = self._probe.module
        bwd_q, bwd_k = _backward_blocks(lq_p, lk_p)
        blocks = mha.BlockSizes(
            block_q=min(_BLOCK, lq_p), block_k=min(_BLOCK, lk_p),
            block_q_dkv=bwd_q, block_kv_dkv=bwd_k, block_q_dq=bwd_q, block_kv_dq=bwd_k,
        )
        out = mha.mha(q, k, v, segment_ids, sm_scale=call.scale, causal=call.causal,
                      block_sizes=blocks, interpret=self.interpret)
        return out[:, :lq, :, :dv]
