"""A jaxpr site in kernel terms: the `hlotool.kernels.base.Call` that computes it.

    form = lower(site)                      # static: scale, causal, fill, which operands
    call, after = operands(form, site, values)
    out = kernel(call)                      # [B, Lq, Hq, Dv]
    y = restore(site, out, after)           # the site's output, as the program lays it out

`lower` reads what the logits chain computes (`passes/logits.py`) and refuses, with the reason,
a site no kernel call can reproduce. `operands` brings the values the site reads to canonical
[B, L, H, D] terms: q, k and v through their layouts, each mask and bias operand from the
smallest value the program broadcast it from (a [B, 1, 1, Lk] padding mask stays that small).

Rows whose every logit is -inf are NaN in the naive program (softmax of nothing; after a
`where(mask, p, 0)` only where that mask keeps a key; with a sink only where it is -inf);
kernels return zeros there, so `restore` puts the NaN back: the rewritten program returns
what `jax.jit` of the naive one returns. Gradients through such a row are finite where the
naive program's are NaN. Factors of the probabilities that are constant along the keys (a head
mask) commute with the value dot: `restore` multiplies the kernel's output by them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat
from hlotool.kernels.base import (
    Call,
    Features,
    hiding_is_exact,
    make_call,
    row_has_key,
    score_bound,
    visible_keys,
)
from hlotool.kernels import drawn
from hlotool.kernels.drawn import DrawnMask, dropped_by
from hlotool.passes.attention import Layout, hides_query_rows
from hlotool.passes.axes import reshape_groups
from hlotool.passes.from_jaxpr import JaxprSite, MaskVar
from hlotool.passes.graph import uniform_value
from hlotool.passes.logits import half_ulp
from hlotool.passes.rewrite import RewriteError


@dataclasses.dataclass(frozen=True)
class KernelForm:
    """What a kernel call needs to know about a site before seeing any value.

    scale: C in `where(visible, cap(C·q·kᵀ) + bias, fill)`; causal: hide keys above the
    diagonal; window: (left, right) of a sliding window, or None; fill: the logit of a hidden
    key; softcap: c of cap = c·tanh(x / c), or None; biases: (operand, multiplier), summed
    into the bias; masks: boolean operands, ANDed into the mask; nan_rows: whether rows can be
    all -inf; multipliers: factors of the output (operands brought to [B, Hq, Lq, 1]);
    post_masks: after the softmax, `where(m, p, 0)` operands (ANDed) and dropout's `p * m`
    (kind "dropout", multiplied); sinks: the sink logits' operand, or None.
    """

    scale: float
    causal: bool
    fill: float
    biases: tuple[tuple[MaskVar, float], ...]
    masks: tuple[MaskVar, ...]
    nan_rows: bool
    multipliers: tuple[MaskVar, ...] = ()
    softcap: float | None = None
    post_masks: tuple[MaskVar, ...] = ()
    sinks: MaskVar | None = None
    out_factor: float = 1.0  # a constant the output is multiplied by (`Match.out_factor`)
    window: tuple[int | None, int | None] | None = None
    segments: tuple[MaskVar, MaskVar] | None = None  # (q ids, kv ids) of packed sequences
    query_masks: tuple[MaskVar, ...] = ()  # boolean factors hiding whole query rows (ANDed)
    # Biases read as masks (`Logits.checks`): (F, the add's dtype, |C| before it), and the
    # form computing the site without that reading, for calls `reads_as_mask` rejects (None:
    # no kernel form has it, a bias before a soft-cap say; then the site's own equations).
    checks: tuple[tuple[float, str, float], ...] = ()
    fallback: KernelForm | None = None
    # The program's fill, where a post-softmax where-mask repeating a mask of the logits
    # (`MaskTerm.repeats`) is left out and hidden keys get -inf instead: exact at a call
    # where every row sees a key and keys at this fill weigh below float32 resolution
    # (`reads_as_mask`); else `fallback`, the site as it is.
    hard_fill: float | None = None
    # The band is read from run-time positions as if they were indices (`Logits.positions`):
    # exact at a call where the mask this form reads equals the program's own (`fallback`'s).
    positions: bool = False

    @property
    def checked(self) -> bool:
        """Whether a call must pass `reads_as_mask` to run this form (else `fallback`)."""
        return bool(self.checks) or self.hard_fill is not None or self.positions

    @property
    def features(self) -> Features:
        """What the call asks of a kernel (a site reports one mask kind; its call may combine
        a causal mask with a boolean one)."""
        return Features(causal=self.causal, bias=bool(self.biases), mask=bool(self.masks),
                        finite_fill=math.isfinite(self.fill),
                        softcap=self.softcap is not None,
                        post_mask=any(m.kind == "post" for m in self.post_masks),
                        dropout=any(m.kind == "dropout" for m in self.post_masks),
                        sinks=self.sinks is not None, window=self.window is not None,
                        segments=self.segments is not None,
                        query_padding=bool(self.query_masks))

    @property
    def operand_masks(self) -> tuple[MaskVar, ...]:
        """Every operand of the call but the biases, in a fixed order."""
        return (*self.masks, *self.multipliers, *self.post_masks,
                *(() if self.sinks is None else (self.sinks,)), *(self.segments or ()),
                *self.query_masks)

    def signature(self) -> tuple:
        """Everything `operands` reads from the form, with operand variables left out: equal
        signatures (with equal inputs) give equal kernel calls."""
        def var_free(m: MaskVar) -> tuple:
            return (m.kind, m.at_shape, m.scores_layout, m.keep_when,
                    tuple((n.op, n.shape, n.dtype, repr(sorted(n.params.items())))
                          for n in m.replay), None if m.drawn is None else str(m.drawn),
                    None if m.cone is None else str(m.cone))
        return (self.scale, self.causal, self.window, self.fill, self.nan_rows, self.softcap,
                self.out_factor,
                tuple((var_free(m), mult) for m, mult in self.biases),
                tuple(var_free(m) for m in self.masks),
                tuple(var_free(m) for m in self.multipliers),
                tuple(var_free(m) for m in self.post_masks),
                None if self.sinks is None else var_free(self.sinks), self.checks,
                self.hard_fill, self.positions,
                tuple(var_free(m) for m in self.segments or ()),
                tuple(var_free(m) for m in self.query_masks),
                None if self.fallback is None else self.fallback.signature())


def lower(site: JaxprSite) -> KernelForm:
    """The kernel form of `site`; raises `RewriteError` with the reason when it has none."""
    a = site.site
    if 0 in (a.batch, a.q_len, a.kv_len, a.num_q_heads, a.head_dim, a.v_head_dim):
        raise RewriteError(
            f"zero-length axis (B={a.batch}, Lq={a.q_len}, Lk={a.kv_len}, H={a.num_q_heads}, "
            f"D={a.head_dim}): nothing for a kernel to compute")
    if site.match.unreproduced is not None:
        raise RewriteError(site.match.unreproduced)
    chain = site.match.logits
    if chain.refusal is not None:
        raise RewriteError(chain.refusal)
    form = _form(site, chain)
    if chain.checks or chain.positions:
        # q·k times this stays below half F's ulp for the mask reading to be exact.
        pre = site.scale / chain.scale if chain.scale else 0.0
        checks = tuple((fill, dtype, abs(pre * before)) for fill, dtype, before in chain.checks)
        exact = chain.exact
        fallback = None if exact is None or exact.refusal is not None else _form(site, exact)
        if chain.positions and fallback is None:
            # The check reads the program's mask from the form computing the site as written.
            raise RewriteError(exact.refusal if exact is not None else
                               "its band is read from positions, and the mask as the program "
                               "computes it has no kernel form to check the reading against")
        form = dataclasses.replace(form, checks=checks, fallback=fallback,
                                   positions=chain.positions)
    repeats = {id(m) for t, m in zip(site.match.masks, site.masks) if t.repeats}
    if repeats:
        form = dataclasses.replace(
            form, post_masks=tuple(m for m in form.post_masks if id(m) not in repeats),
            fill=-math.inf, nan_rows=False, hard_fill=form.fill,
            fallback=form.fallback if form.checks else form)
    return form


def _form(site: JaxprSite, chain) -> KernelForm:
    # Terms by where and what they apply (replay rewrites an additive causal into a new term;
    # the factors of an AND mask share their select).
    by_node = {(id(t.at), id(t.operand)): m for t, m in zip(site.match.masks, site.masks)}
    biases = tuple((by_node[id(t.at), id(t.operand)], mult) for t, mult in chain.biases)
    masks = tuple(by_node[id(t.at), id(t.operand)] for t in chain.masks
                  if t.kind == "boolean" and not hides_query_rows(t))
    query_masks = tuple(by_node[id(t.at), id(t.operand)] for t in chain.masks
                        if hides_query_rows(t))
    segments = tuple(by_node[id(t.at), id(t.operand)] for t in chain.masks
                     if t.kind in ("segment_q", "segment_kv"))
    if len(segments) > 2:  # a call compares one pair of ids
        raise RewriteError("the mask compares two pairs of segment ids (packed sequences "
                           "twice); a kernel call takes one")
    # A window can leave a row no key (a query past the keys' end); causal alone cannot.
    hides_rows = bool(biases or masks or chain.window or segments or query_masks)
    form = KernelForm(scale=site.scale, causal=chain.causal, fill=chain.fill, biases=biases,
                      masks=masks, nan_rows=hides_rows and chain.fill == -math.inf,
                      window=chain.window, segments=segments[:2] or None,
                      query_masks=query_masks,
                      multipliers=site.multipliers, softcap=chain.softcap,
                      post_masks=tuple(m for m in site.masks if m.kind in ("post", "dropout")),
                      sinks=next((m for m in site.masks if m.kind == "sinks"), None),
                      out_factor=site.match.out_factor)
    for m in (*(b for b, _ in form.biases), *form.operand_masks):
        if m.var is None:
            raise RewriteError(f"the {m.kind} operand is computed inside a call the site only "
                               "partly covers")
    return form


def reads_as_mask(form: KernelForm, call: Call, exact: Call | None = None) -> jax.Array:
    """bool scalar: whether every bias `form` reads as a mask (`KernelForm.checks`), the
    -inf fill it gives in place of a repeated post-softmax mask (`KernelForm.hard_fill`),
    and a band read from positions (`KernelForm.positions`) compute what the program does at
    this call, outputs and gradients:
      - its hidden keys get exactly F: |C·q·k| ≤ C·max‖q‖·max‖k‖ (Cauchy-Schwarz, with room
        for the program's own rounding of q·k) stays below half of F's ulp, so s + F rounds
        to F; false on non-finite inputs, which the additive form handles as the program does;
      - every row sees a key: in a row whose keys are all hidden the softmax is uniform both
        ways, but autodiff of s + F passes that row's gradient on to q and k, where a mask
        passes none;
      - the keys each query sees are the keys it sees in `exact`, the call of `fallback`,
        which reads the program's own mask: where they are, both calls compute the same
        function of q, k and v (one reduction over [B, Hq|1, Lq, Lk], which XLA fuses with
        the masks' elementwise ops)."""
    ok = jnp.asarray(True)
    if form.positions:
        mine, theirs = visible_keys(call), visible_keys(exact)
        if mine is None or theirs is None:
            raise ValueError("a band read from positions is checked against a masked call")
        ok = jnp.all(mine == theirs)
    if not (form.checks or form.hard_fill is not None):
        return ok
    bound = score_bound(call)
    ok = ok & jnp.isfinite(bound)
    has_key = row_has_key(call)
    if has_key is not None:
        ok = ok & jnp.all(has_key)
    for fill, dtype, scale in form.checks:
        if fill == -math.inf:
            continue  # s + -inf is -inf for any finite s
        ok = ok & (2.0 * scale * bound < half_ulp(fill, dtype))
    if form.hard_fill is not None:
        # The post mask zeroes what keys at the fill add to the output, not what they add
        # to the normalizer: nothing representable when they weigh below resolution.
        ok = ok & hiding_is_exact(dataclasses.replace(call, fill=form.hard_fill), -math.inf)
    return ok


@dataclasses.dataclass(frozen=True)
class After:
    """What `restore` applies to a kernel's output: the rows the naive program has NaN in
    (bool [B|1, Hq|1, Lq, 1]) and the factors of the probabilities ([B|1, Hq|1, Lq|1, 1])."""

    nan_rows: jax.Array | None = None
    factors: tuple[jax.Array, ...] = ()


def operands(form: KernelForm, site: JaxprSite, values: Mapping[Any, jax.Array],
             direct: bool = False) -> tuple[Call, After]:
    """The kernel call for `site` given the values it reads, and what `restore` applies to
    its output.

    direct: read the float operands (biases, sinks, head masks) from what the site's
    equations read (`MaskVar.direct`), not from the program's operand before its broadcast:
    the same values, but a derivative of the call with respect to the site's own inputs
    (a train step's, `backward.differentiated`) then reaches them."""
    def operand(m: MaskVar) -> jax.Array:
        if direct and m.direct is not None and m.direct is not m.var:
            return scores_operand(m, values[m.var], values[m.direct])
        return scores_operand(m, values[m.var])

    # In the dtype the program's dots compute in (`AttentionSite.dtype`): the casts between
    # each operand and its dot keep every value (`attention._trace`), so these are the
    # values the dots read.
    q, k, v = (o.layout.to_canonical(values[o.var]).astype(site.site.dtype)
               for o in (site.q, site.k, site.v))
    bias = mask = None
    for m, mult in form.biases:
        x = operand(m).astype(jnp.float32) * mult
        bias = x if bias is None else bias + x
    mask = _all_of(form.masks, values)
    weights = _drawn(form, values)
    post = None
    if weights is None:
        post = _all_of(tuple(m for m in form.post_masks if m.kind == "post"), values)
        weights = _post_weights(form.post_masks, post, values)
    sinks = None if form.sinks is None else operand(form.sinks)
    # A head mask (or a constant) multiplies the output: in f32, so that its gradient (a sum
    # of dO·out over B·Lq·Dv terms) is not computed from an output already rounded to bf16
    # or f16.
    factors = tuple(operand(m) for m in form.multipliers)
    if form.out_factor != 1.0:
        factors += (jnp.full((1, 1, 1, 1), form.out_factor, jnp.float32),)
    segment_ids = None
    if form.segments is not None:  # [B|1, 1, Lq, 1] and [B|1, 1, 1, Lk] as [B, L]
        b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        q_ids, kv_ids = (scores_operand(m, values[m.var]) for m in form.segments)
        segment_ids = (jnp.broadcast_to(q_ids[:, :1, :, :1], (b, 1, lq, 1))[:, 0, :, 0],
                       jnp.broadcast_to(kv_ids[:, :1, :1, :], (b, 1, 1, lk))[:, 0, 0, :])
    query_mask = _all_of(form.query_masks, values)  # [B|1, 1, Lq, 1]
    if query_mask is not None:
        query_mask = query_mask[:, 0, :, 0]
    call = make_call(q, k, v, scale=form.scale, bias=bias, mask=mask, causal=form.causal,
                     window=form.window, segment_ids=segment_ids, query_mask=query_mask,
                     fill=form.fill, softcap=form.softcap, post_mask=weights,
                     sinks=None if sinks is None else sinks.astype(jnp.float32),
                     out_dtype="float32" if factors else None)
    if not form.nan_rows:
        return call, After(factors=factors)
    if call.bias is None:  # O(L) where the mask allows (`row_has_key`)
        has = row_has_key(call)
        if has is None:  # every row sees a key
            return call, After(factors=factors)
        empty = ~has
    else:
        live = visible_keys(call)
        finite = call.bias > -jnp.inf
        live = finite if live is None else live & finite
        empty = ~jnp.any(live, axis=-1, keepdims=True)
    if post is not None:  # where(m, NaN, 0) is NaN only where m keeps the key
        empty = empty & jnp.any(post, axis=-1, keepdims=True)
    if call.sinks is not None:  # a finite sink is a logit the row always has
        empty = empty & (call.sinks == -jnp.inf)
    return call, After(empty, factors)


def drawing(form: KernelForm) -> tuple[MaskVar | None, str | None]:
    """The post-softmax operand a kernel that draws (`AttentionKernel.draws`) computes tile
    by tile: one drawn operand (`MaskVar.drawn`, dropout's keep mask), the other boolean
    ones ANDed and read as they are; or None and why it is read whole (None: nothing drawn):
    beside another dropout factor, where the NaN rows of a boolean one need all of it at
    once, or where tiles of random bits cannot be drawn with this jax
    (`kernels.drawn.usable`)."""
    chosen = [m for m in form.post_masks if m.drawn is not None]
    if not chosen:
        return None, None
    m, others = chosen[0], tuple(o for o in form.post_masks if o is not chosen[0])
    if len(chosen) > 1 or any(o.kind != "post" for o in others):
        return None, "beside another factor after the softmax"
    if form.nan_rows and (m.kind == "post" or others):
        return None, "rows the mask may leave empty are found from all of it"
    unusable = drawn.usable()
    return (None, unusable) if unusable is not None else (m, None)


def _drawn(form: KernelForm, values: Mapping[Any, jax.Array]) -> DrawnMask | None:
    m, _ = drawing(form)
    if m is None:
        return None
    others = tuple(o for o in form.post_masks if o is not m)
    return DrawnMask.of(m.drawn, tuple(values[v] for v in m.drawn.invars),
                        jnp.float32 if m.kind == "dropout" else jnp.bool_, m.keep_when,
                        _all_of(others, values))


def _post_weights(post_masks: tuple[MaskVar, ...], keep: jax.Array | None,
                  values: Mapping[Any, jax.Array]) -> jax.Array | None:
    """The kernel's `post_mask`: `keep` (the AND of the boolean ones) alone, or with dropout's
    multipliers their float32 product."""
    dropout = [scores_operand(m, values[m.var]).astype(jnp.float32)
               for m in post_masks if m.kind == "dropout"]
    if not dropout:
        return keep
    out = dropout[0] if keep is None else dropped_by(keep, dropout[0])
    for x in dropout[1:]:
        out = out * x
    return out


def mask_value(m: MaskVar, values: Mapping[Any, jax.Array]) -> jax.Array:
    """The value of `m.var`: read, or computed here from its `cone`'s inputs."""
    if m.cone is None:
        return values[m.var]
    (out,) = jaxcompat.eval_jaxpr(m.cone, (), *(values[v] for v in m.cone.invars))
    return out


def _all_of(masks: tuple[MaskVar, ...], values: Mapping[Any, jax.Array]) -> jax.Array | None:
    """The AND of boolean operands in canonical terms (True = keep), or None without any."""
    out = None
    for m in masks:
        x = scores_operand(m, mask_value(m, values))
        x = x if m.keep_when else ~x
        out = x if out is None else out & x
    return out


def restore(site: JaxprSite, out: jax.Array, after: After) -> jax.Array:
    """A kernel's [B, Lq, Hq, Dv] output as the site's own value: the probabilities' factors
    applied, NaN rows put back, the program's layout and dtype."""
    for factor in after.factors:
        out = out * jnp.swapaxes(factor, 1, 2).astype(out.dtype)
    if after.nan_rows is not None:
        out = jnp.where(jnp.swapaxes(after.nan_rows, 1, 2), jnp.nan, out)
    return site.out_layout.from_canonical(out).astype(site.out.aval.dtype)


_COMPARE = {"eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
            "gt": jnp.greater, "ge": jnp.greater_equal}


def scores_operand(m: MaskVar, x: jax.Array, direct: jax.Array | None = None) -> jax.Array:
    """A mask or bias operand `x` (the value of `m.var`) as a 4-D [B, Hq, Lq, Lk] operand with
    1 on every axis the program broadcast: `m.replay` is redone without materializing the
    broadcasts, then `m.scores_layout` maps it to canonical axes.

    direct: the value of `m.direct` (the replay's result, broadcasts materialized); the
    operand is then its first element along each broadcast axis, the same values."""
    for node in m.replay:
        if node.op == "broadcast":
            compact = [1] * len(node.shape)
            for i, d in enumerate(node.params["dims"]):
                compact[d] = x.shape[i]
            x = x.reshape(compact)
        elif node.op == "transpose":
            x = x.transpose(node.params["perm"])
        elif node.op == "reshape":
            x = jnp.broadcast_to(x, node.inputs[0].shape).reshape(node.shape)
        elif node.op == "compare":  # with a constant (`compares_with_constant`)
            x = _COMPARE[node.params["direction"]](x, uniform_value(node.inputs[1]))
        else:
            x = x.astype(node.dtype)
    if direct is not None:
        x = jax.lax.slice(direct, (0,) * direct.ndim, x.shape)
    rank = len(m.at_shape)
    if x.ndim < rank:
        x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
    return _to_canonical(m.scores_layout, x)


def _to_canonical(layout: Layout, x: jax.Array) -> jax.Array:
    """`layout.to_canonical` for an operand with 1 on broadcast axes; a canonical axis comes
    out 1 where the operand does not vary along it."""
    if tuple(x.shape) == layout.shape:
        return layout.to_canonical(x)
    split = list(layout.split)
    small = [1] * len(split)
    for ga, gb in reshape_groups(layout.shape, layout.split) or ():
        if any(x.shape[a] != 1 for a in ga):
            for j in gb:
                small[j] = split[j]
    x = x.reshape(small).transpose(layout.perm)
    full = [split[p] for p in layout.perm]
    groups = reshape_groups(tuple(full), layout.canonical) or []
    for ga, _ in groups:
        if len({x.shape[a] == 1 for a in ga}) > 1:
            target = list(x.shape)
            for a in ga:
                target[a] = full[a]
            x = jnp.broadcast_to(x, target)
    canonical = [1] * len(layout.canonical)
    for ga, gb in groups:
        (c,) = gb
        canonical[c] = int(np.prod([x.shape[a] for a in ga]))
    return x.reshape(canonical)
