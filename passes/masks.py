"""Masks read from their structure: `j <= i` built from iotas is causal at any length.

Folding a mask to its values (`graph.fold`) costs Lq·Lk and is refused beyond a size limit, so
`jnp.tril(jnp.ones((L, L), bool))` would stop being causal at exactly the lengths flash
attention exists for. Here the mask's expression is evaluated symbolically instead: every
value is an affine form over the indices of its array (`iota` along axis d is index d; adds,
subtracts, scalings and broadcasts keep it affine), comparisons of two affine forms are
half-planes, and `and` / `or` / `not` / `select` of constants combine them. A predicate that
comes out as one half-plane `j - i <= offset` over the query axis i and key axis j is a
causal mask with that diagonal offset (0: top-left, as `jnp.tril`); anything else is left to
folding, or to the mask operand itself.
"""

from __future__ import annotations

import dataclasses
from typing import Union

from hlotool.passes.graph import Node, uniform_value

_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_AFFINE_OPS = frozenset({"convert", "copy", "stop_gradient"})


@dataclasses.dataclass(frozen=True)
class Affine:
    """sum(coef[a] · index_a) + const over the axes of an array."""

    coef: tuple[float, ...]
    const: float

    def __add__(self, other: Affine) -> Affine:
        return Affine(tuple(a + b for a, b in zip(self.coef, other.coef)),
                      self.const + other.const)

    def scaled(self, c: float) -> Affine:
        return Affine(tuple(a * c for a in self.coef), self.const * c)


@dataclasses.dataclass(frozen=True)
class HalfPlane:
    """`form <op> 0`."""

    form: Affine
    op: str


@dataclasses.dataclass(frozen=True)
class Const:
    value: float


@dataclasses.dataclass(frozen=True)
class Piecewise:
    """`where(pred, on_true, on_false)` of two constants: an additive mask."""

    pred: HalfPlane
    on_true: float
    on_false: float


Value = Union[Affine, HalfPlane, Const, Piecewise]


def _eval(node: Node, budget: list[int]) -> Value | None:
    budget[0] -= 1
    if budget[0] < 0:
        return None
    rank = len(node.shape)
    op = node.op
    if op == "iota":
        coef = [0.0] * rank
        coef[node.params["dimension"]] = 1.0
        return Affine(tuple(coef), 0.0)
    value = uniform_value(node) if op in ("constant", "broadcast") else None
    if value is not None:
        return Const(value)
    if op in _AFFINE_OPS and node.inputs:
        return _eval(node.inputs[0], budget)
    if op == "broadcast":
        src, dims = node.inputs[0].shape, node.params["dims"]

        def widen(form: Affine) -> Affine | None:
            coef = [0.0] * rank
            for i, d in enumerate(dims):
                if src[i] == 1 and node.shape[d] != 1:
                    continue  # repeated from a unit axis, whose index was always 0
                coef[d] = form.coef[i]
            return Affine(tuple(coef), form.const)

        return _relabel(_eval(node.inputs[0], budget), widen)
    if op == "reshape":
        inner = _eval(node.inputs[0], budget)
        return _relabel(inner, lambda form: _reshaped(form, node.inputs[0].shape, node.shape))
    if op in ("add", "sub", "mul", "neg"):
        args = [_eval(i, budget) for i in node.inputs]
        if any(a is None for a in args):
            return None
        if op == "neg":
            (a,) = args
            return Const(-a.value) if isinstance(a, Const) else (
                a.scaled(-1.0) if isinstance(a, Affine) else None)
        a, b = (_as_affine(x, rank) for x in args)
        if a is None or b is None:
            return None
        if op == "add":
            return a + b
        if op == "sub":
            return a + b.scaled(-1.0)
        if not any(a.coef):
            return b.scaled(a.const)
        if not any(b.coef):
            return a.scaled(b.const)
        return None
    if op == "compare":
        a, b = (_as_affine(_eval(i, budget), rank) for i in node.inputs)
        if a is None or b is None:
            return None
        return HalfPlane(a + b.scaled(-1.0), node.params["direction"])
    if op == "not":
        inner = _eval(node.inputs[0], budget)
        if isinstance(inner, HalfPlane):
            return HalfPlane(inner.form, _NEGATE[inner.op])
        return Const(float(not inner.value)) if isinstance(inner, Const) else None
    if op == "select":
        pred, on_true, on_false = (_eval(i, budget) for i in node.inputs)
        if not isinstance(pred, HalfPlane):
            return None
        if not (isinstance(on_true, Const) and isinstance(on_false, Const)):
            return None
        if node.dtype != "bool":
            return Piecewise(pred, on_true.value, on_false.value)
        if on_true.value and not on_false.value:
            return pred
        if on_false.value and not on_true.value:
            return HalfPlane(pred.form, _NEGATE[pred.op])
        return None
    if op in ("and", "or"):
        # x & True, x | False: the constant side drops out.
        a, b = (_eval(i, budget) for i in node.inputs)
        keep = True if op == "and" else False
        for x, y in ((a, b), (b, a)):
            if isinstance(y, Const) and bool(y.value) == keep and isinstance(x, HalfPlane):
                return x
        return None
    return None


def _reshaped(form: Affine, src: tuple[int, ...], dst: tuple[int, ...]) -> Affine | None:
    """`form` over `dst`'s axes, for a reshape that only adds or drops unit axes (an index
    along a unit axis is always 0, so its coefficient drops out)."""
    src_axes = [a for a, n in enumerate(src) if n != 1]
    dst_axes = [a for a, n in enumerate(dst) if n != 1]
    if [src[a] for a in src_axes] != [dst[a] for a in dst_axes]:
        return None
    coef = [0.0] * len(dst)
    for a, b in zip(src_axes, dst_axes):
        coef[b] = form.coef[a]
    return Affine(tuple(coef), form.const)


def _relabel(value: Value | None, move) -> Value | None:
    """`value` with every affine form in it moved by `move` (None when one cannot be)."""
    if isinstance(value, Const) or value is None:
        return value
    if isinstance(value, Affine):
        return move(value)
    pred = value.pred if isinstance(value, Piecewise) else value
    form = move(pred.form)
    if form is None:
        return None
    if isinstance(value, Piecewise):
        return Piecewise(HalfPlane(form, pred.op), value.on_true, value.on_false)
    return HalfPlane(form, pred.op)


def _as_affine(value: Value | None, rank: int) -> Affine | None:
    if isinstance(value, Affine):
        return value
    if isinstance(value, Const):
        return Affine((0.0,) * rank, value.value)
    return None


def _offset(pred: HalfPlane, q_axis: int, k_axis: int) -> int | None:
    """o when `pred` reads j - i <= o over (i along q_axis, j along k_axis), else None."""
    form, op = pred.form, pred.op
    if any(c for a, c in enumerate(form.coef) if a not in (q_axis, k_axis)):
        return None
    ci, cj = form.coef[q_axis], form.coef[k_axis]
    if cj == 0 or ci != -cj:
        return None
    # form = cj·(j - i) + c0 <op> 0, i.e. (j - i) <op'> -c0 / cj.
    bound = -form.const / cj
    if cj < 0:
        op = _FLIP[op]
    if bound != int(bound):
        return None
    return {"le": int(bound), "lt": int(bound) - 1}.get(op)


def causal_offset(mask: Node, q_axis: int, k_axis: int, hides: bool = False) -> int | None:
    """The offset o of a boolean mask whose visible keys are `j <= i + o` (query index i
    along `q_axis`, key index j along `k_axis` of the mask's own array; `hides`: the mask is
    True where keys are hidden); None when it is not a function of those indices of that
    form."""
    value = _eval(mask, [256])
    if not isinstance(value, HalfPlane):
        return None
    if hides:
        value = HalfPlane(value.form, _NEGATE[value.op])
    return _offset(value, q_axis, k_axis)


def causal_bias(bias: Node, q_axis: int, k_axis: int) -> tuple[int, float] | None:
    """(o, value above the diagonal) for an additive mask `where(j <= i + o, 0, value)`."""
    value = _eval(bias, [256])
    if not isinstance(value, Piecewise):
        return None
    pred, visible, hidden = value.pred, value.on_true, value.on_false
    if visible != 0.0:
        pred, visible, hidden = HalfPlane(pred.form, _NEGATE[pred.op]), hidden, visible
    offset = _offset(pred, q_axis, k_axis)
    return None if offset is None or visible != 0.0 else (offset, hidden)
