"""The one interface every attention kernel implements.

A kernel is called as

    kernel(q, k, v, *, scale, bias=None, mask=None, causal=False, kv_lengths=None,
           layout="BLHD")

with, in layout "BLHD" (canonical, as `hlotool.site.AttentionSite`):
  q: [B, Lq, Hq, D]    k: [B, Lk, Hkv, D]    v: [B, Lk, Hkv, Dv]    -> out: [B, Lq, Hq, Dv]
and in layout "BHLD" the same arrays with the L and H axes swapped. Hq is a multiple of Hkv
(GQA/MQA): callers never repeat K/V heads.

Semantics shared by all kernels (the reference kernel is their definition):
  scores = scale · q·kᵀ + bias, over [B, Hq, Lq, Lk]; `scale=None` means unscaled (1.0), as in
  `AttentionSite.scale`. A key j is visible to query i when `mask[b, h, i, j]` (True = attend),
  `j <= i` if `causal` (top-left aligned, as `jax.nn.dot_product_attention`) and
  `j < kv_lengths[b]`. Keys that are not visible never contribute, even when they hold NaN. A
  query row with no visible key returns zeros, never NaN.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from hlotool.errors import HlotoolError
from hlotool.site import AttentionSite

LAYOUTS = ("BLHD", "BHLD")


class KernelError(HlotoolError):
    """A kernel was called with arguments it cannot take; the message names them."""


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether a kernel takes a site; falsy with a one-line `reason` when it does not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok

    @classmethod
    def yes(cls) -> Support:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Support:
        return cls(False, reason)


@dataclasses.dataclass(frozen=True)
class Features:
    """What one call asks for beyond the site's shapes (a site has one mask kind, a call may
    combine several: causal plus key padding, say)."""

    causal: bool = False
    bias: bool = False
    mask: bool = False
    kv_lengths: bool = False

    @classmethod
    def of_site(cls, site: AttentionSite) -> Features:
        return cls(
            causal=site.mask == "causal",
            bias=site.mask == "additive",
            mask=site.mask == "boolean",
        )


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """Analytic cost of one attention call on one device, summed over batch and heads.

    flops: multiply-adds count 2. transcendentals: exp/log evaluations. hbm_bytes: bytes moved
    between HBM (main memory) and the chip. onchip_bytes: working set one program instance
    keeps in VMEM/SMEM/cache (tiles and accumulators); 0 when the kernel streams everything
    through HBM.
    """

    flops: int
    transcendentals: int
    hbm_bytes: int
    onchip_bytes: int

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(
            self.flops + other.flops,
            self.transcendentals + other.transcendentals,
            self.hbm_bytes + other.hbm_bytes,
            max(self.onchip_bytes, other.onchip_bytes),
        )


@dataclasses.dataclass(frozen=True)
class Call:
    """One call's operands in canonical terms, validated.

    q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; bias: 4-D, each axis 1 or the
    full [B, Hq, Lq, Lk] size; mask: bool, same rule; kv_lengths: int32 [B].
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scale: float
    bias: jax.Array | None
    mask: jax.Array | None
    causal: bool
    kv_lengths: jax.Array | None

    @property
    def features(self) -> Features:
        return Features(
            causal=self.causal,
            bias=self.bias is not None,
            mask=self.mask is not None,
            kv_lengths=self.kv_lengths is not None,
        )

    def site(self) -> AttentionSite:
        """The call described as a site (the mask kind is the strongest one present)."""
        b, lq, hq, d = self.q.shape
        _, lk, hkv, dv = self.v.shape
        kind = "none"
        if self.causal:
            kind = "causal"
        if self.mask is not None:
            kind = "boolean"
        if self.bias is not None:
            kind = "additive"
        return AttentionSite(
            batch=b, q_len=lq, kv_len=lk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
            v_head_dim=dv, dtype=str(self.q.dtype), scale=self.scale, mask=kind,
            q_shape=tuple(self.q.shape), k_shape=tuple(self.k.shape),
            v_shape=tuple(self.v.shape), layout="BLHD",
        )


def _to_blhd(x: jax.Array, name: str, layout: str) -> jax.Array:
    if x.ndim != 4:
        raise KernelError(f"{name} must be 4-D ({layout}), got shape {tuple(x.shape)}")
    return x if layout == "BLHD" else jnp.swapaxes(x, 1, 2)


def _broadcast_operand(x: jax.Array, name: str, full: tuple[int, ...]) -> jax.Array:
    """`x` as 4-D with each axis 1 or the full [B, Hq, Lq, Lk] size."""
    if x.ndim > 4:
        raise KernelError(f"{name} of shape {tuple(x.shape)} has more than 4 axes")
    x4 = x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))
    for size, want in zip(x4.shape, full):
        if size not in (1, want):
            raise KernelError(
                f"{name} of shape {tuple(x.shape)} does not broadcast to [B, Hq, Lq, Lk] = "
                f"{list(full)}"
            )
    return x4


def make_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    kv_lengths: jax.Array | None = None,
    layout: str = "BLHD",
) -> Call:
    """Validate one call's arguments and bring them to canonical [B, L, H, D] terms."""
    if layout not in LAYOUTS:
        raise KernelError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    q, k, v = (_to_blhd(x, n, layout) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    b, lq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise KernelError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape} (BLHD)")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise KernelError(f"k {k.shape} and v {v.shape} (BLHD) differ in length or heads")
    if k.shape[3] != d:
        raise KernelError(f"q head dim {d} differs from k head dim {k.shape[3]}")
    hkv = k.shape[2]
    if hq % hkv:
        raise KernelError(f"query heads ({hq}) are not a multiple of key/value heads ({hkv})")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise KernelError(f"{n} must be floating point, got {x.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    full = (b, hq, lq, k.shape[1])
    if bias is not None:
        bias = _broadcast_operand(jnp.asarray(bias), "bias", full)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise KernelError(f"bias must be floating point, got {bias.dtype}")
    if mask is not None:
        mask = _broadcast_operand(jnp.asarray(mask), "mask", full)
        if mask.dtype != jnp.bool_:
            raise KernelError(f"mask must be boolean (True = attend), got {mask.dtype}")
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)
        if kv_lengths.shape != (b,) or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise KernelError(
                f"kv_lengths must be an integer [B] = [{b}] array, got "
                f"{kv_lengths.dtype}{list(kv_lengths.shape)}"
            )
        kv_lengths = kv_lengths.astype(jnp.int32)
    return Call(q, k, v, 1.0 if scale is None else float(scale), bias, mask, bool(causal),
                kv_lengths)


class AttentionKernel(abc.ABC):
    """An attention implementation: what it runs on, what it takes, what it costs, the call.

    Subclasses set `name` and `platforms`, implement `_check` (shape/dtype/feature limits),
    `cost` and `_attend` (canonical operands in, [B, Lq, Hq, Dv] out, differentiable).
    """

    name: ClassVar[str]
    platforms: ClassVar[tuple[str, ...]]  # jax platform names: "cpu", "tpu", "cuda"

    @property
    def unavailable_reason(self) -> str | None:
        """Why the installed jax cannot provide this kernel; None when it can."""
        return None

    def supports(self, site: AttentionSite, features: Features | None = None) -> Support:
        """Whether this kernel takes `site` (with `features`, default: the site's mask kind)."""
        if self.unavailable_reason is not None:
            return Support.no(f"{self.name} unavailable: {self.unavailable_reason}")
        if site.dtype not in ("float32", "bfloat16", "float16"):
            return Support.no(f"dtype {site.dtype} unsupported")
        return self._check(site, features or Features.of_site(site))

    @abc.abstractmethod
    def _check(self, site: AttentionSite, features: Features) -> Support:
        """Kernel-specific limits; reached only when the kernel is available."""

    @abc.abstractmethod
    def cost(self, site: AttentionSite, *, backward: bool = False) -> KernelCost:
        """Cost of the forward pass, or of forward plus backward when `backward`."""

    @abc.abstractmethod
    def _attend(self, call: Call) -> jax.Array:
        """[B, Lq, Hq, Dv] attention output for a validated, canonical call."""

    def __call__(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        scale: float | None,
        bias: jax.Array | None = None,
        mask: jax.Array | None = None,
        causal: bool = False,
        kv_lengths: jax.Array | None = None,
        layout: str = "BLHD",
    ) -> jax.Array:
        """Attention output in `layout`: [B, Lq, Hq, Dv] ("BLHD") or [B, Hq, Lq, Dv] ("BHLD")."""
        call = make_call(q, k, v, scale=scale, bias=bias, mask=mask, causal=causal,
                         kv_lengths=kv_lengths, layout=layout)
        support = self.supports(call.site(), call.features)
        if not support:
            raise KernelError(f"kernel {self.name}: {support.reason}")
        out = self._attend(call)
        return out if layout == "BLHD" else jnp.swapaxes(out, 1, 2)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def visible_fraction(lq: int, lk: int, bq: int, bk: int, causal: bool) -> float:
    """Fraction of the [Lq, Lk] score tiles (of bq × bk) a block-skipping kernel visits."""
    nq, nk = -(-lq // bq), -(-lk // bk)
    if not causal:
        return 1.0
    visited = sum(min(nk, -(-min((i + 1) * bq, lk) // bk)) for i in range(nq))
    return visited / (nq * nk)


def naive_cost(site: AttentionSite, *, backward: bool = False) -> KernelCost:
    """The naive formula as XLA runs it unfused: scores and probabilities go through HBM.

    Forward writes the [B, Hq, Lq, Lk] scores, reads them for the softmax, writes the
    probabilities and reads them for P·V. The backward (autodiff) reads P, writes and reads dP
    and dS. Causal masking is applied, not skipped, so it saves nothing.
    """
    b, hq, lq, lk = site.batch, site.num_q_heads, site.q_len, site.kv_len
    d, dv, item = site.head_dim, site.v_head_dim, site.itemsize
    scores = b * hq * lq * lk
    io = item * (b * lq * hq * d + b * lk * site.num_kv_heads * (d + dv) + b * lq * hq * dv)
    mm = 2 * scores * (d + dv)
    cost = KernelCost(mm + 5 * scores, scores, io + 4 * site.score_bytes, 0)
    if backward:
        cost += KernelCost(2 * mm + 4 * scores, 0, 2 * io + 5 * site.score_bytes, 0)
    return cost


def flash_cost(
    site: AttentionSite,
    *,
    block_q: int,
    block_k: int,
    backward: bool = False,
    kv_head_repeat: int = 1,
) -> KernelCost:
    """A tiled online-softmax kernel with block-level causal skipping.

    HBM: Q read and O written once; K and V read once per query block (times
    `kv_head_repeat` when the adapter materializes repeated K/V heads for GQA). The backward
    recomputes the scores (one more exp per visited score) and reads Q, dO once per key block
    and K, V once per query block. On chip: one q tile, one k/v tile, the score tile and the
    f32 accumulators.
    """
    b, hq, hkv, lq, lk = site.batch, site.num_q_heads, site.num_kv_heads, site.q_len, site.kv_len
    d, dv, item = site.head_dim, site.v_head_dim, site.itemsize
    frac = visible_fraction(lq, lk, block_q, block_k, site.causal)
    nq, nk = -(-lq // block_q), -(-lk // block_k)
    scores = int(b * hq * lq * lk * frac)
    q_bytes, o_bytes = b * lq * hq * d * item, b * lq * hq * dv * item
    kv_bytes = b * lk * hkv * kv_head_repeat * (d + dv) * item
    repeat_bytes = 0 if kv_head_repeat == 1 else b * lk * hkv * (d + dv) * item + kv_bytes
    mm = 2 * scores * (d + dv)
    onchip = 4 * (block_q * d + block_k * (d + dv) + block_q * block_k + block_q * (dv + 2))
    cost = KernelCost(
        mm + 5 * scores,
        scores,
        q_bytes + o_bytes + math.ceil(nq * frac) * kv_bytes + repeat_bytes,
        onchip,
    )
    if backward:
        lse_bytes = 4 * b * hq * lq
        reads = math.ceil(nk * frac) * (q_bytes + o_bytes) + math.ceil(nq * frac) * kv_bytes
        writes = q_bytes + kv_bytes + repeat_bytes
        cost += KernelCost(2 * mm + mm // 2 + 6 * scores, scores,
                           reads + writes + 2 * lse_bytes, 2 * onchip)
    return cost


def row_has_key(call: Call) -> jax.Array | None:
    """bool, broadcastable to [B, Hq, Lq, 1]: whether each query row sees at least one key;
    None when every row does.

    A causal row always sees key 0, so without a mask only kv_lengths[b] == 0 empties a row.
    """
    has = None
    if call.kv_lengths is not None:
        has = (call.kv_lengths > 0)[:, None, None, None]
    if call.mask is not None:
        lq, lk = call.q.shape[1], call.k.shape[1]
        visible = call.mask
        if call.kv_lengths is not None:
            visible = visible & (np.arange(lk) < call.kv_lengths[:, None, None, None])
        if call.causal:
            visible = visible & (np.arange(lk)[None, :] <= np.arange(lq)[:, None])
        has = jnp.any(visible, axis=-1, keepdims=True)
    return has


def zero_invalid_keys(call: Call) -> Call:
    """K and V with positions ≥ kv_lengths set to 0, so NaN/Inf padding cannot leak."""
    if call.kv_lengths is None:
        return call
    keep = (np.arange(call.k.shape[1])[None, :] < call.kv_lengths[:, None])[:, :, None, None]
    return dataclasses.replace(
        call, k=jnp.where(keep, call.k, 0), v=jnp.where(keep, call.v, 0)
    )
