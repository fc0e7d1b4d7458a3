"""The attention pattern, defined once, and the shape-following that checks and describes it.

What is matched is the naive function

    scores = dot_general(q, k)                      # contraction over the head dim
    logits = mask(scores * scale + bias)            # any order, any number of steps,
                                                    # tanh(x / c) * c soft-capping among them
    logits = concat([logits, sinks], keys)          # optional: attention sinks
    logits = logits - stop_gradient(max(logits))    # optional: shifted by the row max
    probs  = exp(logits - max(logits)) / sum(...)   # or exp(logits) / sum(exp(logits))
    probs  = where(mask, probs, 0) * head_mask      # optional, any order
    probs  = probs[..., :Lk]                        # the sink column dropped, if concatenated
    out    = dot_general(probs, v)                  # contraction over the key axis

written below as a `pattern.Pattern`, then `describe` follows axis labels (`passes/axes.py`)
from the dot dimension numbers to check what a structural match cannot: the softmax runs
along the key axis of Q·Kᵀ, and the second contraction is over that same axis. Only then is
it attention. Both front ends (jaxpr, HLO) feed this one definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from hlotool.errors import HlotoolError
from hlotool.passes import axes, exactness, masks
from hlotool.passes.logits import Logits, half_ulp, replay
from hlotool.passes.graph import (
    LAYOUT_OPS,
    RANDOM_OPS,
    Graph,
    Node,
    compares_with_constant,
    covers,
    drawn_from_bits,
    fold,
    fold_exact,
    strip,
    uniform_value,
)
from hlotool.passes.pattern import Alt, Any, Chain, Const, Link, Op, Same, Step, Through
from hlotool.site import CAUSAL, AttentionSite

# An additive constant is read as a causal mask when it is 0 on and below the diagonal and at
# most this above it. Whether it hides those keys outright is the lowering's question
# (`passes/lower.py`): only -inf does; any finite value stays in the program as a bias.
LARGE_NEGATIVE = -1e4
# `s + F` reads as the mask F only where |s| stays under half F's ulp (`_bias_as_mask`): worth
# reading so only when that holds for any logit real models reach (finfo.min in float32:
# 1e31; -1e9 in float32: 32, which fails at once; in bfloat16: 2^20).
LOGIT_BOUND = 1e4


def _fill(v: float) -> bool:
    # Any constant: where(mask, s, -5) is still softmax attention, with a soft mask the
    # lowering passes on exactly. NaN and +inf fills make every row NaN.
    return not math.isnan(v) and v != math.inf


SCORES = Op("dot_general", Any(), Any(), name="scores")

LOGITS = Chain(
    SCORES,
    Step("scale", "mul", chain_at=(0, 1), sides=(Const(),)),
    Step("scale", "div", chain_at=(0,), sides=(Const(lambda v: v != 0),)),
    Step("softcap", "tanh", chain_at=(0,), sides=()),  # between the two scales of c·tanh(x/c)
    # x - stop_gradient(max(x)) before a softmax that shifts again (GPT-OSS): a no-op there,
    # which `describe` checks (the max is x's own, over the keys, and nothing but casts follow)
    Step("shift", "sub", chain_at=(0,), sides=(Through(Op("reduce_max", Any("shifted"),
                                                          name="shift_max")),)),
    Step("bias", "add", chain_at=(0, 1), sides=(Any(),)),
    Step("bias", "sub", chain_at=(0,), sides=(Any(),)),
    Step("mask", "select", chain_at=(1, 2), sides=(Any(), Const(_fill))),
    Step("sinks", "concatenate", chain_at=(0,), sides=(Any(),)),  # one more logit column
    record="logits_path",
    name="logits",
)


# softmax(logits) along one axis; the axis is checked by `describe`.
_ROW_MAX = Op("reduce_max", Same("logits"), name="row_max")
_SHIFT = Through(Alt(  # jax.nn.softmax writes max(reduce_max(x), -inf)
    _ROW_MAX, Op("max", _ROW_MAX, Const(lambda v: v == -math.inf), commutative=True)))
_EXP = Op("exp", Alt(Op("sub", LOGITS, _SHIFT), LOGITS), name="exp")
_ROW_SUM = Through(Op("reduce_sum", Same("exp"), name="row_sum"))
# A copy between exp and its uses: jax's remat writes no-op reduce_precision ops (which the
# front ends read as copies) on the values a checkpoint policy saves.
_EXP_VALUE = Through(_EXP, frozenset({"copy"}))
SOFTMAX = Alt(
    Op("div", _EXP_VALUE, _ROW_SUM, name="probs"),  # e / sum(e)
    Op("mul", _EXP_VALUE, Through(Op("div", Const(lambda v: v == 1.0), _ROW_SUM)),
       commutative=True, name="probs"),  # e * (1 / sum(e))
)

# After the softmax: layout ops, multiplications by values constant along the keys (a
# head mask, `einsum("...hqk,h->...hqk", p, head_mask)` included: the front ends read a dot
# that contracts nothing as the product it is) or by dropout's keep / keep_prob, divisions
# by a constant (Keras' dropout: `where(keep, p / keep_prob, 0)`), `where(mask, p, 0)`
# (Keras' masked softmax) and the slice dropping a sink column. A factor constant along the
# keys commutes with the value dot, so the kernel's output takes it; `describe` checks it
# does not vary along them.
PROBS = Chain(SOFTMAX,
              Step("post", "mul", chain_at=(0, 1), sides=(Any(),)),
              Step("post", "div", chain_at=(0,), sides=(Const(lambda v: v != 0),)),
              Step("post_mask", "select", chain_at=(1, 2),
                   sides=(Any(), Const(lambda v: v == 0))),
              Step("drop_sinks", "slice", chain_at=(0,), sides=()),
              record="probs_path")

ATTENTION = Op("dot_general", PROBS, Any("v"), commutative=True, name="out")


# ----------------------------------------------------------------------------------------
# What a match describes


@dataclasses.dataclass(frozen=True)
class Layout:
    """How an array of `shape` maps to canonical axes:
    `x.reshape(split).transpose(perm).reshape(canonical)`.

    `roles` names each of the array's axes (B batch, H heads, G query-head group, L query
    length, K key length, D head dim, E value head dim, 1 a unit axis) after `split`, which
    separates an axis that merges batch and heads ([B*H, L, D] → "BHLD").
    """

    shape: tuple[int, ...]
    roles: str
    split: tuple[int, ...]
    perm: tuple[int, ...]
    canonical: tuple[int, ...]

    def to_canonical(self, x):
        return x.reshape(self.split).transpose(self.perm).reshape(self.canonical)

    def from_canonical(self, y):
        permuted = tuple(self.split[p] for p in self.perm)
        return y.reshape(permuted).transpose(tuple(np.argsort(self.perm))).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class Operand:
    """q, k or v as it enters the site, before the layout ops and pre-scaling it goes
    through on the way to the dot."""

    node: Node
    layout: Layout  # to [B, L, H, D] (v: [B, Lk, Hkv, Dv])


@dataclasses.dataclass(frozen=True)
class MaskTerm:
    """One mask or bias step on the scores.

    kind "causal": built from constants alone and equal to tril (query i sees keys ≤ i), as a
    select (`via` "mask") or as an additive constant (`via` "bias": 0 on and below the
    diagonal, `fill` the largest value above it). kind "window": the same for any band,
    query i sees keys i - left ≤ j ≤ i + right (`window` = (left, right), None for an
    unbounded side): sliding windows, causal aligned elsewhere than top-left. kind
    "additive": `scores + sign * operand`.
    kind "boolean": `where(operand == keep_when, scores, fill)`. Three kinds act beside the
    logits: "post", `where(operand == keep_when, probs, 0)` after the softmax, "dropout",
    `probs * operand` (a scaled boolean: `from_bits`), and "sinks",
    the operand concatenated as one more logit column (its K axis is 1). `operand` is the node
    as the program holds it (None for a causal select); `scores_layout` maps
    `broadcast_to(operand, scores_layout.shape)` to [B, Hq, Lq, Lk]. That shape is the `at`
    node's, or for one factor of an AND mask (`where(a & b, s, fill)`: one term per factor)
    the factor's own.
    """

    kind: str
    at: Node  # the select/add/sub node applying it
    operand: Node | None
    shape: tuple[int, ...]  # operand as broadcast in scores_layout.shape (1 where constant)
    scores_layout: Layout
    sign: float = 1.0
    fill: float | None = None
    keep_when: bool = True
    key_lengths: Node | None = None  # where `operand` is iota(key) < lengths[..., None]
    via: str = "mask"  # "mask" (a select) or "bias" (an add/sub)
    window: masks.Window | None = None  # kind "window": (left, right)
    # Read from an additive select(m, 0, F) (`_bias_as_mask`): hidden keys get s + F, which
    # is F when |s| is below half F's ulp; `lower` checks that at run time.
    rounds_to_fill: bool = False
    # kind "post": its mask is one a select of the logits hid keys with (Keras' masked
    # softmax), so it only zeroes keys already hidden: where every row sees a key and the
    # fill leaves hidden keys no weight, a no-op; `lower` checks that at run time.
    repeats: bool = False
    # A factor of a mask one of whose factors is a band read from positions the program
    # computes at run time, as if each were its index (`masks.Hypothesis`: the `gemma`
    # library's sliding window): exact only where the program's mask equals the factors'
    # reading, which `lower` checks at run time (else the mask as the program computes it,
    # its "exact_mask" term).
    from_positions: bool = False


@dataclasses.dataclass(frozen=True)
class Multiplier:
    """A factor of the probabilities that is constant along the keys (a head mask):
    `softmax(s) * operand`, with `broadcast_to(operand, at.shape)` mapped to [B, Hq, Lq, 1]
    by `scores_layout`."""

    at: Node  # the mul node
    operand: Node
    shape: tuple[int, ...]  # operand as broadcast against the probabilities (1 where constant)
    scores_layout: Layout


@dataclasses.dataclass(frozen=True)
class LogitStep:
    """One step from the scores to the softmax input, in program order.

    kind "scale": `x * value` or `x / value` (`op`); "softcap": a tanh; "cast": a convert to
    `dtype`; "mask" /
    "bias": the `term` applied. `dtype` is the step's result dtype: the lowering replays the
    fill through the steps after it in these dtypes, as the program computes it.
    """

    kind: str
    dtype: str
    op: str = ""
    value: float | None = None
    term: MaskTerm | None = None


@dataclasses.dataclass(frozen=True)
class Match:
    """A checked attention site, front-end neutral."""

    site: AttentionSite
    q: Operand
    k: Operand
    v: Operand
    out: Node  # the second dot_general
    out_layout: Layout  # [B, Lq, Hq, Dv] ↔ `out`
    scale: float
    masks: tuple[MaskTerm, ...]  # in the order the program applies them
    steps: tuple[LogitStep, ...]  # scores → softmax input, program order
    logits: Logits  # what those steps compute, in kernel terms (or why nothing)
    multipliers: tuple[Multiplier, ...]  # factors of the probabilities, program order
    body: tuple[Node, ...]  # every node computing the site from q/k/v/masks to `out`
    internals: dict[str, Node]  # scores, logits, row_max, exp, row_sum, probs
    region: tuple = ()  # the matched graph's path (jaxpr body path, HLO computation name)
    # The product of the constants the probabilities are multiplied (or divided) by, which
    # the output takes instead: dropout's 1 / keep_prob where Keras divides p by it.
    out_factor: float = 1.0
    # Why a kernel call would not reproduce every node of `body` (`passes/exactness.py`),
    # or None: the site is attention, and stays native.
    unreproduced: str | None = None


def find(graph: Graph, function: str = "") -> list[Match]:
    """Every attention site in `graph`, in program order of its output contraction."""
    found = []
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for root in graph.anchors("dot_general"):
        for m in ATTENTION.match(root, {}):
            match = describe(m, position, function)
            if isinstance(match, Match):
                found.append(dataclasses.replace(match, region=graph.path))
                break
    return found


def rejection(graph: Graph, out: Node) -> str | None:
    """Why the dot `out` is no attention though the pattern's structure matches it: the
    first rule the best candidate breaks; None when the structure does not match at all."""
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for m in ATTENTION.match(out, {}):
        why = describe(m, position)
        if isinstance(why, str):
            return why
    return None


# ----------------------------------------------------------------------------------------
# Shape following


class _Reject(Exception):
    """The structure matched but shapes say it is not attention; the message says why."""


def describe(m: dict, position: dict[int, int], function: str = "") -> Match | str:
    """Check a structural match along its axes and describe it; or, when it is not attention,
    the first rule it breaks.

    `position` maps id(node) to its index in program order.
    """
    try:
        return _describe(m, position, function)
    except _Reject as why:
        return str(why)
    except (ArithmeticError, LookupError, ValueError, TypeError) as e:
        out = m["out"]
        raise HlotoolError(
            f"attention detection failed at {out.op} {out.dtype}{list(out.shape)} "
            f"({out.source or out.ref}): {type(e).__name__}: {e}") from e


def _operand_labels(node: Node, batch: tuple[int, ...], contract: tuple[int, ...],
                    free_kind: str) -> axes.Labels:
    out = []
    for a in range(len(node.shape)):
        if a in batch:
            out.append(frozenset({("b", batch.index(a))}))
        elif a in contract:
            out.append(frozenset({("c", contract.index(a))}))
        else:
            # Unit free axes are labelled too: a decode step's single query (Lq = 1), or a
            # single key (Lk = 1), is still the length axis the softmax and masks refer to.
            out.append(frozenset({(free_kind, a)}))
    return tuple(out)


def _dot_output_labels(dot: Node, left: axes.Labels, right: axes.Labels) -> axes.Labels:
    p = dot.params
    out = [left[a] for a in p["lhs_batch"]]
    out += [left[a] for a in range(len(left)) if a not in p["lhs_batch"] + p["lhs_contract"]]
    out += [right[a] for a in range(len(right))
            if a not in p["rhs_batch"] + p["rhs_contract"]]
    return tuple(out)


def _follow(path: tuple[Link | Node, ...], labels: axes.Labels) -> axes.Labels:
    """Labels at the top of a matched path (recorded top-down) from those at its bottom."""
    for step in reversed(path):
        node, layout = ((step.node, step.kind == "layout") if isinstance(step, Link)
                        else (step, True))
        labels = axes.forward(node, labels) if layout else labels
        if labels is None or len(labels) != len(node.shape):
            raise _Reject(f"a {node.op} the axis labels cannot follow")
    return labels


@dataclasses.dataclass(frozen=True)
class _KeyAxis:
    """Which operand of the scores dot is K, as the softmax's axis says, with the axis labels
    (`passes/axes.py`) of the scores dot's operands, its output and the softmax input."""

    score_labels: axes.Labels
    logits_labels: axes.Labels  # the softmax input, [B, H, Lq, Lk] in any layout
    key_tokens: frozenset  # the key axis's one token
    qside: str  # which operand of the scores dot is Q: "l" or "r"
    kside: str
    q_node: Node
    k_node: Node
    q_labels: axes.Labels
    k_labels: axes.Labels

    @property
    def key_token(self) -> tuple:
        (token,) = self.key_tokens
        return token


@dataclasses.dataclass(frozen=True)
class _ValueDot:
    """The second dot, labelled from the key axis it contracts."""

    probs_labels: axes.Labels  # the probabilities as the dot reads them
    v_node: Node
    v_labels: axes.Labels
    out_labels: axes.Labels


@dataclasses.dataclass(frozen=True)
class _Operands:
    """q, k and v where the kernel reads them, and the constant factors `_trace` took off
    them on the way to the dots."""

    roles: _Roles
    q: Operand
    k: Operand
    v: Operand
    out_layout: Layout
    q_scale: float
    k_scale: float
    v_scale: float


@dataclasses.dataclass(frozen=True)
class _Labelled:
    """A structural match once its key axis and its axes' roles are known: what the handlers
    of the steps around the softmax read."""

    m: dict
    position: dict[int, int]
    keys: _KeyAxis
    roles: _Roles

    @property
    def scores(self) -> Node:
        return self.m["scores"]


@dataclasses.dataclass
class _LogitsRead:
    """The steps from the scores to the softmax input, read in program order."""

    scale: float  # q's and k's constant factors times those of the scale steps
    steps: list[LogitStep] = dataclasses.field(default_factory=list)
    # The terms of the mask and bias steps.
    masks: list[MaskTerm] = dataclasses.field(default_factory=list)
    # Terms acting beside the logits: the sink column, a bias read as a mask as the bias it
    # is ("exact_bias"), and a mask read with a band from positions as the dense mask it is
    # ("exact_mask").
    beside: list[MaskTerm] = dataclasses.field(default_factory=list)
    # (predicate, (keep_when, layout)) of each select hiding logits: a mask after the softmax
    # that repeats one of them only zeroes keys already hidden.
    selects: list[tuple[Node, tuple[bool, Layout]]] = dataclasses.field(default_factory=list)
    # Each step whose terms are a reading a run-time check guards (a bias read as a mask,
    # a mask read with a band from positions), as the program writes it; its terms share
    # the step's `at` node.
    exact_steps: list[LogitStep] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _ProbsRead:
    """The steps from the softmax to the value dot, read in program order."""

    out_factor: float  # the constant the output is scaled by instead of the probabilities
    multipliers: list[Multiplier] = dataclasses.field(default_factory=list)
    beside: list[MaskTerm] = dataclasses.field(default_factory=list)  # "post" and "dropout"
    drawn_keep: set[int] = dataclasses.field(default_factory=set)  # post masks drawn from bits


def _describe(m: dict, position: dict[int, int], function: str) -> Match:
    """`describe` of a structural match, raising `_Reject` at the first rule it breaks: the
    checks run in the order below, which decides the one `rejection` reports."""
    keys = _key_axis(m, position)
    value_dot = _value_dot(m, keys)
    operands = _operands(m, position, keys, value_dot)
    labelled = _Labelled(m, position, keys, operands.roles)
    logits = _read_logits(labelled, operands.q_scale * operands.k_scale)
    sinks = next((t for t in logits.beside if t.kind == "sinks"), None)
    probs = _read_probs(labelled, logits.selects, sinks, operands.v_scale)
    reported_scale = _reported_scale(m, operands, logits.scale)
    chain, logit_masks, beside = _logits_chain(logits)
    beside += probs.beside
    site = _attention_site(m, function, operands, reported_scale, chain, logit_masks, beside,
                           probs)
    stops, shifts = _site_bounds(m, operands)
    return Match(
        site=site, q=operands.q, k=operands.k, v=operands.v,
        out=m["out"], out_layout=operands.out_layout, scale=logits.scale,
        masks=tuple(logit_masks + beside), steps=tuple(logits.steps), logits=chain,
        multipliers=tuple(probs.multipliers), body=_body(m["out"], stops),
        internals={name: m[name] for name in ("scores", "logits", "row_max", "exp", "row_sum",
                                              "probs") if name in m},
        out_factor=probs.out_factor,
        unreproduced=exactness.refusal(m["out"], stops, shifts, site.dtype),
    )


def _key_axis(m: dict, position: dict[int, int]) -> _KeyAxis:
    """The softmax's axis is the key axis, and it decides which scores dot operand is K.

    Follows the scores dot's labels up the logits chain to the softmax input ([B, H, Lq, Lk]
    in any layout) and checks that the softmax's sum (and row max) reduce one free axis of
    one dot operand and nothing else, that K has no other free axis, and that no bias or mask
    on the way is computed from the scores themselves."""
    scores = m["scores"]
    dn = scores.params
    left = _operand_labels(scores.inputs[0], dn["lhs_batch"], dn["lhs_contract"], "l")
    right = _operand_labels(scores.inputs[1], dn["rhs_batch"], dn["rhs_contract"], "r")
    score_labels = _dot_output_labels(scores, left, right)
    logits_links = m["logits_path"]
    logits_labels = _follow(logits_links, score_labels)
    reduced = set(m["row_sum"].params["axes"])
    key_tokens = frozenset().union(*(logits_labels[a] for a in reduced))
    if "row_max" in m:
        # The max may read the logits in another layout (jax.nn.dot_product_attention).
        max_in = _labels_on_chain(m["row_max"].inputs[0], scores, score_labels, logits_links)
        if frozenset().union(*(max_in[a] for a in m["row_max"].params["axes"])) != key_tokens:
            raise _Reject("the row max runs over other axes than the softmax's sum")
    for link in logits_links:
        if link.kind != "shift" and any(_depends_on(side, scores, position)
                                        for side in link.sides):
            raise _Reject("a bias or mask computed from the scores themselves")
    kinds = {t[0] for t in key_tokens}
    if len(key_tokens) != 1 or kinds not in ({"l"}, {"r"}):
        raise _Reject("the softmax does not run over one free axis of one dot operand (the "
                      "key axis)")
    kside = kinds.pop()
    k_at = 0 if kside == "l" else 1
    k_node, q_node = scores.inputs[k_at], scores.inputs[1 - k_at]
    k_labels, q_labels = (left, right) if kside == "l" else (right, left)
    k_free = {t for a, lab in enumerate(k_labels) for t in lab
              if t[0] == kside and (k_node.shape[a] != 1 or t in key_tokens)}
    if k_free != key_tokens:
        raise _Reject("K has a free axis the softmax does not run over")
    if any(logits_labels[a] != key_tokens for a in reduced if m["exp"].shape[a] != 1):
        raise _Reject("the softmax's sum merges the key axis with another")
    return _KeyAxis(score_labels, logits_labels, key_tokens, "r" if kside == "l" else "l",
                    kside, q_node, k_node, q_labels, k_labels)


def _value_dot(m: dict, keys: _KeyAxis) -> _ValueDot:
    """The second contraction is over the key axis, and only over it.

    Follows the softmax input's labels down to the probabilities the value dot reads, checks
    what it contracts, and labels V ([B, Lk, Hkv, Dv] in any layout: its contracted and batch
    axes take the probabilities' labels, its other axes are the value head dim) and the
    output ([B, Lq, Hq, Dv]) from them."""
    out, probs_links = m["out"], m["probs_path"]
    probs_labels = _follow(probs_links, keys.logits_labels)
    p_top = probs_links[0].node if probs_links else m["probs"]
    p_at = 0 if out.inputs[0] is p_top else 1
    od = out.params
    p_batch, p_contract = ((od["lhs_batch"], od["lhs_contract"]) if p_at == 0
                           else (od["rhs_batch"], od["rhs_contract"]))
    v_batch, v_contract = ((od["rhs_batch"], od["rhs_contract"]) if p_at == 0
                           else (od["lhs_batch"], od["lhs_contract"]))
    if {t for a in p_contract for t in probs_labels[a]} != keys.key_tokens:
        raise _Reject("the second dot does not contract the key axis the softmax runs over")
    if any(keys.key_token in probs_labels[a] for a in range(len(probs_labels))
           if a not in p_contract):
        raise _Reject("the key axis survives the second dot")
    v_node = out.inputs[1 - p_at]
    v_labels = []
    for a in range(len(v_node.shape)):
        if a in v_contract:
            v_labels.append(probs_labels[p_contract[v_contract.index(a)]])
        elif a in v_batch:
            v_labels.append(probs_labels[p_batch[v_batch.index(a)]])
        elif v_node.shape[a] == 1:
            v_labels.append(axes.EMPTY)
        else:
            v_labels.append(frozenset({("dv", a)}))
    p_free = [a for a in range(len(probs_labels)) if a not in p_batch + p_contract]
    v_free = [a for a in range(len(v_labels)) if a not in v_batch + v_contract]
    if p_at == 0:
        out_labels = tuple([probs_labels[a] for a in p_batch] + [probs_labels[a] for a in p_free]
                           + [v_labels[a] for a in v_free])
    else:
        out_labels = tuple([v_labels[a] for a in v_batch] + [v_labels[a] for a in v_free]
                           + [probs_labels[a] for a in p_free])
    return _ValueDot(probs_labels, v_node, tuple(v_labels), out_labels)


def _operands(m: dict, position: dict[int, int], keys: _KeyAxis, value_dot: _ValueDot
              ) -> _Operands:
    """q, k and v traced back to where the site starts (`_trace`), their axes named from Q's
    (`_query_axes`: which batch axis holds the heads, which free axis the query length), and
    checked to line up as attention: q [B, Lq, Hq, D], k [B, Lk, Hkv, D] and
    v [B, Lk, Hkv, Dv], with Hq a multiple of Hkv.

    A value a bias or mask of the site is computed from is where its operand starts (ViTDet's
    relative-position bias reads q with its heads folded into the batch): walking past it
    would put an input of the site inside it. The others then keep the batch axes it keeps
    whole (a site of B·H batch rows and one head)."""
    qside = keys.qside
    sides = [side for link in (*m["logits_path"], *m["probs_path"]) for side in link.sides]

    beside: dict[int, bool] = {}  # by node id: the passes below walk the same chains again

    def read_beside(node: Node) -> bool:  # a row max reads q through the scores: not beside
        if id(node) not in beside:
            beside[id(node)] = any(_depends_on(side, node, position, avoiding=m["scores"])
                                   for side in sides)
        return beside[id(node)]

    whole: frozenset = frozenset()
    while True:  # until no operand holds whole a batch token another one splits
        q_entry, q_entry_labels, q_scale = _trace(keys.q_node, keys.q_labels, qside, None,
                                                  read_beside, whole)
        qlen_token, head_token, parts = _query_axes(q_entry, q_entry_labels, qside)
        kept = whole - {head_token}  # K and V split Q's heads where they repeat them (GQA)
        k_entry, k_entry_labels, k_scale = _trace(keys.k_node, keys.k_labels, qside,
                                                  head_token, read_beside, kept)
        v_entry, v_entry_labels, v_scale = _trace(value_dot.v_node, value_dot.v_labels, qside,
                                                  head_token, read_beside, kept)
        held = _whole_batch(q_entry_labels) | _whole_batch(k_entry_labels) | _whole_batch(
            v_entry_labels)
        if held <= whole:
            break
        whole = whole | held
    roles = _Roles(qside, keys.kside, qlen_token, head_token, parts)
    q_layout = roles.layout(q_entry.shape, q_entry_labels, "BLHD")
    k_layout = roles.layout(k_entry.shape, k_entry_labels, "BKHD")
    v_layout = roles.layout(v_entry.shape, v_entry_labels, "BKHE")
    out_layout = roles.layout(m["out"].shape, value_dot.out_labels, "BLHE")
    b, _, hq, d = q_layout.canonical
    bk, lk, hkv, dk = k_layout.canonical
    bv, lv, hv, _ = v_layout.canonical
    if (bk, dk) != (b, d) or (bv, lv, hv) != (b, lk, hkv) or hkv == 0 or hq % hkv:
        raise _Reject(f"q [B={b}, H={hq}, D={d}], k [B={bk}, L={lk}, H={hkv}, D={dk}] and v "
                      f"[B={bv}, L={lv}, H={hv}] do not line up as attention")
    return _Operands(roles, Operand(q_entry, q_layout), Operand(k_entry, k_layout),
                     Operand(v_entry, v_layout), out_layout, q_scale, k_scale, v_scale)


def _read_logits(labelled: _Labelled, scale: float) -> _LogitsRead:
    """The steps between the scores and the softmax, each read by its kind's handler in
    program order, from the scores' `scale` (q's and k's constant factors).

    After a sink column only layout ops and a shift by the row max follow, and after that
    shift only layout ops."""
    links = labelled.m["logits_path"]
    read = _LogitsRead(scale)
    # The one bias of a chain with no mask before it (a mask's fill plus F would be another
    # hidden logit) may read as a mask.
    biases, masked = sum(link.kind == "bias" for link in links), False
    last = None  # "sinks" or "shift" once one is seen
    for at, link in reversed(list(enumerate(links))):  # program order
        node = link.node
        if last is not None and link.kind != "layout" and (last, link.kind) != ("sinks",
                                                                                "shift"):
            where = ("the sink column is concatenated" if last == "sinks"
                     else "the logits are shifted by their row max")
            raise _Reject(f"a {link.kind} step after {where}")
        if link.kind == "sinks":
            read.beside.append(_sinks_term(labelled, link, links[at + 1:]))
            last = "sinks"
        elif link.kind == "shift":
            _check_shift(labelled, link)
            last = "shift"
        elif link.kind == "softcap":
            read.steps.append(LogitStep("softcap", node.dtype))
        elif link.kind == "scale":
            value = uniform_value(link.sides[0])
            read.scale = read.scale * value if node.op == "mul" else read.scale / value
            read.steps.append(LogitStep("scale", node.dtype, node.op, value))
        elif link.kind in ("bias", "mask"):
            _read_mask_step(labelled, link, links[at + 1:], read,
                            may_read_as_mask=link.kind == "bias" and biases == 1 and not masked)
            masked = masked or link.kind == "mask"
        elif node.op in ("convert", "reduce_precision"):
            read.steps.append(LogitStep("cast", node.dtype))
    return read


def _sinks_term(labelled: _Labelled, link: Link, below: tuple[Link, ...]) -> MaskTerm:
    """The logit column a concatenate adds along the keys (attention sinks): exactly one
    column, not computed from the scores, and the same for every query (its operand
    broadcasts to [B, H, 1, 1] in "BHQK" terms). `below`: the logits chain's links before
    it."""
    node, side = link.node, link.sides[0]
    labels = _follow(below, labelled.keys.score_labels)
    axis = node.params.get("axis")
    if axis is None or labels[axis] != labelled.keys.key_tokens or side.shape[axis] != 1:
        raise _Reject("a concatenate between the scores and the softmax that adds "
                      "other than one logit column along the keys")
    if _depends_on(side, labelled.scores, labelled.position):
        raise _Reject("sink logits computed from the scores themselves")
    term = MaskTerm("sinks", node, side, _broadcast_shape(side, len(node.shape)),
                    labelled.roles.layout(node.shape, labels, "BHLK"))
    if "Q" in (_varying_axes([term]) or ""):
        raise _Reject("sink logits that vary along the queries")
    return term


def _check_shift(labelled: _Labelled, link: Link) -> None:
    """`x - stop_gradient(max(x))` is a no-op before a softmax that shifts again only where
    the max is over x's own keys: x is what the step subtracts from, read through layout ops
    only, and the max reduces the key axis of the labels it carries there."""
    m, keys = labelled.m, labelled.keys
    shifted, row_max = m["shifted"], m["shift_max"]
    labels_in = _labels_on_chain(shifted, labelled.scores, keys.score_labels, m["logits_path"])
    if (strip(shifted, LAYOUT_OPS) is not strip(link.node.inputs[0], LAYOUT_OPS)
            or frozenset().union(*(labels_in[a] for a in row_max.params["axes"]))
            != keys.key_tokens):
        raise _Reject("the logits are shifted by a max over other axes than the keys")


def _read_mask_step(labelled: _Labelled, link: Link, below: tuple[Link, ...],
                    read: _LogitsRead, may_read_as_mask: bool) -> None:
    """A bias or mask step on the logits, as its terms in the scores' [B, H, Lq, Lk] space:
    one per factor of an AND mask (`_conjuncts`), else the step's own (`_mask_term`); a bias
    that `may_read_as_mask` as the mask it almost is (`_bias_as_mask`), keeping it as the
    bias it is for where that reading fails. `below`: the logits chain's links before it."""
    node, roles = link.node, labelled.roles
    labels = _follow(below, labelled.keys.score_labels)
    read_as_mask = (_bias_as_mask(link, labels, roles, labelled.position, labelled.scores)
                    if may_read_as_mask else None)
    if link.kind == "mask":
        read.selects.append((link.sides[0], (link.chain_input == 1,
                                             roles.layout(node.shape, labels, "BHLK"))))
    if read_as_mask:
        exact = _mask_term(link, labels, roles)
        read.beside.append(dataclasses.replace(exact, kind="exact_bias"))
        read.exact_steps.append(LogitStep("bias", node.dtype, term=exact))
        for term in read_as_mask:
            read.masks.append(term)
            read.steps.append(LogitStep("mask", node.dtype, term=term))
        return
    terms = (_conjuncts(link, labels, roles, labelled.position, labelled.scores)
             or [_mask_term(link, labels, roles)])
    if any(t.from_positions for t in terms):
        exact = _mask_term(link, labels, roles)  # the program's own mask, dense
        read.beside.append(dataclasses.replace(exact, kind="exact_mask"))
        read.exact_steps.append(LogitStep("mask", node.dtype, term=exact))
    for term in terms:
        read.masks.append(term)
        read.steps.append(LogitStep(link.kind, node.dtype, term=term))


def _read_probs(labelled: _Labelled, selects: list[tuple[Node, tuple[bool, Layout]]],
                sinks: MaskTerm | None, v_scale: float) -> _ProbsRead:
    """The steps between the softmax and the value dot, each read by its kind's handler in
    program order, from the output's scale `v_scale` (a constant V is scaled by, as when
    dequantizing a fake-quantized V, scales the output alike).

    Where a sink column was concatenated (`sinks`), the probabilities change only after its
    slice drops it, and it must be dropped."""
    links = labelled.m["probs_path"]
    read = _ProbsRead(v_scale)
    dropped = False
    for at, link in reversed(list(enumerate(links))):
        if link.kind == "drop_sinks":
            _check_sink_slice(link.node, _follow(links[at + 1:], labelled.keys.logits_labels),
                              labelled.keys.key_tokens, sinks)
            dropped = True
            continue
        if link.kind in ("post", "post_mask") and sinks is not None and not dropped:
            raise _Reject("the probabilities are changed before the sink column is dropped")
        if link.kind == "post_mask":
            _read_post_mask(labelled, link, links[at + 1:], selects, read)
        elif link.kind == "post":
            _read_post_factor(labelled, link, links[at + 1:], read)
    if sinks is not None and not dropped:
        raise _Reject("the sink column's probability is not dropped before the value dot")
    return read


def _read_post_mask(labelled: _Labelled, link: Link, below: tuple[Link, ...],
                    selects: list[tuple[Node, tuple[bool, Layout]]], read: _ProbsRead) -> None:
    """`where(mask, p, 0)` after the softmax, as a "post" term in the probabilities'
    [B, H, Lq, Lk] space: its mask not computed from the scores; drawn from random bits it
    is Keras' dropout (`select(keep, p / keep_prob, 0)`); one of the `selects` on the logits
    again, it only repeats them. `below`: the probabilities' links before it."""
    pred = link.sides[0]
    if _depends_on(pred, labelled.scores, labelled.position):
        raise _Reject("a where(mask, p, 0) after the softmax whose mask is computed "
                      "from the scores")
    labels = _follow(below, labelled.keys.logits_labels)
    if drawn_from_bits(pred):
        read.drawn_keep.add(id(link.node))
    layout, keep_when = (labelled.roles.layout(link.node.shape, labels, "BHLK"),
                         link.chain_input == 1)
    read.beside.append(MaskTerm("post", link.node, pred,
                                _broadcast_shape(pred, len(link.node.shape)), layout,
                                keep_when=keep_when,
                                repeats=any(_same_value(pred, p) and (keep_when, layout) == k
                                            for p, k in selects)))


def _read_post_factor(labelled: _Labelled, link: Link, below: tuple[Link, ...],
                      read: _ProbsRead) -> None:
    """`p * factor` or `p / constant` after the softmax, not computed from the
    probabilities: a nonzero finite constant the output takes instead; a factor varying
    along the keys only as dropout's scaled boolean (a "dropout" term); any other, constant
    along the keys ([B, H, Lq, 1] in the probabilities' space), a `Multiplier`. `below`: the
    probabilities' links before it."""
    node, (factor,) = link.node, link.sides
    if _depends_on(factor, labelled.scores, labelled.position):
        raise _Reject("the probabilities are multiplied by a value computed from them")
    constant = uniform_value(factor)
    if constant is not None:
        if node.op == "div":
            constant = 1.0 / constant
        if not (math.isfinite(constant) and constant != 0.0):
            raise _Reject(f"a scale by {constant:g} after the softmax (the output is not "
                          "the probabilities' weighted values scaled by it)")
        read.out_factor *= constant  # 1.0 (an all-ones head mask) leaves it as it is
        return
    labels = _follow(below, labelled.keys.logits_labels)
    shape = _broadcast_shape(factor, len(node.shape))
    if any(labelled.keys.key_token in labels[a] and n != 1 for a, n in enumerate(shape)):
        if not from_bits(factor):
            raise _Reject("the probabilities are multiplied by a tensor that varies along "
                          "the keys and is not a scaled boolean (dropout's keep / keep_prob)")
        read.beside.append(MaskTerm("dropout", node, factor, shape,
                                    labelled.roles.layout(node.shape, labels, "BHLK")))
        return
    layout = labelled.roles.layout(node.shape, labels, "BHLK")
    if _varies_along_folded_batch(layout, shape):
        raise _Reject("the probabilities are multiplied by a factor varying along heads "
                      "folded into the batch axis, whose order there is not tracked")
    read.multipliers.append(Multiplier(node, factor, shape, layout))


def _varies_along_folded_batch(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether a factor of broadcast `shape` varies along a batch axis that the layout folds
    together with another one (heads merged into the batch, [B·H, L, D]): the soundness fuzz
    found such a head mask mapped h-major where the program folds b-major."""
    batch = [j for j, (role, n) in enumerate(zip(layout.roles, layout.split))
             if role in "B1" and n > 1]
    if len(batch) < 2:
        return False
    return any(any(shape[a] != 1 for a in ga) and set(gb) & set(batch)
               for ga, gb in axes.reshape_groups(layout.shape, layout.split) or ())


def _reported_scale(m: dict, operands: _Operands, scale: float) -> float | None:
    """What the scores are effectively scaled by, None where nothing scales them: `scale`
    and also constant factors q or k took before the reshape that split their heads (GPT-Neo
    multiplies q by √d, and flax then divides by it). The kernel reads q and k after that
    reshape, so only the report counts them."""
    before_split = (_scale_before_split(operands.q.node)
                    * _scale_before_split(operands.k.node))
    has_scale = (operands.q_scale != 1.0 or operands.k_scale != 1.0 or before_split != 1.0
                 or any(link.kind == "scale" for link in m["logits_path"]))
    return scale * before_split if has_scale else None


def _logits_chain(read: _LogitsRead) -> tuple[Logits, list[MaskTerm], list[MaskTerm]]:
    """What the logits steps compute in kernel terms (`replay`), the terms on the logits as
    that reading makes them (an additive causal constant that does not end -inf is an
    additive bias), and the terms beside the logits.

    Where a bias was read as a mask, or a mask with a band from positions, and that reading
    fails (replay refuses it, or lower's run-time check), the chain as the program writes
    it: the bias in place of the mask, the dense mask in place of its factors."""
    chain = replay(read.steps)
    masks, beside = read.masks, read.beside
    if read.exact_steps:
        exact = replay(_as_written(read.steps, read.exact_steps))
        if chain.refusal is not None:
            chain = exact
        elif chain.checks or chain.positions:
            chain = dataclasses.replace(chain, exact=exact)
        if chain is exact:
            written = {id(step.term.at) for step in read.exact_steps}
            masks = ([t for t in masks if id(t.at) not in written]
                     + [step.term for step in read.exact_steps])
            beside = [t for t in beside if t.kind not in ("exact_bias", "exact_mask")]
    if chain.refusal is None:
        masks = [t for t, _ in chain.biases] + list(chain.masks)
    return chain, list(masks), list(beside)


def _as_written(steps: list[LogitStep], exact_steps: list[LogitStep]) -> list[LogitStep]:
    """`steps` with the terms of each checked reading (those applied at one of
    `exact_steps`' nodes) replaced by that step as the program writes it, once."""
    exact = {id(step.term.at): step for step in exact_steps}
    written, placed = [], set()
    for t in steps:
        at = id(t.term.at) if t.term is not None else None
        if at in exact:
            if at not in placed:
                written.append(exact[at])
            placed.add(at)
            continue
        written.append(t)
    return written


def _attention_site(m: dict, function: str, operands: _Operands, scale: float | None,
                    chain: Logits, logit_masks: list[MaskTerm], beside: list[MaskTerm],
                    probs: _ProbsRead) -> AttentionSite:
    """The site as reported: sizes from the canonical layouts ([B, Lq, Hq, D] of q,
    [B, Lk, Hkv, D] of k, Dv of v), the mask kind the logits' terms (`logit_masks`) or the
    chain's band make it, and the terms `beside` the logits."""
    scores, out = m["scores"], m["out"]
    b, lq, hq, d = operands.q.layout.canonical
    _, lk, hkv, _ = operands.k.layout.canonical
    dv = operands.v.layout.canonical[3]
    rows = {id(t) for t in logit_masks if hides_query_rows(t)}
    kinds = [t.kind for t in logit_masks if id(t) not in rows]
    masks = [t for t in logit_masks + beside if id(t) not in rows]
    kind = next((k for k in ("additive", "boolean", "causal") if k in kinds), "none")
    window = chain.window if chain.refusal is None else None
    if kind == "none" and window is not None:
        kind = "causal" if chain.causal else "local"
    reported = next((t for t in masks if t.kind == kind), None)
    drawn_keep = probs.drawn_keep
    return AttentionSite(
        batch=b, q_len=lq, kv_len=lk, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        v_head_dim=dv, dtype=_compute_dtype(*scores.inputs, *out.inputs), scale=scale,
        mask=kind, causal=chain.refusal is None and chain.causal,  # kind "causal" sets it too
        mask_shape=reported.shape if reported is not None and kind in ("additive", "boolean")
        else None,
        mask_fill=chain.fill if chain.refusal is None and chain.masks else None,
        mask_axes=_varying_axes([t for t in masks if t.kind in ("additive", "boolean")]),
        multiplier_shape=probs.multipliers[0].shape if probs.multipliers else None,
        softcap=chain.softcap,
        post_mask=any(t.kind == "post" and id(t.at) not in drawn_keep and not t.repeats
                      for t in beside),
        dropout=any(t.kind == "dropout" or id(t.at) in drawn_keep for t in beside),
        out_scale=None if probs.out_factor == 1.0 else probs.out_factor,
        sinks=any(t.kind == "sinks" for t in beside), window=window,
        band_from_positions=chain.refusal is None and chain.positions,
        segments=any(t.kind == "segment_q" for t in masks), query_padding=bool(rows),
        q_shape=operands.q.node.shape, k_shape=operands.k.node.shape,
        v_shape=operands.v.node.shape, layout=operands.q.layout.roles,
        softmax_dtype=m["exp"].dtype, function=function, source=scores.source or out.source,
    )


def _site_bounds(m: dict, operands: _Operands) -> tuple[set[int], set[int]]:
    """(ids of the nodes the site's body stops at: its operands; ids of the subtractions whose
    second operand only shifts the softmax: exp(x - max(x)), and x - stop_gradient(max(x))
    before it)."""
    logits_links, probs_links = m["logits_path"], m["probs_path"]
    stops = {id(o.node) for o in (operands.q, operands.k, operands.v)}
    # A shift's row max is computed from the logits: part of the site, not an operand.
    stops |= {id(s) for link in (*logits_links, *probs_links) if link.kind != "shift"
              for s in link.sides}
    shifts = {id(link.node) for link in logits_links if link.kind == "shift"}
    if "row_max" in m:
        shifts.add(id(m["exp"].inputs[0]))
    return stops, shifts


def _compute_dtype(*dotted: Node) -> str:
    """The dtype the program's dots compute in, which a kernel computes in too: the one
    their operands share, else the narrowest float dtype holding all of them (q in
    bfloat16 against k and v in float32 is a float32 program; so is a bfloat16 program
    whose probabilities, computed in float32, multiply v in float32)."""
    dtypes = {n.dtype for n in dotted}
    if len(dtypes) == 1:
        return dtypes.pop()
    for candidate in (*sorted(dtypes), "float32", "float64"):
        if all(covers(candidate, d) for d in dtypes):
            return candidate
    return sorted(dtypes)[0]


def _same_value(a: Node, b: Node, budget: int = 256) -> bool:
    """Whether `a` and `b` hold the same array: one node, or the same deterministic op
    (op, params, shape, dtype) of the same values, down to equal constants and iotas
    (jnp.where broadcasts and negates its mask anew at each call, and a causal mask may be
    built twice). False past `budget` pairs of nodes compared."""
    seen, stack = set(), [(a, b)]
    while stack:
        x, y = stack.pop()
        if x is y or (id(x), id(y)) in seen:
            continue
        seen.add((id(x), id(y)))
        if (len(seen) > budget or x.op in RANDOM_OPS or x.op == "parameter"
                or (x.op, x.shape, x.dtype, len(x.inputs)) != (y.op, y.shape, y.dtype,
                                                               len(y.inputs))
                or repr(sorted(x.params.items())) != repr(sorted(y.params.items()))):
            return False
        if not x.inputs:  # a constant or an iota: the same where their values are
            vx, vy = fold(x), fold(y)
            if vx is None or vy is None or not np.array_equal(vx, vy):
                return False
        stack.extend(zip(x.inputs, y.inputs))
    return True


def from_bits(factor: Node) -> bool:
    """Whether `factor` is a boolean scaled by constants (`keep.astype(p.dtype) / keep_prob`):
    dropout's multiplier, through which no gradient flows (the kernels pass it none)."""
    node = factor
    while True:
        if node.dtype == "bool":
            return True
        if node.op in ("convert", "copy", "broadcast", "reshape", "transpose"):
            node = node.inputs[0]
        elif node.op in ("mul", "div") and uniform_value(node.inputs[1]) is not None:
            node = node.inputs[0]
        elif node.op == "mul" and uniform_value(node.inputs[0]) is not None:
            node = node.inputs[1]
        elif node.op == "select" and node.inputs[0].dtype == "bool" and all(
                uniform_value(x) is not None for x in node.inputs[1:]):
            return True
        else:
            return False


def hides_query_rows(term: MaskTerm) -> bool:
    """Whether `term` is a boolean factor of the mask varying along the queries and at most
    the batch (query padding): it hides whole query rows, so a kernel can take it as a
    per-row flag instead of an [Lq, Lk] mask."""
    return term.kind == "boolean" and _varying_axes([term]) in ("Q", "BQ")


def _varying_axes(terms: list[MaskTerm]) -> str | None:
    """The canonical axes ("BHQK" order) along which any of `terms`' operands vary."""
    if not terms:
        return None
    found = set()
    for t in terms:
        layout = t.scores_layout
        for ga, gb in axes.reshape_groups(layout.shape, layout.split) or ():
            if any(t.shape[a] != 1 for a in ga):
                found.update(layout.roles[j] for j in gb)
    letters = {"B": "B", "H": "H", "G": "H", "L": "Q", "K": "K"}
    return "".join(c for c in "BHQK" if c in {letters.get(r, "") for r in found})


def _check_sink_slice(node: Node, labels: axes.Labels, key_tokens: frozenset,
                      sinks: MaskTerm | None) -> None:
    """A slice after the softmax must drop exactly the concatenated sink column (the last
    along the keys) and keep everything else."""
    if sinks is None:
        raise _Reject("a slice after the softmax")
    start, limit = node.params.get("start"), node.params.get("limit")
    strides = node.params.get("strides") or (1,) * len(node.shape)
    full = node.inputs[0].shape
    keys = [a for a, lab in enumerate(labels) if lab == key_tokens]
    if (start is None or len(start) != len(full) or len(keys) != 1
            or any(st != 1 for st in strides)
            or any((b, e) != (0, full[a] - (a == keys[0]))
                   for a, (b, e) in enumerate(zip(start, limit)))):
        raise _Reject("the slice after the softmax keeps other than the keys before the sink "
                      "column")


def _labels_on_chain(node: Node, scores: Node, score_labels: axes.Labels,
                     links: tuple[Link, ...]) -> axes.Labels:
    """Labels of a node reached from the logits chain through layout ops only."""
    known = {id(scores): score_labels}
    labels = score_labels
    for link in reversed(links):
        labels = axes.forward(link.node, labels) if link.kind == "layout" else labels
        known[id(link.node)] = labels
    above = []
    while id(node) not in known:
        if node.op not in LAYOUT_OPS or not node.inputs:
            raise _Reject(f"the row max reads the logits through a {node.op}")
        above.append(node)
        node = node.inputs[0]
    return _follow(tuple(above), known[id(node)])


def _depends_on(node: Node, target: Node, position: dict[int, int],
                avoiding: Node | None = None) -> bool:
    """True if `node` is computed from `target` (nodes defined before it cannot be), by a
    path that does not pass through `avoiding`."""
    start = position.get(id(target), -1)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if id(n) in seen or n is avoiding or position.get(id(n), -1) <= start:
            continue
        seen.add(id(n))
        stack.extend(n.inputs)
    return False


def _whole_batch(labels: axes.Labels) -> frozenset:
    """The batch tokens of the scores dot that `labels` hold unsplit (no part of them)."""
    tokens = frozenset().union(*labels)
    return frozenset(t for t in tokens if t[0] == "b"
                     and not any(axes.is_part(u) and u[1] == t for u in tokens))


def _trace(node: Node, labels: axes.Labels, qside: str, head_token,
           read_beside: Callable[[Node], bool] = lambda node: False,
           whole: frozenset = frozenset()) -> tuple[Node, axes.Labels, float]:
    """Follow an operand back through casts, transposes, head repeats and constant scaling.

    Stops at the first op that changes more than layout: a reshape that splits or merges a
    length or head-dim axis, a broadcast of anything but heads (GQA/MQA K and V), or a
    `tile`-ordered head repeat (query head h would not use kv head h // group); at a value
    the site also reads elsewhere (`read_beside`), and before a reshape splitting one of the
    batch tokens Q holds `whole`.
    """
    scale = 1.0
    before_reshape = None
    while not read_beside(node):
        op = node.op
        # Only casts that keep every value: the kernel reads the operand where this walk
        # stops, so a stop_gradient, a reduce_precision or a narrowing cast (fake
        # quantization, a bfloat16 round trip) stays in the program, before the kernel.
        if op == "copy" or (op == "convert" and covers(node.dtype, node.inputs[0].dtype)):
            step = (labels, [])
        elif op == "transpose":
            step = axes.backward(node, labels)
        elif op == "reshape":
            step = axes.backward(node, labels)
            if step is None or not _reshape_keeps_axes(node, labels, qside) or any(
                    axes.part_of(label, t) is not None for label in step[0] for t in whole):
                break
            if (_query_length_axes(node.shape, labels, qside)
                    and not _query_length_axes(node.inputs[0].shape, step[0], qside)):
                # Blocked local attention (LongT5): the sequence split into blocks of
                # queries, the block index a batch axis. Before the split no axis is the
                # query length alone, so the site is the batch of blocks this reshape made.
                break
            before_reshape = (node, labels, scale)
        elif op == "broadcast" and head_token is not None:
            step = axes.backward(node, labels)
            repeat = step and _head_repeat(node, labels, step[1], head_token)
            if repeat == "tile" and before_reshape is not None:
                return before_reshape  # the heads as tiled, before they were merged
            if repeat != "repeat":
                break
        elif op in ("mul", "div") and len(node.inputs) == 2:
            at = _scaled_operand(node)
            if at is None:
                break
            value = uniform_value(node.inputs[1 - at])
            scale = scale * value if op == "mul" else scale / value
            node = node.inputs[at]
            continue
        else:
            break
        labels = step[0]
        node = node.inputs[0]
    return node, labels, scale


def _scale_before_split(node: Node) -> float:
    """The product of constant scalings below `node` through layout ops (the reshape where
    `_trace` stopped, and casts): 1.0 when there are none."""
    factor = 1.0
    while True:
        if node.op in ("reshape", "transpose", "convert", "copy") and node.inputs:
            node = node.inputs[0]
            continue
        at = _scaled_operand(node) if node.op in ("mul", "div") and len(node.inputs) == 2 \
            else None
        if at is None:
            return factor
        value = uniform_value(node.inputs[1 - at])
        factor = factor * value if node.op == "mul" else factor / value
        node = node.inputs[at]


def _scaled_operand(node: Node) -> int | None:
    """Operand index scaled by a constant in a mul/div, or None."""
    candidates = (0, 1) if node.op == "mul" else (0,)
    for at in candidates:
        other = node.inputs[1 - at]
        if other.size <= 1 or other.op in ("broadcast", "constant"):
            value = uniform_value(other)
            if value is not None and value != 0 and uniform_value(node.inputs[at]) is None:
                return at
    return None


def _query_length_axes(shape: tuple[int, ...], labels: axes.Labels, qside: str) -> list[int]:
    """Axes of size > 1 that hold query-side free tokens and nothing else."""
    return [a for a, (n, lab) in enumerate(zip(shape, labels))
            if n != 1 and lab and all(t[0] == qside for t in lab)]


def _reshape_keeps_axes(node: Node, labels: axes.Labels, qside: str) -> bool:
    groups = axes.reshape_groups(node.inputs[0].shape, node.shape)
    for ga, gb in groups or ():
        if len(ga) == 1 and len(gb) == 1:
            continue
        tokens = axes.without_parts(frozenset().union(*(labels[j] for j in gb)))
        if any(t[0] not in ("b", qside) for t in tokens):
            return False
        if sum(t[0] == qside for t in tokens) > 1:
            return False
    return groups is not None


def _head_repeat(node: Node, labels: axes.Labels, created: list[tuple[int, frozenset]],
                 head_token) -> str | None:
    """"repeat" for a broadcast that only repeats heads kv-head-major (`jnp.repeat`),
    "tile" when the copies come first (`jnp.tile`), None for any other broadcast."""
    if any(lab and axes.without_parts(lab) != {head_token} for _, lab in created):
        return None
    dims = node.params["dims"]
    kept = [d for i, d in enumerate(dims)
            if node.inputs[0].shape[i] != 1 and head_token in labels[d]]
    new = [d for d, lab in created if lab and d not in dims]
    return "repeat" if all(d > k for d in new for k in kept) else "tile"


def _query_axes(entry: Node, labels: axes.Labels, qside: str):
    """(query-length token, heads token, batch parts) from Q's own layout.

    The length is the first pure free axis of Q; other free axes are query-head groups
    (GQA written 5-D). The heads axis is the last batch axis shared with K when there are
    several, or the only one when it comes after the length ([L, H, D]). A batch token that
    Q spreads over several axes (a dot over [B*H, L, D]) is split into those axes' roles:
    `parts[token]` lists (role, size) of Q's axes carrying it, in order.
    """
    pure = [(a, lab) for a, lab in enumerate(labels) if lab and all(t[0] == qside for t in lab)]
    # The first non-unit one; a unit one only when Q has no other (one query: Lq = 1).
    pure_free = [(a, lab) for a, lab in pure if entry.shape[a] != 1] or pure[:1]
    if not pure_free or len(pure_free[0][1]) != 1:
        raise _Reject("Q has no query-length axis of its own")
    len_axis, (qlen_token,) = pure_free[0]
    batch_axes = [a for a, lab in enumerate(labels) if any(t[0] == "b" for t in lab)]
    head_axis = None
    if len(batch_axes) >= 2 or (batch_axes and batch_axes[0] > len_axis):
        head_axis = batch_axes[-1]
    head_token = None
    if head_axis is not None:
        tokens = [t for t in labels[head_axis] if t[0] == "b"]
        if len(tokens) != 1:
            raise _Reject("Q's head axis merges several batch axes of the dot")
        head_token = tokens[0]
    found: dict[tuple, list[tuple[int, str, int]]] = {}
    for a in batch_axes:
        for t in labels[a]:
            if t[0] == "b":
                piece = axes.part_of(labels[a], t)
                found.setdefault(t, []).append((a if piece is None else piece,
                                                "H" if a == head_axis else "B",
                                                entry.shape[a]))
    # Pieces of a split batch token in split order (outer first), whatever Q's axis order.
    parts = {t: [(role, n) for _, role, n in sorted(pieces)] for t, pieces in found.items()}
    return qlen_token, head_token, parts


@dataclasses.dataclass(frozen=True)
class _Roles:
    """Names the axes of the site's arrays once Q has fixed which token is what."""

    qside: str
    kside: str
    qlen: tuple
    head: tuple | None
    parts: dict

    def role(self, token) -> str:
        kind = token[0]
        if kind == "b":
            return self.parts[token][0][0] if token in self.parts else "B"
        if kind == self.qside:
            return "L" if token == self.qlen else "G"
        if kind == self.kside:
            return "K"
        return "D" if kind == "c" else "E"

    def _axes(self, shape: tuple[int, ...], labels: axes.Labels) -> list[tuple[int, str, tuple]]:
        """(size, role, sort key) per axis, splitting an axis that merges Q's batch parts."""
        out = []
        for a, (n, lab) in enumerate(zip(shape, labels)):
            if not lab:
                if n != 1:
                    raise _Reject(f"an axis of size {n} that no dot axis explains")
                out.append((1, "1", ()))
                continue
            base = axes.without_parts(lab)
            split = [t for t in base if len(self.parts.get(t, ())) > 1]
            if split:
                (t,) = split if len(split) == 1 and len(base) == 1 else (None,)
                if t is None:
                    raise _Reject("an axis merging Q's batch parts with other axes")
                carriers = [b for b, other in enumerate(labels) if t in other]
                parts = self.parts[t]
                piece = axes.part_of(lab, t)
                if len(carriers) == len(parts) and piece is not None and piece < len(parts):
                    out.append((n, parts[piece][0], (t, piece)))
                elif len(carriers) == 1 and n == int(np.prod([m for _, m in parts])):
                    out.extend((m, role, (t, i)) for i, (role, m) in enumerate(parts))
                else:
                    raise _Reject("batch and heads are split differently from Q")
                continue
            lab = base
            found = {self.role(t) for t in lab}
            if found <= {"H", "G"}:
                role = "H" if "H" in found else "G"
            elif len(found) == 1:
                role = found.pop()
            else:
                raise _Reject(f"an axis that merges {' and '.join(sorted(found))}")
            out.append((n, role, (min(lab), -1)))  # sorts beside a split axis's (token, piece)
        return out

    def layout(self, shape: tuple[int, ...], labels: axes.Labels, order: str) -> Layout:
        """Layout of an array whose axes carry `labels`, to canonical `order` (e.g. "BLHD")."""
        virtual = self._axes(shape, labels)
        group_of = {"1": "B", "G": "H"}

        def group(role: str) -> int:
            g = group_of.get(role, role)
            if g not in order:
                raise _Reject(f"an axis of role {role} where {order} is expected")
            return order.index(g)

        perm = tuple(sorted(range(len(virtual)), key=lambda a: (
            group(virtual[a][1]), virtual[a][1] == "1", virtual[a][1] == "G", virtual[a][2])))
        canonical = tuple(
            int(np.prod([virtual[a][0] for a in perm if group(virtual[a][1]) == i],
                        dtype=np.int64))
            for i in range(len(order)))
        roles = "".join(r for _, r, _ in virtual)
        if "H" not in roles:
            roles = roles.replace("G", "H")  # MQA: the query heads are all group axes
        return Layout(tuple(shape), roles, tuple(n for n, _, _ in virtual), perm, canonical)


def _conjuncts(link: Link, labels: axes.Labels, roles: _Roles, position: dict[int, int],
               scores: Node) -> list[MaskTerm] | None:
    """`where(a & b & ..., s, fill)` (or `where(~(a & b), fill, s)`) as one term per factor,
    when a factor is a causal mask or a window read from its structure (`jnp.tril(...) &
    padding`, gemma's and HF's masks) or segment ids: the kernel then skips blocks for a band,
    compares ids per tile and reads the other factors as they are, small (a key padding mask
    stays [B, 1, 1, Lk]). A band may be read from positions the program computes
    (`MaskTerm.from_positions`), checked per call. None when the mask has no such factor."""
    if link.kind != "mask":
        return None
    pred, fill_node = link.sides
    keep = link.chain_input == 1  # where(~(a & b), fill, s) keeps where a & b
    return _factors(link.node, pred, keep, uniform_value(fill_node), labels, roles, position,
                    scores, need_band=True, lengths=_score_lengths(link.node, labels, roles),
                    positions=True)


def _factors(at: Node, pred: Node, keep: bool, fill: float, labels: axes.Labels,
             roles: _Roles, position: dict[int, int], scores: Node, *, need_band: bool,
             lengths: tuple[int, int] | None, rounds_to_fill: bool = False,
             positions: bool = False) -> list[MaskTerm] | None:
    """The terms of a boolean `pred` (True = `keep`) hiding keys with `fill`, one per factor
    of an AND, seen through layout ops, `not` and `x > 0` of a cast boolean (`labels` are
    `pred`'s). None when a factor depends on the scores, or (`need_band`) none is in kernel
    terms (a band or segment ids). `positions`: a factor comparing run-time positions may be
    read as a band, as if they were indices; every term is then `from_positions`."""
    while pred.op in ("convert", "copy", "broadcast", "reshape", "not", "compare"):
        if pred.op == "convert" and pred.inputs[0].dtype != "bool":
            break  # a cast from a number is the factor itself, x != 0 (Wav2Vec2's int mask)
        if pred.op == "not":
            keep, pred = not keep, pred.inputs[0]
            continue
        if pred.op == "compare":  # flax's combine_masks(...) > 0: a boolean cast to float
            found = _nonzero_of_zero_one(pred, labels)
            if found is None:
                break
            pred, labels = found
            continue
        step = axes.backward(pred, labels) if pred.op != "convert" else (labels, [])
        if step is None:
            return None
        labels, pred = step[0], pred.inputs[0]
    if not keep:
        return None

    leaves, stack = [], [(pred, pred, labels)]
    while stack:
        n, into, at_labels = stack.pop()
        if not _broadcasts_into(n, into):  # jaxpr's `and` broadcasts unit axes of equal rank
            return None
        while n.op in ("convert", "copy") and n.inputs[0].dtype == "bool":
            n = n.inputs[0]  # a cast from a number is the factor itself: x != 0
        found = _nonzero_of_zero_one(n, at_labels) if n.op == "compare" else None
        if found is not None and found[0].shape == n.shape:
            n, at_labels = found  # its own labels: a transpose keeps a square mask's shape
        inner, inner_labels = _and_within(n, at_labels)
        if inner.op == "and":
            stack.extend((x, inner, inner_labels) for x in reversed(inner.inputs))
        elif inner.op == "min":  # of numbers cast from booleans (`_zero_one_sides`)
            stack.extend((x, inner, inner_labels) for x in reversed(_zero_one_sides(inner)))
        else:
            leaves.append((n, at_labels))
    terms, structural, guessed = [], False, False
    for leaf, leaf_labels in leaves:
        if uniform_value(leaf) == 1:  # `ones & mask` (jax.nn.dot_product_attention)
            continue
        qk = _qk_axes(leaf_labels, roles)
        window = None
        if qk is not None and lengths is not None and (
                leaf.shape[qk[0]], leaf.shape[qk[1]]) == lengths:
            found = masks.band(leaf, *qk)
            if found is None:
                found = _folded_band(leaf, qk)
            if found is None and positions and not _depends_on(leaf, scores, position) \
                    and _segments(leaf, roles.layout(leaf.shape, leaf_labels, "BHLK"), at,
                                  fill, rounds_to_fill) is None:
                # Not `q_ids == kv_ids` (segment ids), whose guess would be the diagonal.
                window = masks.window(masks.band(leaf, *qk, positions=True), *lengths)
                guessed = guessed or window is not None
            else:
                window = masks.window(found, *lengths)
        if window is not None:
            structural = True
            kind = "causal" if window == CAUSAL else "window"
            if not any(t.kind == kind and t.window == window for t in terms):
                terms.append(MaskTerm(kind, at, None, (1,) * len(pred.shape),
                                      roles.layout(pred.shape, labels, "BHLK"), fill=fill,
                                      window=None if kind == "causal" else window,
                                      rounds_to_fill=rounds_to_fill))
            continue
        if _depends_on(leaf, scores, position):
            return None
        space = roles.layout(leaf.shape, leaf_labels, "BHLK")
        segments = _segments(leaf, space, at, fill, rounds_to_fill)
        if segments is not None:
            structural = True
            terms += segments
            continue
        terms.append(MaskTerm("boolean", at, leaf, _broadcast_shape(leaf, len(leaf.shape)),
                              space, fill=fill, rounds_to_fill=rounds_to_fill))
    if need_band and not structural:
        return None
    if guessed:
        terms = [dataclasses.replace(t, from_positions=True) for t in terms]
    return terms or None


def _and_within(node: Node, labels: axes.Labels) -> tuple[Node, axes.Labels]:
    """The AND (or `min` of 0/1 numbers) `node` is, seen through layout ops and exact casts
    (a boolean cast to a number and back, `x != 0` of it), with its labels: flax nnx's
    `combine_masks` casts its AND to float and jnp.where casts it back, and the heads
    broadcast comes after. `node` itself when no AND is under it."""
    at, at_labels = node, labels
    while True:
        if at.op in ("convert", "copy") and at.inputs[0].dtype == "bool":
            at = at.inputs[0]
        elif at.op == "convert" and at.dtype == "bool" and (
                source := _zero_one_source(at.inputs[0])) is not None:
            at = source
        elif at.op == "compare" and (found := _nonzero_of_zero_one(at, at_labels)) is not None:
            at, at_labels = found
        elif at.op in ("broadcast", "reshape", "transpose"):
            step = axes.backward(at, at_labels)
            if step is None:
                return node, labels
            at_labels, at = step[0], at.inputs[0]
        elif at.op == "and" or (at.op == "min" and _zero_one_sides(at) is not None):
            return at, at_labels
        else:
            return node, labels


def _zero_one_source(x: Node) -> Node | None:
    """What makes `x` 0 or 1 wherever it is defined: the boolean it was cast from, or a `min`
    of such (`_zero_one_sides`); None for any other value."""
    x = strip(x, ("convert", "copy")) if x.dtype != "bool" else x
    return x if x.dtype == "bool" or (x.op == "min" and _zero_one_sides(x) is not None) else None


def _broadcasts_into(n: Node, into: Node) -> bool:
    """Whether `n` has `into`'s rank and each axis its size or 1."""
    return len(n.shape) == len(into.shape) and all(
        a in (1, b) for a, b in zip(n.shape, into.shape))


def _nonzero_of_zero_one(node: Node, labels: axes.Labels
                         ) -> tuple[Node, axes.Labels] | None:
    """For `x != 0` or `x > 0` of x a number that is 0 or 1 — a boolean b cast to a number,
    or `min(a, b)` of two such (KerasHub merges its padding and causal masks so: nonzero
    exactly where both are) —, seen through layout ops: b, or the `min`, with its labels
    (`labels` are `node`'s). None for any other compare."""
    if node.params.get("direction") not in ("gt", "ne") or uniform_value(node.inputs[1]) != 0:
        return None
    x = node.inputs[0]
    while True:
        if (source := _zero_one_source(x)) is not None:
            return source, labels
        x = strip(x, ("convert", "copy"))
        if x.op not in ("broadcast", "reshape", "transpose"):
            return None
        step = axes.backward(x, labels)
        if step is None:
            return None
        labels, x = step[0], x.inputs[0]


def _zero_one_sides(node: Node) -> tuple[Node, ...] | None:
    """The booleans whose casts to a number a `min` takes, or None when a side may hold
    other values than 0 and 1."""
    sides = tuple(strip(x, ("convert", "copy")) for x in node.inputs)
    return sides if all(x.dtype == "bool" for x in sides) else None


def _segments(leaf: Node, space: Layout, at: Node, fill: float, rounds_to_fill: bool
              ) -> list[MaskTerm] | None:
    """`q_ids[:, :, None] == kv_ids[:, None, :]` (packed sequences) as two terms, "segment_q"
    and "segment_kv", whose operands vary along batch and queries, and batch and keys: the
    kernels compare ids per tile instead of reading an [Lq, Lk] mask. None for another
    leaf."""
    if leaf.op != "compare" or leaf.params.get("direction") != "eq":
        return None
    for sides in (leaf.inputs, leaf.inputs[::-1]):
        terms = []
        for side, kind, along in zip(sides, ("segment_q", "segment_kv"), ("Q", "K")):
            term = MaskTerm(kind, at, side, _broadcast_shape(side, len(leaf.shape)), space,
                            fill=fill, rounds_to_fill=rounds_to_fill)
            varying = _varying_axes([term]) or ""
            if (side.dtype.startswith(("int", "uint")) and along in varying
                    and set(varying) <= {"B", along}):
                terms.append(term)
        if len(terms) == 2:
            return terms
    return None


def _folded_band(leaf: Node, qk: tuple[int, int]) -> masks.Band | None:
    """The band of a constant boolean leaf (a mask computed outside the traced function),
    from its values: the same along every other axis, and True exactly where lo <= j - i <=
    hi."""
    value = fold_exact(leaf)
    if value is None or value.dtype != np.bool_:
        return None
    value = np.broadcast_to(value, leaf.shape)
    plane = value[tuple(slice(None) if a in qk else 0 for a in range(value.ndim))]
    if not np.array_equal(np.broadcast_to(np.expand_dims(plane, tuple(
            a for a in range(value.ndim) if a not in qk)), value.shape), value):
        return None
    if qk[0] > qk[1]:
        plane = plane.T
    if not plane.any():
        return None
    i, j = np.indices(plane.shape)
    lo, hi = int(np.min((j - i)[plane])), int(np.max((j - i)[plane]))
    if not np.array_equal(plane, (j - i >= lo) & (j - i <= hi)):
        return None
    return lo, hi


def _bias_as_mask(link: Link, labels: axes.Labels, roles: _Roles, position: dict[int, int],
                  scores: Node) -> list[MaskTerm] | None:
    """`s + select(m, 0, F)` with F very negative (Hugging Face's and flax's padding and
    causal biases, F = finfo.min) as the mask `where(m, s, F)` it almost is: hidden keys get
    s + F, which is F exactly when |s| is below half of F's ulp. `lower` checks that at run
    time and computes the additive form where it fails. None for any other bias."""
    if link.node.op != "add":
        return None
    lengths = _score_lengths(link.node, labels, roles)
    side = link.sides[0]
    while side.op in ("convert", "copy", "broadcast", "reshape"):
        step = axes.backward(side, labels) if side.op != "convert" else (labels, [])
        if step is None:
            return None
        labels, side = step[0], side.inputs[0]
    if side.op != "select" or side.dtype == "bool":
        return None
    pred, on_true, on_false = side.inputs
    values = uniform_value(on_true), uniform_value(on_false)
    if 0.0 not in values or None in values:
        return None
    fill = values[1] if values[0] == 0.0 else values[0]
    if fill != -math.inf and not (fill <= LARGE_NEGATIVE
                                  and half_ulp(fill, link.node.dtype) >= LOGIT_BOUND):
        return None
    return _factors(link.node, pred, values[0] == 0.0, fill, labels, roles, position, scores,
                    need_band=False, lengths=lengths, rounds_to_fill=True)


def _mask_term(link: Link, labels: axes.Labels, roles: _Roles) -> MaskTerm:
    node = link.node
    scores_layout = roles.layout(node.shape, labels, "BHLK")
    if link.kind == "bias":
        operand = link.sides[0]
        sign = -1.0 if node.op == "sub" else 1.0
        keep_when, fill = True, None
    else:
        operand, fill_node = link.sides
        sign, fill = 1.0, uniform_value(fill_node)
        keep_when = link.chain_input == 1
        operand = _without_ones(operand)
    shape = _broadcast_shape(operand, len(node.shape))
    kind = "additive" if link.kind == "bias" else "boolean"
    structural = _structural_band(operand, node, labels, roles, link.kind, sign, keep_when)
    if structural is not None:  # read from iotas and compares: any length
        window, value = structural
        band_kind = "causal" if window == CAUSAL else "window"
        window = None if band_kind == "causal" else window
        if link.kind == "mask":
            return MaskTerm(band_kind, node, None, shape, scores_layout, fill=fill,
                            window=window)
        return MaskTerm(band_kind, node, operand, shape, scores_layout, sign=sign,
                        fill=value, via="bias", window=window)
    value = fold_exact(operand)
    if value is not None and _is_causal(value, node, labels, roles, link.kind, sign, keep_when):
        if link.kind == "mask":
            return MaskTerm("causal", node, None, shape, scores_layout, fill=fill)
        return MaskTerm("causal", node, operand, shape, scores_layout, sign=sign,
                        fill=_above_diagonal(value, node, labels, roles, sign), via="bias")
    return MaskTerm(kind, node, operand, shape, scores_layout, sign=sign, fill=fill,
                    keep_when=keep_when, key_lengths=_key_lengths(operand, keep_when, labels,
                                                                  roles, node),
                    via=link.kind)


def _without_ones(pred: Node) -> Node:
    """A boolean with the all-True factors of its AND dropped: jax.nn.dot_product_attention
    ANDs its mask into `ones_like(scores)`, which would make a [B, 1, 1, Lk] key padding look
    as if it varied along every axis. An AND whose other factor broadcasts to its shape is that
    factor."""
    while pred.op == "and" and len(pred.inputs) == 2:
        for ones, other in (pred.inputs, pred.inputs[::-1]):
            if uniform_value(ones) == 1 and _broadcasts_into(other, pred):
                pred = other
                break
        else:
            return pred
    return pred


def _structural_band(operand: Node, node: Node, labels: axes.Labels, roles: _Roles,
                     kind: str, sign: float, keep_when: bool
                     ) -> tuple[masks.Window, float] | None:
    """For a band mask read from its structure (`passes/masks.py`): its window and, for an
    additive one, the value it adds outside the band (0.0 for a select, whose fill is known
    already). None when the structure shows no band."""
    qk = _qk_axes(labels, roles)
    if qk is None or not _broadcasts_into(operand, node):
        return None
    lq, lk = node.shape[qk[0]], node.shape[qk[1]]
    if (operand.shape[qk[0]], operand.shape[qk[1]]) != (lq, lk):
        return None  # one row (or column) broadcast: no band (see `_score_lengths`)
    if kind == "mask":
        window = masks.window(masks.band(operand, *qk, hides=not keep_when), lq, lk)
        return None if window is None else (window, 0.0)
    found = masks.band_bias(operand, *qk)
    if found is None or sign * found[1] > LARGE_NEGATIVE:
        return None
    window = masks.window(found[0], lq, lk)
    return None if window is None else (window, sign * found[1])


def _broadcast_shape(operand: Node, rank: int) -> tuple[int, ...]:
    """The operand's shape against `rank` score axes, 1 where it is broadcast."""
    if len(operand.shape) != rank:
        return (1,) * (rank - len(operand.shape)) + operand.shape if operand.size > 1 else (
            (1,) * rank)
    axis_map = list(range(rank))  # current axis -> score axis
    node = operand
    while True:
        if node.op in ("convert", "copy", "stop_gradient") or compares_with_constant(node):
            node = node.inputs[0]
        elif node.op == "broadcast":
            axis_map = [axis_map[d] for d in node.params["dims"]]
            node = node.inputs[0]
        elif node.op == "transpose":  # output axis i is input axis perm[i]
            moved = [-1] * len(axis_map)
            for i, p in enumerate(node.params["perm"]):
                moved[p] = axis_map[i]
            axis_map = moved
            node = node.inputs[0]
        elif node.op == "reshape" and [n for n in node.shape if n != 1] == [
                n for n in node.inputs[0].shape if n != 1]:
            kept = [axis_map[j] for j, n in enumerate(node.shape) if n != 1]
            it = iter(kept)
            axis_map = [next(it) if n != 1 else -1 for n in node.inputs[0].shape]
            node = node.inputs[0]
        else:
            break
    out = [1] * rank
    for a, n in enumerate(node.shape):
        if n != 1 and axis_map[a] >= 0:
            out[axis_map[a]] = n
    return tuple(out)


def _score_lengths(node: Node, labels: axes.Labels, roles: _Roles) -> tuple[int, int] | None:
    """(Lq, Lk) of the scores at `node` (`labels` are its axes'). A mask factor is a band
    only over both whole lengths: a key mask broadcast over the queries is no band of its
    one row, which it once was read as (query i then saw keys up to i + n)."""
    qk = _qk_axes(labels, roles)
    return None if qk is None else (node.shape[qk[0]], node.shape[qk[1]])


def _qk_axes(labels: axes.Labels, roles: _Roles) -> tuple[int, int] | None:
    """Score axes holding exactly the query length and the key length."""
    q_axes = [a for a, lab in enumerate(labels) if roles.qlen in lab]
    k_axes = [a for a, lab in enumerate(labels) if any(t[0] == roles.kside for t in lab)]
    if len(q_axes) != 1 or len(k_axes) != 1 or len(labels[q_axes[0]]) != 1:
        return None
    return q_axes[0], k_axes[0]


def _score_plane(value: np.ndarray, node: Node, labels: axes.Labels, roles: _Roles
                 ) -> np.ndarray | None:
    """The [Lq, Lk] plane of a constant broadcast against the scores at `node`."""
    qk = _qk_axes(labels, roles)
    if qk is None:
        return None
    value = np.broadcast_to(value, node.shape)
    plane = value[tuple(slice(None) if a in qk else 0 for a in range(value.ndim))]
    if plane.ndim != 2:
        return None
    return plane.T if qk[0] > qk[1] else plane


def _above_diagonal(value: np.ndarray, node: Node, labels: axes.Labels, roles: _Roles,
                    sign: float) -> float:
    """The largest value an additive causal constant adds above the diagonal."""
    plane = sign * _score_plane(value, node, labels, roles).astype(np.float64)
    return float(np.max(plane[~np.tril(np.ones(plane.shape, dtype=bool))], initial=-np.inf))


def _is_causal(value: np.ndarray, node: Node, labels: axes.Labels, roles: _Roles,
               kind: str, sign: float, keep_when: bool) -> bool:
    qk = _qk_axes(labels, roles)
    plane = _score_plane(value, node, labels, roles)
    if plane is None:
        return False
    value = np.broadcast_to(value, node.shape)
    if not np.all(value == value[tuple(np.s_[:] if a in qk else np.s_[:1]
                                       for a in range(value.ndim))]):
        return False  # varies along batch or heads
    tril = np.tril(np.ones(plane.shape, dtype=bool))
    if kind == "mask":
        return bool(np.array_equal(plane.astype(bool) == keep_when, tril))
    bias = sign * plane.astype(np.float64)
    return bool(np.all(bias[tril] == 0) and np.all(bias[~tril] <= LARGE_NEGATIVE))


def _key_lengths(operand: Node, keep_when: bool, labels: axes.Labels, roles: _Roles,
                 at: Node) -> Node | None:
    """`lengths` where the keep-mask reads iota(key axis) < lengths (or lengths > iota)."""
    pred = strip(operand, ("convert", "broadcast", "reshape"))
    if not keep_when or pred.op != "compare":
        return None
    direction = pred.params["direction"]
    a, b = pred.inputs
    if direction in ("gt", "ge"):
        a, b = b, a
    elif direction not in ("lt", "le"):
        return None
    iota = strip(a, ("convert", "broadcast", "reshape"))
    qk = _qk_axes(labels, roles)
    if qk is None or iota.op != "iota" or fold(b) is not None:
        return None
    if iota.shape[iota.params["dimension"]] != at.shape[qk[1]]:
        return None
    return strip(b, ("convert", "broadcast", "reshape"))


def _body(out: Node, stops: set[int]) -> tuple[Node, ...]:
    """Nodes between the site's inputs (q/k/v entries, mask operands) and its output."""
    seen: dict[int, Node] = {}
    stack = [out]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen[id(node)] = node
        stack.extend(node.inputs)
    return tuple(seen.values())
