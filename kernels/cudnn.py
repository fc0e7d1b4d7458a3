"""cuDNN's fused flash attention: an adapter over jax's public
`jax.nn.dot_product_attention(..., implementation="cudnn")`.

cuDNN takes [B, L, H, D] in bfloat16 or float16 with grouped K/V heads natively, a causal mask
(top-left, as the reference), key lengths per batch row, and a sliding window that ends at
the query (`local_window_size=(left, 0)`); head dims a multiple of 8 up to 128, one for q, k
and v (jax allows 256 and a separate value head dim only on a Hopper attached at trace time,
which a program exported off a GPU cannot count on). It would take a boolean mask or a bias
too, but as a dense [B, H, Lq, Lk] bias read per tile: masks reach it only as lengths,
causal and window, and it refuses the rest (chunked takes them), as it refuses float32
(cuDNN's flash path has none), soft-caps, sinks, segment ids and masks after the softmax.
A boolean mask that varies along the batch and the keys only (key padding, [B, 1, 1, Lk])
goes as key lengths, its count of kept keys per batch row: exact where each row keeps a
prefix of the keys and the values it hides are finite, which every call checks (O(B·Lk·D)),
running the chunked kernel where not. Gradients come from jax's custom VJP over cuDNN's backward.

Hidden keys: cuDNN gives them a mask value of its own, not the call's `fill`, so a call that
hides keys runs here only where `base.hiding_is_exact` shows that changes nothing
representable (else in the chunked kernel), and rows that see no key get what `fill` gives
them (`with_hidden_keys`).

Off a GPU, jax cannot ask cuDNN its version, which it does when tracing this call;
`jaxcompat.cudnn_traceable` answers for it, so programs exported for CUDA here hold cuDNN's
`__cudnn$fmha…` custom calls. Tests run the adapter with `implementation="xla"`: the same
jax.nn call through XLA's implementation, which jax keeps equal to cuDNN's, so what the adapter
owns (the mapping from a call to jax.nn's arguments) is checked on the CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hlotool import jaxcompat
from hlotool.hardware import Hardware
from hlotool.kernels._upstream import MASK_VALUE, UpstreamKernel, probe, with_hidden_keys
from hlotool.kernels.base import (
    Call,
    Features,
    KernelCost,
    Support,
    flash_cost,
    key_mask,
    soft_fill_refusal,
)
from hlotool.site import AttentionSite, band_of

_PARAMS = ("query", "key", "value", "bias", "mask", "scale", "is_causal",
           "key_value_seq_lengths", "local_window_size", "implementation")
_DTYPES = ("bfloat16", "float16")
_MAX_HEAD_DIM = 128
# cuDNN's tiles, for the cost model (its flash kernels use 64-128 rows per block).
_BLOCK = 128


def _window_refusal(band: tuple[int | None, int | None] | None) -> str | None:
    """Why cuDNN cannot take the band a causal flag and a window leave (`band_of`); None when
    it can: no band, or one ending at the query."""
    if band is None or band[1] == 0:
        return None
    side = "no right bound" if band[1] is None else f"right bound {band[1]}"
    return f"sliding window with {side} unsupported (cuDNN's windows end at the query)"


def lengths_are_exact(call: Call) -> jax.Array:
    """bool scalar: whether key lengths stand exactly for the call's key mask: it keeps a
    prefix of the keys in every batch row, and the values it hides are finite (the naive
    program's 0·NaN there is NaN, which hiding them as padding would not give)."""
    keep = key_mask(call)
    kept = jnp.sum(keep, axis=-1, keepdims=True)
    prefixes = jnp.all(keep == (jnp.arange(keep.shape[-1]) < kept))
    finite = jnp.all(jnp.isfinite(call.v) | keep[:, :, None, None])
    return prefixes & finite


def _as_lengths(call: Call) -> Call:
    """`call` with its key mask as key lengths (the kept keys per row; exact where
    `lengths_are_exact`), combined with the lengths it has."""
    if call.mask is None:
        return call
    lengths = jnp.broadcast_to(jnp.sum(key_mask(call), axis=-1, dtype=jnp.int32),
                               (call.q.shape[0],))
    if call.kv_lengths is not None:
        lengths = jnp.minimum(lengths, call.kv_lengths.astype(jnp.int32))
    return dataclasses.replace(call, mask=None, kv_lengths=lengths)


class CudnnFlash(UpstreamKernel):
    """cuDNN flash attention (`jax.nn.dot_product_attention`, implementation "cudnn") behind
    the common interface.

    implementation: "cudnn", or "xla" to run the same call through XLA off a GPU (tests).
    """

    name = "cudnn"
    platforms = ("cuda",)
    extras = frozenset({"window"})
    hidden_logit = MASK_VALUE  # cuDNN's own is assumed no larger

    def __init__(self, implementation: str = "cudnn") -> None:
        self.implementation = implementation
        self._probe = probe("jax.nn", "dot_product_attention", _PARAMS)

    def stand_in(self) -> CudnnFlash:
        return CudnnFlash(implementation="xla")

    @property
    def unavailable_reason(self) -> str | None:
        return self._probe.reason or jaxcompat.cudnn_untraceable()

    @property
    def optional(self) -> bool:
        """Off rather than broken (`hlotool doctor`) where only the seam's cuDNN hook is
        missing: the doctor reports that hook."""
        return self._probe.reason is None

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if site.dtype not in _DTYPES:
            return Support.no(f"dtype {site.dtype} unsupported (cuDNN flash attention takes "
                              "bfloat16, float16)")
        if features.bias or (features.mask and not set(site.mask_axes or "") <= {"B", "K"}):
            kind = ("additive bias" if features.bias else
                    f"boolean mask varying along {site.mask_axes}")
            return Support.no(f"{kind} unsupported (cuDNN would read it as a dense "
                              "[B, H, Lq, Lk] bias; it takes masks as key lengths, causal, "
                              "window)")
        if site.head_dim != site.v_head_dim:
            return Support.no(f"head dims q/k {site.head_dim} and v {site.v_head_dim} differ "
                              "(cuDNN needs a Hopper attached at trace time for that)")
        if site.head_dim % 8 or site.head_dim > _MAX_HEAD_DIM:
            return Support.no(f"head dim {site.head_dim} unsupported (cuDNN takes multiples "
                              f"of 8 up to {_MAX_HEAD_DIM})")
        refusal = _window_refusal(band_of(features.causal, site.window))
        if refusal:
            return Support.no(refusal)
        return soft_fill_refusal(site, features)

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        return flash_cost(site, block_q=min(_BLOCK, site.q_len),
                          block_k=min(_BLOCK, site.kv_len), backward=backward)

    def _exact(self, call: Call) -> jax.Array:
        exact = super()._exact(call)
        return exact if call.mask is None else exact & lengths_are_exact(call)

    def _attend(self, call: Call) -> jax.Array:
        return with_hidden_keys(_as_lengths(call), self._attend_upstream)

    def _attend_upstream(self, call: Call) -> jax.Array:
        # A band that ends at the query (`_check`) is causal, whatever else bounds it.
        band = call.band
        window = None if band is None or band[0] is None else (band[0], 0)
        lengths = None if call.kv_lengths is None else call.kv_lengths.astype(jnp.int32)
        with jaxcompat.cudnn_traceable():
            return self._probe.module.dot_product_attention(
                call.q, call.k, call.v, scale=call.scale, is_causal=band is not None,
                key_value_seq_lengths=lengths, local_window_size=window,
                implementation=self.implementation)
