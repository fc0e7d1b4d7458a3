"""The one interface every attention kernel implements.

A kernel is called as

    kernel(q, k, v, *, scale, bias=None, mask=None, causal=False, window=None,
           kv_lengths=None, segment_ids=None, query_mask=None, fill=-inf, softcap=None,
           post_mask=None, sinks=None, out_dtype=None, layout="BLHD")

with, in layout "BLHD" (canonical, as `hlotool.site.AttentionSite`):
  q: [B, Lq, Hq, D]    k: [B, Lk, Hkv, D]    v: [B, Lk, Hkv, Dv]    -> out: [B, Lq, Hq, Dv]
and in layout "BHLD" the same arrays with the L and H axes swapped. Hq is a multiple of Hkv
(GQA/MQA): callers never repeat K/V heads.

Semantics shared by all kernels (the reference kernel is their definition), over
[B, Hq, Lq, Lk]:

    logits = where(visible, cap(scale · q·kᵀ) + bias, fill)
    out    = softmax(logits) · v

`scale=None` means unscaled (1.0), as in `AttentionSite.scale`. `cap` is the identity, or with
`softcap=c` logit soft-capping c·tanh(x / c) (Gemma 2). Three variants real models use extend
the softmax: `post_mask` (broadcastable to [B, Hq, Lq, Lk]) changes probabilities after it:
bool, `where(post_mask, softmax(logits), 0)` as Keras' masked softmax does (the keys it zeroes
still weigh in the normalizer); float, `softmax(logits) * post_mask`, dropout's keep / keep_prob
(the random bits are the program's own, so the result is exactly its; no gradient flows to it;
-0.0 marks a key a boolean mask beside it drops: zero whatever the probability, NaN too, as
`where` makes it, where +0.0 multiplies as dropout's `p * 0` does);
`sinks` (float, broadcastable to [B, Hq, Lq, 1]) is one more logit per row that takes part in
the softmax and has no value (attention sinks, GPT-OSS): out = Σ_j exp(l_j)·v_j / (exp(sink) +
Σ_j exp(l_j)). Key j is visible to query i when `mask[b, h, i, j]` (True = attend), `j <= i` if
`causal` (top-left aligned, as `jax.nn.dot_product_attention`), `i - left <= j <= i + right` for
`window=(left, right)` (a sliding window; None for an unbounded side), `j < kv_lengths[b]`
and, with `segment_ids=(q_ids [B, Lq], kv_ids [B, Lk])` (packed sequences), q_ids[b, i] ==
kv_ids[b, j], and query_mask[b, i] (bool [B|1, Lq]: query padding, a factor of the mask that
hides whole query rows, kept apart so that a kernel taking key padding and a band as
structure can take it too instead of an [Lq, Lk] mask).
`fill` is the logit of a hidden key, exactly what `jnp.where(mask, scores, fill)` gives the
naive program: with the default -inf hidden keys never contribute, even when they hold NaN, and
a query row with no visible key returns zeros; with a finite fill a hidden key keeps its weight
exp(fill - max), so a row with no visible key is the mean of v over all keys. `out_dtype` is the
result's dtype (default: q's); "float32" keeps the f32 accumulation of a kernel that has one,
for a caller that goes on computing with the result before rounding it (hlotool's rewrite
applies a head mask to it).

A kernel that hides keys its own way (a large negative constant in its tiles, blocks it does
not visit) declares that logit as `hidden_logit`. Its result is used only where a runtime check
shows the difference is below float32 resolution (`hiding_is_exact`); otherwise the call
runs in the chunked kernel, which implements `fill` exactly.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import ClassVar, Required, TypedDict, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlotool import jaxcompat
from hlotool.errors import HlotoolError
from hlotool.hardware import Hardware
from hlotool.kernels import drawn
from hlotool.kernels.drawn import DrawnMask
from hlotool.site import AttentionSite, Band, band_of

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


# Variants beyond the basic masks (module docstring); a kernel lists those it implements in
# `AttentionKernel.extras`, and refuses the others by these names.
EXTRAS = {"softcap": "logit soft-capping", "post_mask": "a mask applied after the softmax",
          "dropout": "dropout on the probabilities", "sinks": "attention sinks",
          "window": "a sliding window", "segments": "segment ids",
          "query_padding": "query padding"}


@dataclasses.dataclass(frozen=True)
class Features:
    """What one call asks for beyond the site's shapes (a site has one mask kind, a call may
    combine several: causal plus key padding, say)."""

    causal: bool = False
    bias: bool = False
    mask: bool = False
    kv_lengths: bool = False
    finite_fill: bool = False  # hidden keys keep a finite logit (see `Call.fill`)
    softcap: bool = False
    post_mask: bool = False
    dropout: bool = False
    sinks: bool = False
    window: bool = False
    segments: bool = False
    query_padding: bool = False  # a factor of the mask hiding whole query rows

    @classmethod
    def of_site(cls, site: AttentionSite) -> Features:
        return cls(
            causal=site.causal,
            bias=site.mask == "additive",
            mask=site.mask == "boolean",
            finite_fill=site.mask_fill is not None and math.isfinite(site.mask_fill),
            softcap=site.softcap is not None,
            post_mask=site.post_mask,
            dropout=site.dropout,
            sinks=site.sinks,
            window=site.window is not None,
            segments=site.segments,
            query_padding=site.query_padding,
        )

    def extras(self) -> tuple[str, ...]:
        """The softmax variants asked for, by `EXTRAS` name."""
        return tuple(name for name in EXTRAS if getattr(self, name))

    @property
    def hides_keys(self) -> bool:
        return (self.causal or self.mask or self.kv_lengths or self.window or self.segments
                or self.query_padding)


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
    score_blocks: ScoreBlocks | None = None  # the score tiles of one head a tiled kernel computes

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(
            self.flops + other.flops,
            self.transcendentals + other.transcendentals,
            self.hbm_bytes + other.hbm_bytes,
            max(self.onchip_bytes, other.onchip_bytes),
            self.score_blocks or other.score_blocks,
        )


@dataclasses.dataclass(frozen=True)
class ScoreBlocks:
    """The [Lq, Lk] score tiles (of block_q × block_k) of one head a block-skipping kernel
    computes: `computed` of `total`, the rest lying wholly outside the site's band."""

    computed: int
    total: int
    block_q: int
    block_k: int

    @property
    def skipped(self) -> int:
        return self.total - self.computed

    def to_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "skipped": self.skipped}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q", "k", "v", "bias", "mask", "kv_lengths", "post_mask",
                                "sinks", "segments", "query_mask"],
                   meta_fields=["scale", "causal", "fill", "softcap", "out_dtype", "window"])
@dataclasses.dataclass(frozen=True)
class Call:
    """One call's operands in canonical terms, validated.

    q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; bias: 4-D, each axis 1 or the
    full [B, Hq, Lq, Lk] size; mask: bool, same rule; post_mask: bool or float, same rule,
    or a `DrawnMask` [B|1, Hq|1, Lq, Lk] (drawn per tile by a kernel that `draws`);
    kv_lengths: int32 [B]; sinks: float [B|1, Hq|1, Lq|1, 1]; fill: the logit of a hidden key
    (-inf, or finite); softcap: c of c·tanh(x / c), or None; out_dtype: the result's dtype, None
    for q's; window: (left, right) of a sliding window (None for an unbounded side), or None.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    scale: float
    bias: jax.Array | None
    mask: jax.Array | None
    causal: bool
    kv_lengths: jax.Array | None
    fill: float = -math.inf
    softcap: float | None = None
    post_mask: jax.Array | DrawnMask | None = None
    sinks: jax.Array | None = None
    out_dtype: str | None = None
    window: tuple[int | None, int | None] | None = None
    segments: tuple[jax.Array, jax.Array] | None = None  # (q ids [B, Lq], kv ids [B, Lk])
    query_mask: jax.Array | None = None  # bool [B|1, Lq]: the query rows the mask keeps

    @property
    def band(self) -> Band | None:
        """The band the causal flag and the window leave visible (`band_of`)."""
        return band_of(self.causal, self.window)

    @property
    def result_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.out_dtype or self.q.dtype)

    @property
    def features(self) -> Features:
        return Features(
            causal=self.causal,
            bias=self.bias is not None,
            mask=self.mask is not None,
            kv_lengths=self.kv_lengths is not None,
            finite_fill=math.isfinite(self.fill),
            softcap=self.softcap is not None,
            post_mask=self.post_mask is not None and self.post_mask.dtype == jnp.bool_,
            dropout=self.post_mask is not None and self.post_mask.dtype != jnp.bool_,
            sinks=self.sinks is not None,
            window=self.window is not None,
            segments=self.segments is not None,
            query_padding=self.query_mask is not None,
        )

    def site(self) -> AttentionSite:
        """The call described as a site (the mask kind is the strongest one present)."""
        b, lq, hq, d = self.q.shape
        _, lk, hkv, dv = self.v.shape
        kind = "none"
        if self.window is not None:
            kind = "local"
        if self.causal:
            kind = "causal"
        if self.mask is not None:
            kind = "boolean"
        if self.bias is not None:
            kind = "additive"
        # The axes the operands vary along, as far as their shapes say ([B, Hq, Lq, Lk]).
        operands = [x.shape for x in (self.mask, self.bias) if x is not None]
        axes = "".join(c for a, c in enumerate("BHQK") if any(s[a] != 1 for s in operands))
        return AttentionSite(
            batch=b, q_len=lq, kv_len=lk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
            v_head_dim=dv, dtype=str(self.q.dtype), scale=self.scale, mask=kind,
            causal=self.causal, mask_axes=axes if operands else None,
            q_shape=tuple(self.q.shape), k_shape=tuple(self.k.shape),
            v_shape=tuple(self.v.shape), layout="BLHD",
            mask_fill=None if kind == "none" else self.fill, softcap=self.softcap,
            post_mask=self.features.post_mask, dropout=self.features.dropout,
            sinks=self.sinks is not None,
            window=self.window, segments=self.segments is not None,
            query_padding=self.query_mask is not None,
        )

    def with_query_mask_in_mask(self) -> Call:
        """This call with `query_mask` ANDed into `mask` ([B, 1, Lq, 1] alone, else the
        product): for a kernel that takes any mask but no query mask of its own."""
        if self.query_mask is None:
            return self
        rows = self.query_mask[:, None, :, None]
        mask = rows if self.mask is None else self.mask & rows
        return dataclasses.replace(self, mask=mask, query_mask=None)


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


class CallOptions(TypedDict, total=False):
    """The keyword arguments of every kernel call (module docstring): written once, here."""

    scale: Required[float | None]
    bias: jax.Array | None
    mask: jax.Array | None
    causal: bool
    window: tuple[int | None, int | None] | None
    kv_lengths: jax.Array | None
    segment_ids: tuple[jax.Array, jax.Array] | None
    query_mask: jax.Array | None
    fill: float
    softcap: float | None
    post_mask: jax.Array | None
    sinks: jax.Array | None
    out_dtype: str | None
    layout: str


def make_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    kv_lengths: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    query_mask: jax.Array | None = None,
    fill: float = -math.inf,
    softcap: float | None = None,
    post_mask: jax.Array | None = None,
    sinks: jax.Array | None = None,
    out_dtype: str | None = None,
    layout: str = "BLHD",
) -> Call:
    """Validate one call's arguments (`CallOptions`) and bring them to canonical
    [B, L, H, D] terms."""
    if layout not in LAYOUTS:
        raise KernelError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    fill = float(fill)
    if math.isnan(fill) or fill == math.inf:
        raise KernelError(f"fill must be -inf or finite, got {fill}")
    if softcap is not None:
        softcap = float(softcap)
        if not (math.isfinite(softcap) and softcap > 0):
            raise KernelError(f"softcap must be positive and finite, got {softcap}")
    if window is not None:
        window = _window(window)
    if out_dtype is not None:
        if not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
            raise KernelError(f"out_dtype must be floating point, got {out_dtype}")
        out_dtype = str(jnp.dtype(out_dtype))
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
    if isinstance(post_mask, DrawnMask):
        if post_mask.full[2:] != full[2:] or any(
                n not in (1, want) for n, want in zip(post_mask.full, full)):
            raise KernelError(f"a drawn post_mask of shape {post_mask.full} for scores "
                              f"{full} [B, Hq, Lq, Lk]")
    elif post_mask is not None:
        post_mask = _broadcast_operand(jnp.asarray(post_mask), "post_mask", full)
        if post_mask.dtype != jnp.bool_ and not jnp.issubdtype(post_mask.dtype, jnp.floating):
            raise KernelError(f"post_mask must be boolean (True = keep) or floating point (a "
                              f"multiplier), got {post_mask.dtype}")
    if sinks is not None:
        sinks = _broadcast_operand(jnp.asarray(sinks), "sinks", full[:3] + (1,))
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise KernelError(f"sinks must be floating point, got {sinks.dtype}")
    if kv_lengths is not None:
        kv_lengths = jnp.asarray(kv_lengths)
        if kv_lengths.shape != (b,) or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise KernelError(
                f"kv_lengths must be an integer [B] = [{b}] array, got "
                f"{kv_lengths.dtype}{list(kv_lengths.shape)}"
            )
        kv_lengths = kv_lengths.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = _segment_ids(segment_ids, b, lq, k.shape[1])
    if query_mask is not None:
        query_mask = jnp.asarray(query_mask)
        if query_mask.ndim != 2 or query_mask.shape[0] not in (1, b) or \
                query_mask.shape[1] != lq or query_mask.dtype != jnp.bool_:
            raise KernelError(f"query_mask must be a boolean [B|1, Lq] = [{b}|1, {lq}] "
                              f"array, got {query_mask.dtype}{list(query_mask.shape)}")
    return Call(q, k, v, 1.0 if scale is None else float(scale), bias, mask, bool(causal),
                kv_lengths, fill, softcap, post_mask, sinks, out_dtype, window, segment_ids,
                query_mask)


def _segment_ids(ids, b: int, lq: int, lk: int) -> tuple[jax.Array, jax.Array]:
    """(q ids [B, Lq], kv ids [B, Lk]) as int32, validated."""
    try:
        q_ids, kv_ids = (jnp.asarray(x) for x in ids)
    except (TypeError, ValueError):
        raise KernelError("segment_ids must be a pair (q_ids [B, Lq], kv_ids [B, Lk])") from None
    for x, name, length in ((q_ids, "q", lq), (kv_ids, "kv", lk)):
        if x.shape != (b, length) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise KernelError(f"segment_ids {name} must be an integer [B, L] = [{b}, {length}] "
                              f"array, got {x.dtype}{list(x.shape)}")
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def _window(window) -> tuple[int | None, int | None] | None:
    """`window` validated as (left, right) ints or None; None when both sides are unbounded."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise KernelError(f"window must be a pair (left, right), got {window!r}") from None
    for side in (left, right):
        if side is not None and not isinstance(side, (int, np.integer)):
            raise KernelError(f"window sides must be ints or None, got {window!r}")
    if left is not None and right is not None and left + right < 0:
        raise KernelError(f"window {window!r} shows no key to any query (left + right < 0)")
    if left is None and right is None:
        return None
    return (None if left is None else int(left), None if right is None else int(right))


class AttentionKernel(abc.ABC):
    """An attention implementation: what it runs on, what it takes, what it costs, the call.

    Subclasses set `name` and `platforms`, implement `_check` (shape/dtype/feature limits),
    `cost` and `_attend` (canonical operands in, [B, Lq, Hq, Dv] out, differentiable).
    """

    name: ClassVar[str]
    platforms: ClassVar[tuple[str, ...]]  # jax platform names: "cpu", "tpu", "cuda"
    # The logit this kernel gives the keys it hides instead of `Call.fill` (a large negative
    # constant in its tiles); None when it implements `fill` exactly.
    hidden_logit: ClassVar[float | None] = None
    # Where hiding keys at `hidden_logit` would change a call's result (`_exact`), `run`
    # computes it in this kernel instead: the chunked kernel, which implements `fill`
    # exactly. Named by the kernels that set `hidden_logit`, so this module imports none.
    exact: ClassVar[type[AttentionKernel] | None] = None
    # The softmax variants (`EXTRAS`) this kernel implements; it refuses the others.
    extras: ClassVar[frozenset[str]] = frozenset()
    # Whether its values carry the types jax checks in a shard_map body with check_vma=True
    # (over which mesh axes each varies): upstream Pallas kernels build their outputs' types
    # without them, and jax refuses those there.
    typed_for_shard_map: ClassVar[bool] = False
    # Whether `_attend` takes a `DrawnMask` post_mask (draws its tiles); others get it whole.
    draws: ClassVar[bool] = False

    @property
    def unavailable_reason(self) -> str | None:
        """Why the installed jax cannot provide this kernel; None when it can."""
        return None

    def cannot_draw(self) -> str | None:
        """Why this kernel, one that `draws`, reads dropout masks whole here; None when it
        draws them per tile (or draws nothing)."""
        return drawn.usable() if self.draws else None

    def supports(self, site: AttentionSite, features: Features | None = None) -> Support:
        """Whether this kernel takes `site` (with `features`, default: the site's mask kind)."""
        if self.unavailable_reason is not None:
            return Support.no(f"{self.name} unavailable: {self.unavailable_reason}")
        if site.dtype not in ("float32", "bfloat16", "float16"):
            return Support.no(f"dtype {site.dtype} unsupported")
        features = features or Features.of_site(site)
        missing = [EXTRAS[e] for e in features.extras() if e not in self.extras]
        if missing:
            return Support.no(f"{' and '.join(missing)} unsupported ({self.name} has none)")
        return self._check(site, features)

    @abc.abstractmethod
    def _check(self, site: AttentionSite, features: Features) -> Support:
        """Kernel-specific limits; reached only when the kernel is available."""

    @abc.abstractmethod
    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        """Cost of the forward pass, or of forward plus backward when `backward`, on
        `hardware` (kernels whose tiles depend on the chip; None: the chip traced for)."""

    @abc.abstractmethod
    def _attend(self, call: Call) -> jax.Array:
        """[B, Lq, Hq, Dv] attention output for a validated, canonical call."""

    def _hides_keys(self, call: Call) -> bool:
        """Whether this call hides any key from any query (adapters that pad add theirs)."""
        return call.features.hides_keys

    def stand_in(self) -> AttentionKernel:
        """This kernel as a machine without its device runs it, for plumbing checks (dry
        runs): itself, unless it needs a GPU or TPU to run."""
        return self

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array,
                 **options: Unpack[CallOptions]) -> jax.Array:
        """Attention output in `layout`: [B, Lq, Hq, Dv] ("BLHD") or [B, Hq, Lq, Dv] ("BHLD")."""
        out = self.run(make_call(q, k, v, **options))
        return out if options.get("layout", "BLHD") == "BLHD" else jnp.swapaxes(out, 1, 2)

    def run(self, call: Call) -> jax.Array:
        """[B, Lq, Hq, Dv] for a canonical call (see `make_call`); raises `KernelError` when
        this kernel does not take it."""
        support = self.supports(call.site(), call.features)
        if not support:
            raise KernelError(f"kernel {self.name}: {support.reason}")
        if isinstance(call.post_mask, DrawnMask) and not self.draws:
            call = dataclasses.replace(call, post_mask=call.post_mask.dense())

        def attend(kernel: AttentionKernel) -> Callable[[Call], jax.Array]:
            return lambda c: kernel._attend(c).astype(c.result_dtype)

        if self.hidden_logit is None or not self._hides_keys(call):
            return _rows_without_kept_keys(call, attend(self)(call))
        if self.exact is None:
            raise KernelError(f"kernel {self.name} hides keys at {self.hidden_logit:g} and "
                              "names no exact kernel for the calls where that changes the result")
        out = lax.cond(self._exact(call), attend(self), attend(self.exact()), call)
        return _rows_without_kept_keys(call, out)

    def _exact(self, call: Call) -> jax.Array:
        """bool scalar: whether this kernel's own way of hiding keys (`hidden_logit`)
        computes `call` within float32 resolution; where not, `run` takes the chunked one."""
        return hiding_is_exact(call, self.hidden_logit)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _rows_without_kept_keys(call: Call, out: jax.Array) -> jax.Array:
    """`out` [B, Lq, Hq, Dv] with 0 in the rows a bool post_mask keeps no key of: the program's
    where(post_mask, p, 0) makes them 0 even where the row's softmax is NaN (a NaN key it
    hides before the softmax), which a kernel's normalizer would carry into them."""
    post = call.post_mask
    if post is None or isinstance(post, DrawnMask) or post.dtype != jnp.bool_:
        return out
    kept = jnp.moveaxis(jnp.any(post, axis=-1), 1, 2)[..., None]  # [B|1, Lq|1, Hq|1, 1]
    return jnp.where(kept, out, jnp.zeros((), out.dtype))


def cdiv(a, b):
    """⌈a / b⌉ for positive ints (and jax integer arrays, as a loop bound)."""
    return (a + b - 1) // b


def round_up(x: int, multiple: int) -> int:
    """`x` rounded up to a multiple of `multiple`."""
    return cdiv(x, multiple) * multiple


def key_block_span(i, nk: int, bq: int, bk: int, band: Band | None, *, maximum=max,
                   minimum=min):
    """[first, end) of the key blocks (of bk) that query block i (of bq) sees some key of
    under `band`; `maximum`/`minimum` are jnp's for a traced i."""
    if band is None:
        return 0, nk
    left, right = band
    first = 0 if left is None else maximum(0, (i * bq - left) // bk)
    end = nk if right is None else minimum(nk, maximum(0, cdiv(i * bq + bq + right, bk)))
    return first, maximum(first, end)


def query_block_span(j, nq: int, bq: int, bk: int, band: Band | None, *, maximum=max,
                     minimum=min):
    """[first, end) of the query blocks that see some key of key block j under `band`."""
    if band is None:
        return 0, nq
    left, right = band
    first = 0 if right is None else maximum(0, (j * bk - right) // bq)
    end = nq if left is None else minimum(nq, maximum(0, (j * bk + bk - 1 + left) // bq + 1))
    return first, maximum(first, end)


def score_blocks(lq: int, lk: int, bq: int, bk: int, band: Band | None) -> ScoreBlocks:
    """The [Lq, Lk] score tiles (of bq × bk) a block-skipping kernel visits under `band`."""
    nq, nk = cdiv(lq, bq), cdiv(lk, bk)
    spans = (key_block_span(i, nk, bq, bk, band) for i in range(nq))
    return ScoreBlocks(sum(end - first for first, end in spans), nq * nk, bq, bk)


def visible_fraction(lq: int, lk: int, bq: int, bk: int, band: Band | None) -> float:
    """Fraction of the [Lq, Lk] score tiles (of bq × bk) a block-skipping kernel visits."""
    blocks = score_blocks(lq, lk, bq, bk, band)
    return blocks.computed / blocks.total


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
    blocks = score_blocks(lq, lk, block_q, block_k, site.band)
    frac = blocks.computed / blocks.total
    nq, nk = cdiv(lq, block_q), cdiv(lk, block_k)
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
        blocks,
    )
    if backward:
        lse_bytes = 4 * b * hq * lq
        reads = math.ceil(nk * frac) * (q_bytes + o_bytes) + math.ceil(nq * frac) * kv_bytes
        writes = q_bytes + kv_bytes + repeat_bytes
        cost += KernelCost(2 * mm + mm // 2 + 6 * scores, scores,
                           reads + writes + 2 * lse_bytes, 2 * onchip)
    return cost


# A finite fill above this is a soft mask, not a hidden key: `hiding_is_exact` would fail for
# logits of any ordinary size, so kernels that hide keys their own way refuse it up front.
# Below it the runtime check decides. -1e3, not -1e4: the -1e4 masks of bf16 and f16 models
# (KerasHub's `large_neg`) are -9984 there, and hide keys whenever |logits| stay under ~970.
HARD_FILL = -1e3


def soft_fill_refusal(site: AttentionSite, features: Features) -> Support:
    """For kernels with a `hidden_logit`: refuse a site whose hidden keys keep a logit too
    large to be hidden (where(mask, s, -5) is a soft mask the naive program weighs)."""
    fill = site.mask_fill
    if features.finite_fill and fill is not None and fill > HARD_FILL:
        return Support.no(f"hidden keys keep logit {fill:g} (a soft mask, above {HARD_FILL:g}); "
                          "this kernel hides keys outright")
    return Support.yes()


def post_softmax(p: jax.Array, post: jax.Array) -> jax.Array:
    """Probabilities `p` after a `post_mask` (broadcastable): zeroed where a bool one drops a
    key, multiplied by a float one."""
    if post.dtype == jnp.bool_:
        return jnp.where(post, p, 0.0)
    dropped = (post == 0) & jnp.signbit(post)  # -0.0: a boolean mask's zero (module doc)
    return jnp.where(dropped, 0.0, p * post.astype(p.dtype))


def visible_keys(call: Call) -> jax.Array | None:
    """bool, broadcastable to [B, Hq, Lq, Lk]: which keys each query sees; None for all."""
    lq, lk = call.q.shape[1], call.k.shape[1]
    visible = call.mask
    band = call.band
    for extra in (None if band is None else band_mask(lq, lk, band)[None, None],
                  None if call.kv_lengths is None
                  else jnp.arange(lk) < call.kv_lengths[:, None, None, None],
                  None if call.segments is None
                  else call.segments[0][:, None, :, None] == call.segments[1][:, None, None, :],
                  None if call.query_mask is None else call.query_mask[:, None, :, None]):
        if extra is not None:
            visible = extra if visible is None else visible & extra
    return visible


def row_has_key(call: Call) -> jax.Array | None:
    """bool, broadcastable to [B, Hq, Lq, 1]: whether each query row sees at least one key;
    None when every row does (a causal row always sees key 0)."""
    if call.query_mask is not None:
        rows = call.query_mask[:, None, :, None]
        others = row_has_key(dataclasses.replace(call, query_mask=None))
        return rows if others is None else rows & others
    keys = _kept_keys(call)
    if keys is not None:
        return _band_has_key(keys, call.q.shape[1], call.band)
    if call.mask is None and call.kv_lengths is None and call.segments is None:
        if call.window is None:
            return None
        # Row i sees keys max(0, i - left) .. min(Lk - 1, i + right): no [Lq, Lk] array.
        left, right = call.window
        i = jnp.arange(call.q.shape[1])[:, None]
        first = jnp.zeros_like(i) if left is None else jnp.maximum(0, i - left)
        last = jnp.full_like(i, call.k.shape[1] - 1)
        if right is not None:
            last = jnp.minimum(last, i + right)
        if call.causal:
            last = jnp.minimum(last, i)
        return (first <= last)[None, None]  # [1, 1, Lq, 1]
    return jnp.any(visible_keys(call), axis=-1, keepdims=True)


def key_mask(call: Call) -> jax.Array:
    """bool [B|1, Lk]: the key mask of a call whose mask varies along batch and keys only."""
    mask = call.mask
    return jnp.broadcast_to(mask, (mask.shape[0], 1, 1, call.k.shape[1]))[:, 0, 0]


def _kept_keys(call: Call) -> jax.Array | None:
    """bool [B|1, Lk]: the keys a call keeps where what hides them varies along the keys
    alone (key padding, kv_lengths; no segment ids); None otherwise or without either."""
    mask = call.mask
    if call.segments is not None or (mask is not None and mask.shape[1:3] != (1, 1)) or (
            mask is None and call.kv_lengths is None):
        return None
    lk = call.k.shape[1]
    keys = None if mask is None else key_mask(call)
    if call.kv_lengths is not None:
        within = jnp.arange(lk)[None, :] < call.kv_lengths[:, None]
        keys = within if keys is None else keys & within
    return keys


def _band_has_key(keys: jax.Array, lq: int, band: Band | None) -> jax.Array:
    """bool [B|1, 1, Lq, 1]: whether row i keeps a key of `keys` [B|1, Lk] inside `band`,
    from prefix counts of the kept keys: O(L), where reducing the [Lq, Lk] visibility would
    write an L×L buffer (a device's [Lq/n, Lk] of it on a mesh)."""
    lk = keys.shape[1]
    counts = jnp.concatenate([jnp.zeros((keys.shape[0], 1), jnp.int32),
                              jnp.cumsum(keys.astype(jnp.int32), axis=1)], axis=1)
    i = jnp.arange(lq)
    left, right = band if band is not None else (None, None)
    first = jnp.zeros_like(i) if left is None else jnp.clip(i - left, 0, lk)
    end = jnp.full_like(i, lk) if right is None else jnp.clip(i + right + 1, 0, lk)
    end = jnp.maximum(end, first)
    has = jnp.take(counts, end, axis=1) > jnp.take(counts, first, axis=1)
    return has[:, None, :, None]


def band_mask(lq: int, lk: int, window: tuple[int | None, int | None]) -> jax.Array:
    """bool [Lq, Lk]: `i - left <= j <= i + right` (built from iotas, so XLA fuses it into
    whatever reads it rather than holding an [Lq, Lk] constant)."""
    i = lax.broadcasted_iota(jnp.int32, (lq, lk), 0)
    j = lax.broadcasted_iota(jnp.int32, (lq, lk), 1)
    left, right = window
    visible = jnp.ones((lq, lk), bool)
    if left is not None:
        visible = visible & (j >= i - left)
    if right is not None:
        visible = visible & (j <= i + right)
    return visible


def axes_varied_over(*arrays: jax.Array | None) -> frozenset:
    """The mesh axes any of `arrays` varies over inside a shard_map body (empty elsewhere)."""
    return frozenset().union(*(jaxcompat.varying_axes(jax.typeof(x)) for x in arrays
                               if x is not None))


def varying(tree, axes: frozenset):
    """`tree`'s arrays cast to vary over `axes` (a no-op outside shard_map bodies): a loop
    carry started from constants must have the type its body gives it, which varies over
    whatever the operands vary over."""
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - axes_varied_over(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def zero_invalid_keys(call: Call) -> Call:
    """K and V with positions ≥ kv_lengths set to 0, so NaN/Inf padding cannot leak. Only
    under an infinite fill: a finite one gives those keys weight, as the naive program does."""
    if call.kv_lengths is None or math.isfinite(call.fill):
        return call
    keep = (np.arange(call.k.shape[1])[None, :] < call.kv_lengths[:, None])[:, :, None, None]
    return dataclasses.replace(
        call, k=jnp.where(keep, call.k, 0), v=jnp.where(keep, call.v, 0)
    )


def empty_row_value(call: Call) -> jax.Array:
    """[B, 1, Hq, Dv] (f32): what a row with no visible key computes. Under a finite fill every
    logit of it equals the fill, so softmax is uniform and the row is the mean of v over all
    keys (less a sink's share); under -inf it is zeros (the convention of every kernel here).
    Sinks, where present, do not vary along the queries (detection refuses those that do)."""
    b, _, hq, _ = call.q.shape
    if not math.isfinite(call.fill):
        return jnp.zeros((b, 1, hq, call.v.shape[3]), jnp.float32)
    mean = jnp.mean(call.v.astype(jnp.float32), axis=1, keepdims=True)
    mean = jnp.repeat(mean, hq // call.v.shape[2], axis=2)
    if call.sinks is None:
        return mean
    # A sink takes its share of the weight: Lk·e^fill / (Lk·e^fill + e^sink).
    lk, sink = call.k.shape[1], jnp.swapaxes(call.sinks[:, :, :1, :], 1, 2)  # [B|1, 1, Hq|1, 1]
    top = jnp.maximum(call.fill, sink)
    keys = lk * jnp.exp(call.fill - top)
    return mean * (keys / (keys + jnp.exp(sink - top)))


def with_empty_rows(call: Call, out: jax.Array) -> jax.Array:
    """`out` [B, Lq, Hq, Dv] with rows that see no key set to `empty_row_value`, for kernels
    whose hiding leaves such rows undefined."""
    has = row_has_key(call)
    if has is None:
        return out
    return jnp.where(jnp.swapaxes(has, 1, 2), out, empty_row_value(call).astype(out.dtype))


# A hidden key whose logit is this far below the row's largest visible logit carries less
# than 2^-24 of the row's weight even if every key of the row is hidden: below float32
# resolution of the values averaged, so hiding it outright changes nothing representable.
_RESOLUTION = 24 * math.log(2) + 1


def score_bound(call: Call) -> jax.Array:
    """f32 scalar max‖q_i‖·max‖k_j‖: a bound on every |q_i·k_j| (Cauchy-Schwarz), O(L·D);
    non-finite when q or k holds a non-finite value."""
    f32 = jnp.float32
    q_norm = jnp.max(jnp.sqrt(jnp.sum(jnp.square(call.q.astype(f32)), axis=-1)))
    k_norm = jnp.max(jnp.sqrt(jnp.sum(jnp.square(call.k.astype(f32)), axis=-1)))
    return q_norm * k_norm


def hiding_is_exact(call: Call, hidden_logit: float) -> jax.Array:
    """bool scalar: whether a kernel that gives hidden keys `hidden_logit` (and skips what it
    does not visit) computes this call within float32 resolution of its exact semantics.

    Exact semantics give a hidden key logit `call.fill`. Either way that key's weight is at
    most exp(max(fill, hidden_logit) - M) for M the row's largest visible logit, and
    M ≥ -|scale|·max‖q_i‖·max‖k_j‖ + min(bias) (Cauchy-Schwarz); with Lk keys the hidden
    weight stays below 2^-24 when max(fill, hidden_logit) is ln(Lk) + 24 ln 2 + 1 below that
    bound. Rows with no visible key are not covered: kernels set them with `with_empty_rows`.
    The check costs O(L·D) (plus one pass over a bias) and is false on any non-finite input,
    sending the call to the exact kernel.
    """
    lowest = -abs(call.scale) * score_bound(call)
    if call.bias is not None:
        lowest = lowest + jnp.min(call.bias.astype(jnp.float32))
    margin = math.log(max(call.k.shape[1], 1)) + _RESOLUTION
    hidden = max(call.fill, hidden_logit)
    return jnp.isfinite(lowest) & (hidden + margin < lowest)
