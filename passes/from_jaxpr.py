"""Jaxpr front end: equations → normalized graph, and sites in jaxpr terms for the rewrite.

Call-like equations (`jit`/`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call`,
`checkpoint`/`remat`) are inlined into their caller's graph, so a site may span them.
Bodies of `scan`, `while`, `cond` and `shard_map` are separate regions, matched in place;
their path says where they are (a shard_map body's shapes are per device; its `pvary` casts
are copies).

Paths. A jaxpr nested in the program is addressed by a tuple of steps from the top
ClosedJaxpr; a step is `(eqn_index, param)` with `param` the equation's parameter holding the
sub-jaxpr ("jaxpr", "call_jaxpr", "body_jaxpr", "branches[1]", ...). `jaxpr_at` resolves it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import numpy as np

from hlotool import jaxcompat
from hlotool.errors import HlotoolError
from hlotool.kernels import drawn
from hlotool.passes.attention import Layout, Match, find
from hlotool.passes.near_miss import NearMiss, near_misses
from hlotool.passes.tracing import Manual
from hlotool.passes.graph import (
    MAX_FOLD_ELEMENTS, Graph, Node, as_product, compares_with_constant, rounds_to_itself,
)
from hlotool.site import AttentionSite
from hlotool.source import user_source

Path = tuple[tuple[int, str], ...]

# Primitive -> parameter holding the callee; inlined into the caller's graph.
INLINED = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr",
    "remat": "jaxpr",
}
# Primitive -> parameters holding bodies matched as regions of their own.
REGIONS = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",),
           jaxcompat.SHARD_MAP: ("jaxpr",)}

_RENAMED = {
    "broadcast_in_dim": "broadcast", "convert_element_type": "convert", "squeeze": "reshape",
    "expand_dims": "reshape", "copy_p": "copy",
}
_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


@dataclasses.dataclass
class JaxprRef:
    """Where a node's value is defined (`index` -1: an input of the jaxpr at `path`), and
    the other jaxprs it is visible in under another variable (through inlined calls)."""

    path: Path
    index: int
    var: Any
    aliases: list[tuple[Path, int, Any]] = dataclasses.field(default_factory=list)

    def var_at(self, path: Path) -> Any | None:
        if self.path == path:
            return self.var
        return next((v for p, _, v in self.aliases if p == path), None)


def subjaxpr(eqn: jaxcompat.JaxprEqn, param: str) -> jaxcompat.Jaxpr | jaxcompat.ClosedJaxpr:
    """The sub-jaxpr a path step names: `eqn.params[param]`, or one of `branches[i]`."""
    if param.startswith("branches["):
        return eqn.params["branches"][int(param[9:-1])]
    return eqn.params[param]


def open_subjaxpr(eqn: jaxcompat.JaxprEqn, param: str) -> jaxcompat.Jaxpr:
    """The open jaxpr of the sub-jaxpr a path step names (a closed one without its consts)."""
    sub = subjaxpr(eqn, param)
    return sub.jaxpr if isinstance(sub, jaxcompat.ClosedJaxpr) else sub


def with_subjaxpr(eqn: jaxcompat.JaxprEqn, param: str, inner: jaxcompat.Jaxpr
                  ) -> jaxcompat.JaxprEqn:
    """`eqn` with the open jaxpr a path step names replaced by `inner` (same interface); a
    closed sub-jaxpr keeps its consts."""
    sub = subjaxpr(eqn, param)
    new = sub.replace(jaxpr=inner) if isinstance(sub, jaxcompat.ClosedJaxpr) else inner
    if param.startswith("branches["):
        branches = list(eqn.params["branches"])
        branches[int(param[9:-1])] = new
        return eqn.replace(params={**eqn.params, "branches": tuple(branches)})
    return eqn.replace(params={**eqn.params, param: new})


def jaxpr_at(closed: jaxcompat.ClosedJaxpr, path: Path) -> jaxcompat.Jaxpr:
    """The (open) jaxpr at `path` inside `closed`."""
    jaxpr = closed.jaxpr
    for index, param in path:
        jaxpr = open_subjaxpr(jaxpr.eqns[index], param)
    return jaxpr


def manual_at(closed: jaxcompat.ClosedJaxpr, path: Path) -> Manual | None:
    """The innermost shard_map body on `path`, or None for a site outside every shard_map."""
    where = None
    for depth, (index, _) in enumerate(path):
        eqn = jaxpr_at(closed, path[:depth]).eqns[index]
        if eqn.primitive.name == jaxcompat.SHARD_MAP:
            where = Manual.of(eqn, where)
    return where


def describe_path(closed: jaxcompat.ClosedJaxpr, path: Path) -> str:
    """Where a site sits: "top level", or the enclosing equations, e.g. "scan.jaxpr"."""
    steps = []
    for depth, (index, param) in enumerate(path):
        eqn = jaxpr_at(closed, path[:depth]).eqns[index]
        steps.append(f"{eqn.primitive.name}.{param}")
    return " > ".join(steps) or "top level"


def _source(eqn: jaxcompat.JaxprEqn) -> str:
    frames = jaxcompat.user_frames(eqn.source_info.traceback)
    return user_source((f.file_name, f.start_line) for f in frames)


def _normalize(eqn: jaxcompat.JaxprEqn) -> tuple[str, dict[str, Any], tuple[int, ...] | None]:
    """(op, params, input order) of an equation in the graph vocabulary."""
    prim, p = eqn.primitive.name, eqn.params
    if prim == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        return prim, {"lhs_contract": tuple(lc), "rhs_contract": tuple(rc),
                      "lhs_batch": tuple(lb), "rhs_batch": tuple(rb)}, None
    if prim in ("reduce_max", "reduce_sum"):
        return prim, {"axes": tuple(int(a) for a in p["axes"])}, None
    if prim == "broadcast_in_dim":
        return "broadcast", {"dims": tuple(int(d) for d in p["broadcast_dimensions"])}, None
    if prim == "transpose":
        return prim, {"perm": tuple(int(d) for d in p["permutation"])}, None
    if prim == "reshape" and p.get("dimensions") is not None:
        return "reshape_transposed", {}, None
    if prim == "select_n" and len(eqn.invars) == 3 and eqn.invars[0].aval.dtype == np.bool_:
        return "select", {}, (0, 2, 1)  # select_n(pred, on_false, on_true)
    if prim in _COMPARISONS:
        return "compare", {"direction": prim}, None
    if prim == "iota":
        return prim, {"dimension": int(p["dimension"])}, None
    if prim == "slice":
        return prim, {"start": tuple(p["start_indices"]), "limit": tuple(p["limit_indices"]),
                      "strides": tuple(p["strides"]) if p.get("strides") else None}, None
    if prim == "concatenate":
        return prim, {"axis": int(p["dimension"])}, None
    if prim == "cumsum":
        return prim, {"axis": int(p["axis"]), "reverse": bool(p["reverse"])}, None
    if prim == "integer_pow":
        return prim, {"y": p["y"]}, None
    if prim in jaxcompat.MANUAL_CASTS:
        return "copy", {}, None
    if prim == "reduce_precision" and rounds_to_itself(
            str(eqn.outvars[0].aval.dtype), p["exponent_bits"], p["mantissa_bits"]):
        return "copy", {}, None
    return _RENAMED.get(prim, prim), {}, None


def _invariant_copy(node: Node, graph: Graph, budget: list[int]) -> Node | None:
    """A copy of `node`'s expression (appended to `graph`, without the caller's equation
    references) when it depends on constants and iotas only, else None."""
    budget[0] -= 1
    if budget[0] < 0 or node.op == "parameter":
        return None
    inputs = []
    for n in node.inputs:
        copy = _invariant_copy(n, graph, budget)
        if copy is None:
            return None
        inputs.append(copy)
    copy = dataclasses.replace(node, inputs=tuple(inputs), ref=None)
    graph.nodes.append(copy)
    return copy


class _Builder:
    def __init__(self) -> None:
        self.regions: list[Graph] = []

    def region(self, jaxpr: jaxcompat.Jaxpr, consts: list[Any], path: Path,
               known: dict[Any, Node] | None = None) -> None:
        """`known`: inputs of the body that hold one value on every iteration, computed by
        the caller from constants and iotas alone (a scan's loop-invariant operands: jax's
        AD passes a mask's fill and the mask itself so); the body's graph gets a copy of
        that expression, so a fill reads as the constant it is and a causal mask as its
        iotas, at any length."""
        graph = Graph([], path)
        self.regions.append(graph)
        env: dict[Any, Node] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self._constant(v.aval, c, JaxprRef(path, -1, v), graph)
        for v in jaxpr.invars:
            copy = _invariant_copy(known[v], graph, [64]) if known and v in known else None
            if copy is not None:
                copy.ref = JaxprRef(path, -1, v)
                env[v] = copy
                continue
            env[v] = Node("parameter", (), tuple(v.aval.shape), str(v.aval.dtype),
                          ref=JaxprRef(path, -1, v))
            graph.nodes.append(env[v])
        self._eqns(jaxpr, env, path, graph)

    def _constant(self, aval, value, ref: JaxprRef, graph: Graph) -> Node:
        value = np.asarray(value) if np.size(value) <= MAX_FOLD_ELEMENTS else None
        node = Node("constant", (), tuple(aval.shape), str(aval.dtype), {"value": value},
                    ref=ref)
        graph.nodes.append(node)
        return node

    def _read(self, atom, env, path: Path, index: int, graph: Graph) -> Node:
        if isinstance(atom, jaxcompat.Literal):
            return self._constant(atom.aval, atom.val, JaxprRef(path, index, None), graph)
        return env[atom]

    def _eqns(self, jaxpr: jaxcompat.Jaxpr, env: dict, path: Path, graph: Graph) -> None:
        for index, eqn in enumerate(jaxpr.eqns):
            inputs = [self._read(a, env, path, index, graph) for a in eqn.invars]
            prim = eqn.primitive.name
            if prim in INLINED and INLINED[prim] in eqn.params:
                self._inline(eqn, index, inputs, env, path, graph)
                continue
            if prim in REGIONS:
                for param in REGIONS[prim]:
                    subs = eqn.params[param]
                    named = ([(f"{param}[{j}]", s) for j, s in enumerate(subs)]
                             if isinstance(subs, (tuple, list)) else [(param, subs)])
                    known = None
                    if prim == "scan":
                        groups = jaxcompat.scan_groups(eqn)
                        invariant = groups[0] if groups else 0
                        known = dict(zip(subs.jaxpr.invars[:invariant], inputs))
                    elif prim == jaxcompat.SHARD_MAP:
                        # An operand replicated over the mesh (spec P()) holds the caller's
                        # value on every device.
                        known = {v: n for v, n, part in zip(
                            subs.invars, inputs, eqn.params["in_specs"])
                            if all(p is None for p in part)}
                    for name, sub in named:
                        inner, consts = ((sub.jaxpr, list(sub.consts))
                                         if isinstance(sub, jaxcompat.ClosedJaxpr) else (sub, []))
                        self.region(inner, consts, path + ((index, name),), known)
            op, params, order = _normalize(eqn)
            if order is not None:
                inputs = [inputs[i] for i in order]
            source = functools.partial(_source, eqn)
            for i, v in enumerate(eqn.outvars):
                node = Node(op, tuple(inputs), tuple(v.aval.shape), str(v.aval.dtype),
                            dict(params, index=i) if len(eqn.outvars) > 1 else params,
                            source, JaxprRef(path, index, v))
                product = as_product(node, JaxprRef(path, index, None)) if (
                    op == "dot_general") else None
                graph.nodes.extend(product or [node])
                env[v] = product[-1] if product else node

    def _inline(self, eqn: jaxcompat.JaxprEqn, index: int, inputs: list[Node], env: dict,
                path: Path, graph: Graph) -> None:
        param = INLINED[eqn.primitive.name]
        sub = eqn.params[param]
        inner_path = path + ((index, param),)
        inner, consts = (sub.jaxpr, sub.consts) if isinstance(sub, jaxcompat.ClosedJaxpr) else (
            sub, [])
        inner_env: dict[Any, Node] = {}
        for v, c in zip(inner.constvars, consts):
            inner_env[v] = self._constant(v.aval, c, JaxprRef(inner_path, -1, v), graph)
        for v, node in zip(inner.invars, inputs):
            inner_env[v] = node
            if isinstance(node.ref, JaxprRef):
                node.ref.aliases.append((inner_path, -1, v))
        self._eqns(inner, inner_env, inner_path, graph)
        for outer, v in zip(eqn.outvars, inner.outvars):
            node = self._read(v, inner_env, inner_path, -1, graph)
            env[outer] = node
            if isinstance(node.ref, JaxprRef):
                node.ref.aliases.append((path, index, outer))


def regions(closed: jaxcompat.ClosedJaxpr) -> list[Graph]:
    """The normalized graphs of a program: the top level first, then nested bodies."""
    builder = _Builder()
    builder.region(closed.jaxpr, list(closed.consts), ())
    return builder.regions


@dataclasses.dataclass(frozen=True)
class OperandVar:
    """q, k or v as a jaxpr variable at the site's level, and how to make it canonical."""

    var: Any
    layout: Layout  # layout.to_canonical(x) -> [B, L, H, D]; v: [B, Lk, Hkv, Dv]


@dataclasses.dataclass(frozen=True)
class MaskVar:
    """A mask in kernel terms (see `attention.MaskTerm`), with jaxpr variables.

    kind "causal" / "window": the kernel's causal flag and window (read from the logits
        chain); `var` is None for a select, the constant's own variable for an additive one.
    kind "additive": scores + sign * m; kind "boolean": where(m == keep_when, scores, fill);
        m is the operand as `passes.lower.scores_operand` brings the value of `var` to the
        scores; `key_lengths` is set when the mask is iota(Lk) < lengths[..., None].
    `var` is the earliest variable visible at the site's level from which the mask is
    reached through layout ops only; `replay` holds those ops (broadcasts, reshapes,
    transposes, casts). `direct` is the variable the site's equation reads (the operand as
    the program broadcast it; `var` itself where nothing was replayed): a train step's
    derivative of the site is taken with respect to it. `drawn`: for a post-softmax operand
    that the program draws from jax.random elementwise (dropout's keep mask), the equations
    from its keys to `var` (`kernels.drawn`), whose inputs the replacement reads instead.
    `cone`: for kind "exact_mask" (the program's own mask, which a call reading a band from
    positions is checked against and falls back to), the equations computing `var` from the
    values smaller than one [Lq, Lk] plane they start from (positions, padding, constants),
    which the replacement reads instead (`passes.lower.mask_value`): the mask is computed
    where it is used, fused into the check's reduction and inside the fallback's branch,
    never passed whole to either.
    """

    kind: str
    var: Any | None
    replay: tuple[Node, ...]
    at_shape: tuple[int, ...]
    scores_layout: Layout
    sign: float = 1.0
    fill: float | None = None
    keep_when: bool = True
    key_lengths: Any | None = None
    direct: Any | None = None
    drawn: jaxcompat.Jaxpr | None = None
    cone: jaxcompat.Jaxpr | None = None


def _drawn(jaxpr: jaxcompat.Jaxpr, m: MaskVar) -> jaxcompat.Jaxpr | None:
    """The equations computing the post-softmax operand from keys and one-element values
    (stopping at the first such value on each path), as a jaxpr, where `kernels.drawn.check`
    accepts them and the scores are [B, Hq, Lq, Lk] as they are. The operand is the value
    the site reads (`m.direct`), or `m.var` where only casts and a broadcast over B or Hq
    lead from it there (flax draws one [1, 1, Lq, Lk] mask for every batch row and head)."""
    layout, shape = m.scores_layout, tuple(m.at_shape)
    if len(shape) != 4 or tuple(layout.canonical) != shape or tuple(layout.perm) != (0, 1, 2, 3):
        return None
    cast_and_broadcast = all(n.op == "convert" or (
        n.op == "broadcast" and tuple(n.params["dims"]) == (0, 1, 2, 3)) for n in m.replay)
    for out in (m.direct, m.var if cast_and_broadcast else None):
        if out is None or out.aval.ndim != 4 or tuple(out.aval.shape[2:]) != shape[2:] \
                or any(n not in (1, want) for n, want in zip(out.aval.shape[:2], shape)):
            continue
        # Back to one-element values: a key, a keep_prob.
        cone = _cone(jaxpr, out, lambda v: math.prod(v.aval.shape) == 1)
        if cone is not None and drawn.check(cone, tuple(out.aval.shape)) is None:
            return cone
    return None


def _cone(jaxpr: jaxcompat.Jaxpr, out: Any, stops_at: Callable[[Any], bool], *,
          outside: bool = False, pure: bool = False, limit: int | None = None
          ) -> jaxcompat.Jaxpr | None:
    """The equations computing `out` back to the values `stops_at` accepts (and, where
    `outside`, those no equation here defines: the jaxpr's inputs and constants), as a jaxpr
    from those to `out`; None where another value from outside enters, `out` has no
    producer here, an equation has effects (`pure`) or more than `limit` of them take part."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    taken, inputs, pending = set(), [], [out]
    while pending:
        v = pending.pop()
        if isinstance(v, jaxcompat.Literal) or v in inputs:
            continue
        if v is not out and (stops_at(v) or (outside and v not in producer)):
            inputs.append(v)
        elif v in producer:
            if producer[v] not in taken:
                eqn = jaxpr.eqns[producer[v]]
                if (pure and eqn.effects) or (limit is not None and len(taken) >= limit):
                    return None
                taken.add(producer[v])
                pending.extend(eqn.invars)
        else:
            return None
    return jaxpr.replace(constvars=[], invars=inputs, outvars=[out],
                         eqns=[jaxpr.eqns[i] for i in sorted(taken)])


def _visible(node: Node | None, level: Path) -> tuple[Any | None, tuple[Node, ...]]:
    """(var, layout ops to replay) for the earliest value, through layout ops (and
    comparisons with a constant, `mask != 0`), of `node` that is visible at `level`: the
    user's own mask or bias rather than its broadcast."""
    found: tuple[Any | None, tuple[Node, ...]] = (None, ())
    replay: list[Node] = []
    while node is not None:
        var = node.ref.var_at(level) if isinstance(node.ref, JaxprRef) else None
        if var is not None:
            found = (var, tuple(reversed(replay)))
        if not node.inputs or not (node.op in ("broadcast", "transpose", "reshape", "convert")
                                   or compares_with_constant(node)):
            break
        replay.append(node)
        node = node.inputs[0]
    return found


@dataclasses.dataclass(frozen=True)
class JaxprSite:
    """One attention site of a jaxpr, in the terms a trace-time rewrite needs.

    path      where the site lives: `jaxpr_at(closed, path)` is the jaxpr holding it.
    eqns      indices in that jaxpr of the equations forming it; a call equation is listed
              when any part of the site is inside it.
    q, k, v   the variables entering the site (before the transposes, head repeats and
              constant pre-scaling it follows) and their canonical layouts.
    out       the variable holding the result of the second contraction, laid out as
              `out_layout.from_canonical(y)` for y: [B, Lq, Hq, Dv].
    scale     what multiplies q·kᵀ (1.0 when unscaled).
    masks     every mask step, in kernel terms.
    multipliers  factors of the probabilities constant along the keys (a head mask), as
              operands brought to [B, Hq, Lq, 1] like a mask.
    intermediates  variables the site's equations define besides `out`; a rewrite that
              drops the equations must refuse if any of them is used elsewhere (`escaping`).
    A var is None where the value is not visible at the site's level.
    """

    site: AttentionSite
    path: Path
    eqns: tuple[int, ...]
    q: OperandVar
    k: OperandVar
    v: OperandVar
    out: Any
    out_layout: Layout
    scale: float
    masks: tuple[MaskVar, ...]
    multipliers: tuple[MaskVar, ...]  # factors of the probabilities (kind "multiplier")
    intermediates: frozenset
    escaping: frozenset  # intermediates read by equations outside the site or returned
    match: Match = dataclasses.field(repr=False)
    manual: Manual | None = None  # the shard_map body the site lives in (`passes.tracing`)
    enclosing: str | None = None  # the primitive whose body holds the site (None: top level)


def _site_level(nodes: tuple[Node, ...]) -> Path:
    paths = [n.ref.path for n in nodes if isinstance(n.ref, JaxprRef) and n.ref.var is not None]
    common = paths[0] if paths else ()
    for p in paths[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return common


def _readers(jaxpr: jaxcompat.Jaxpr) -> dict[Any, set[int]]:
    """Var -> indices of the equations reading it (len(eqns) stands for the outputs)."""
    readers: dict[Any, set[int]] = {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not isinstance(v, jaxcompat.Literal):
                readers.setdefault(v, set()).add(i)
    for v in jaxpr.outvars:
        if not isinstance(v, jaxcompat.Literal):
            readers.setdefault(v, set()).add(len(jaxpr.eqns))
    return readers


def _to_jaxpr_site(closed: jaxcompat.ClosedJaxpr, match: Match,
                   readers: dict[Path, dict[Any, set[int]]]) -> JaxprSite:
    body = [n for n in match.body if isinstance(n.ref, JaxprRef)]
    level = _site_level(tuple(n for n in body if n.op not in ("constant", "parameter")))
    eqns = set()
    for n in body:
        if n.op == "parameter" or n.ref.index < 0 and len(n.ref.path) <= len(level):
            continue
        if n.ref.path[:len(level)] != level:
            continue
        eqns.add(n.ref.path[len(level)][0] if len(n.ref.path) > len(level) else n.ref.index)
    eqns.discard(-1)
    jaxpr = jaxpr_at(closed, level)

    def var(node: Node | None) -> Any | None:
        return node.ref.var_at(level) if node is not None else None

    def direct(node: Node | None) -> Any | None:  # None for a node the pattern made itself
        return var(node) if node is not None and isinstance(node.ref, JaxprRef) else None

    out = var(match.out)
    defined = {v for i in eqns for v in jaxpr.eqns[i].outvars} - {out}
    if level not in readers:
        readers[level] = _readers(jaxpr)
    escaping = {v for v in defined if readers[level].get(v, set()) - eqns}
    masks = tuple(
        MaskVar(t.kind, *_visible(t.operand, level), t.scores_layout.shape, t.scores_layout,
                t.sign, t.fill, t.keep_when, var(t.key_lengths), direct=direct(t.operand))
        for t in match.masks)
    masks = tuple(dataclasses.replace(m, drawn=_drawn(jaxpr, m))
                  if m.kind in ("post", "dropout") else m for m in masks)
    plane = match.site.q_len * match.site.kv_len
    # Back to the values smaller than one [Lq, Lk] plane (positions, padding, constants).
    masks = tuple(dataclasses.replace(m, cone=_cone(
        jaxpr, m.var, lambda v: math.prod(v.aval.shape) < plane, outside=True, pure=True,
        limit=64)) if m.kind == "exact_mask" and m.var is not None else m for m in masks)
    multipliers = tuple(
        MaskVar("multiplier", *_visible(t.operand, level), t.scores_layout.shape,
                t.scores_layout, direct=direct(t.operand))
        for t in match.multipliers)
    return JaxprSite(
        site=match.site, path=level, eqns=tuple(sorted(eqns)),
        q=OperandVar(var(match.q.node), match.q.layout),
        k=OperandVar(var(match.k.node), match.k.layout),
        v=OperandVar(var(match.v.node), match.v.layout),
        out=out, out_layout=match.out_layout, scale=match.scale,
        masks=masks, multipliers=multipliers,
        intermediates=frozenset(defined), escaping=frozenset(escaping),
        match=match, manual=manual_at(closed, level),
        enclosing=(jaxpr_at(closed, level[:-1]).eqns[level[-1][0]].primitive.name
                   if level else None),
    )


def detect_jaxpr(closed: jaxcompat.ClosedJaxpr, function: str = "") -> list[JaxprSite]:
    """Every attention site in `closed`, nested bodies included, in program order."""
    if not isinstance(closed, jaxcompat.ClosedJaxpr):
        raise HlotoolError(f"detect_jaxpr needs a ClosedJaxpr, got {type(closed).__name__}")
    sites, readers = [], {}
    live = _live_vars(closed.jaxpr)
    for graph in regions(closed):
        sites.extend(s for s in (_to_jaxpr_site(closed, m, readers) for m in find(graph, function))
                     if s.path or s.out is None or s.out in live)
    return sites


def near_misses_jaxpr(closed: jaxcompat.ClosedJaxpr, function: str = "") -> list[NearMiss]:
    """Almost-attention in `closed` that is not a site, each with the first rule it breaks."""
    return [miss for graph in regions(closed)
            for miss in near_misses(graph, find(graph, function), function)]


def _live_vars(jaxpr: jaxcompat.Jaxpr) -> set[Any]:
    """Variables the outputs depend on. jit's lowering drops dead equations (flax's `init`
    computes the model's output only to throw it away), so a site outside this set is never
    compiled: the HLO front end cannot see it, and it is no site of the program."""
    live = {v for v in jaxpr.outvars if not isinstance(v, jaxcompat.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if not isinstance(v, jaxcompat.Literal))
    return live
