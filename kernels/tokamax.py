"""tokamax attention on TPU: an adapter over `tokamax.dot_product_attention`.

tokamax (``pip install "hlotool[tokamax]"``; it needs Python ≥ 3.12 and jax ≥ 0.11.1) is
where jax's Pallas attention ops went upstream. Its `mosaic_tpu` implementation is splash
attention: [B, L, H, D] like the canonical layout, grouped K/V heads and a value head dim of
its own natively, causal or a boolean mask shared by all heads; lengths must be multiples of
its 128-blocks, and it takes no bias and no float16. The adapter bridges:
  - lengths: pads Lq and Lk to multiples of 128; padded keys are masked by a boolean mask;
  - kv_lengths: folded into the boolean mask [B, 1, Lq, Lk] (tokamax's own key lengths are
    not implemented for TPU);
  - causal with a boolean mask: folded into the mask (top-left aligned, as the reference);
  - a mask that differs per head: heads move to a batch axis (K/V heads repeated), so each
    (batch, head) has a mask of its own;
  - hidden keys: splash gives them its mask value, not the call's `fill`, so a call that
    hides keys runs here only where `base.hiding_is_exact` shows that changes nothing
    representable (else in the chunked kernel); rows with no visible key are set to what
    `fill` gives them after the kernel.
It refuses additive bias and float16 (pallas_tpu takes them). Gradients come from tokamax's
custom VJP.

Off a TPU, tokamax refuses to trace its TPU kernel ("Not supported on cpu"). This kernel only
ever runs in the TPU branch of `lax.platform_dependent` or in a program exported for TPU, so
off a TPU it traces under `tokamax.config.cross_compile(True)` and mutes tokamax's
autotuning-cache misses, which are keyed by the CPU it traces on. On a TPU, tokamax's own
device check stays (its TPU kernel needs v5 or newer).

tokamax's GPU implementations (triton, mosaic_gpu, cudnn) lower only with a GPU attached;
hlotool has not tested them, so `tokamax_gpu` reports itself unavailable and CUDA sites go
to the kernels `registry.PRIORITY` lists for CUDA.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat
from hlotool.hardware import Hardware
from hlotool.kernels._upstream import (
    MASK_VALUE,
    PaddedTpuKernel,
    Upstream,
    padded_length,
    probe,
)
from hlotool.kernels.base import (
    Call,
    Features,
    KernelCost,
    Support,
    flash_cost,
    soft_fill_refusal,
)
from hlotool.site import AttentionSite

INSTALL = 'pip install "hlotool[tokamax]" (Python >= 3.12, jax >= 0.11.1)'
_PARAMS = ("query", "key", "value", "bias", "mask", "scale", "is_causal", "implementation")
_BLOCK = 128  # splash attention's default block, which the lengths must divide
_GPU_UNTESTED = ("untested: tokamax's GPU kernels (triton, mosaic_gpu, cudnn) lower only with a "
                 "GPU attached; cudnn, pallas_gpu or chunked run CUDA sites")


def installed() -> bool:
    """Whether tokamax is importable here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("tokamax") is not None


class Tokamax(PaddedTpuKernel):
    """tokamax's attention for one platform behind the common interface."""

    optional = True  # an extra: unavailable here is not a broken install (`hlotool doctor`)
    hidden_logit = MASK_VALUE  # splash's, for hidden and padded keys
    extras = frozenset({"query_padding"})  # ANDed into its dense mask

    def __init__(self, platform: str) -> None:
        self.name = f"tokamax_{'gpu' if platform == 'cuda' else platform}"
        self.platforms = (platform,)
        self._tested = platform == "tpu"
        self._found: Upstream | None = None

    @property
    def _probe(self) -> Upstream:
        # Probed on first use: importing tokamax costs seconds that only its users should pay.
        if self._found is None:
            if not installed():
                self._found = Upstream(None, f"tokamax not installed: {INSTALL}")
            elif not self._tested:
                self._found = Upstream(None, _GPU_UNTESTED)
            else:
                self._found = probe("tokamax", "dot_product_attention", _PARAMS,
                                    ("config",), distribution="tokamax")
        return self._found

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if site.dtype not in ("float32", "bfloat16"):
            return Support.no(f"dtype {site.dtype} unsupported (tokamax mosaic_tpu takes "
                              "float32, bfloat16)")
        if features.bias:
            return Support.no("additive bias unsupported (tokamax mosaic_tpu takes none)")
        generation = _attached_tpu_generation()
        if generation is not None and generation < 5:
            return Support.no(f"TPU v{generation} attached; tokamax mosaic_tpu needs v5 or "
                              "newer")
        return soft_fill_refusal(site, features)

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        lq, lk = padded_length(site.q_len), padded_length(site.kv_len)
        cost = flash_cost(site, block_q=_BLOCK, block_k=_BLOCK, backward=backward)
        if site.mask == "boolean" or site.query_padding or lk != site.kv_len:
            # The dense boolean mask (one byte per score, shared by the heads) is read per
            # tile, forward and again in the backward.
            cost += KernelCost(0, 0, site.batch * lq * lk * (2 if backward else 1), 0)
        return cost

    def _attend_upstream(self, call: Call) -> jax.Array:
        tokamax = self._probe.module
        call = call.with_query_mask_in_mask()  # it takes any mask, dense
        b, lq, hq, _ = call.q.shape
        lk = call.k.shape[1]
        lq_p, lk_p = padded_length(lq), padded_length(lk)

        mask, causal = call.mask, call.causal
        if mask is not None:
            mask = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], lq, lk))
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, lq_p - lq), (0, lk_p - lk)))
        if call.kv_lengths is not None or lk_p != lk:
            length = jnp.full((b,), lk) if call.kv_lengths is None else call.kv_lengths
            keep = (np.arange(lk_p)[None, :] < jnp.minimum(length, lk)[:, None])
            keep = jnp.broadcast_to(keep[:, None, None, :], (b, 1, lq_p, lk_p))
            mask = keep if mask is None else mask & keep
        if causal and mask is not None:
            mask = mask & (np.arange(lk_p)[None, :] <= np.arange(lq_p)[:, None])
            causal = False

        def pad(x, length):
            return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))

        q, k, v = pad(call.q, lq_p), pad(call.k, lk_p), pad(call.v, lk_p)
        per_head = mask is not None and mask.shape[1] > 1
        if per_head:
            # [B, H, L, 1, D]: tokamax's extra batch axes; one mask per (batch, head).
            def by_head(x):
                x = jnp.repeat(x, hq // x.shape[2], axis=2) if x.shape[2] != hq else x
                return jnp.swapaxes(x, 1, 2)[:, :, :, None]

            q, k, v, mask = by_head(q), by_head(k), by_head(v), mask[:, :, None]

        def attend(q, k, v, mask):
            return tokamax.dot_product_attention(q, k, v, None, mask, scale=call.scale,
                                                 is_causal=causal, implementation="mosaic_tpu")

        if jax.default_backend() != "tpu":
            attend = jaxcompat.for_tpu(_traced_cross_compiling(tokamax, attend))
        out = attend(q, k, v, mask)
        if per_head:
            out = jnp.swapaxes(out[:, :, :, 0], 1, 2)
        out = out[:, :lq]
        return out


def _attached_tpu_generation() -> int | None:
    """The attached TPU's generation (5 for "TPU v5 lite"), or None off a TPU."""
    if jax.default_backend() != "tpu":
        return None
    kind = jax.devices()[0].device_kind.lower()
    digits = "".join(c if c.isdigit() else " " for c in kind.partition("v")[2]).split()
    return int(digits[0]) if digits else None


@contextlib.contextmanager
def _cross_compiling(tokamax) -> Iterator[None]:
    """tokamax traces its TPU kernel on this non-TPU host, without its autotuning-cache
    misses (keyed by the host's device kind, so meaningless here)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(max(level, logging.ERROR))
    try:
        with tokamax.config.cross_compile(True), jaxcompat.tpu_target():
            yield
    finally:
        absl.setLevel(level)


def _traced_cross_compiling(tokamax, fn):
    """`fn(q, k, v, mask)` with its forward and its backward traced in `_cross_compiling`:
    jax traces a custom VJP's backward after the forward returned, outside any context the
    forward opened. The boolean mask gets no gradient."""

    @jax.custom_vjp
    def run(q, k, v, mask):
        with _cross_compiling(tokamax):
            return fn(q, k, v, mask)

    def run_fwd(q, k, v, mask):
        with _cross_compiling(tokamax):
            out, vjp_fn = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        return out, vjp_fn

    def run_bwd(vjp_fn, cotangent):
        with _cross_compiling(tokamax):
            return (*vjp_fn(cotangent), None)

    run.defvjp(run_fwd, run_bwd)
    return run
