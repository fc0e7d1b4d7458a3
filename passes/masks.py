"""Masks read from their structure: `j <= i` built from iotas is causal at any length.

Folding a mask to its values (`graph.fold`) costs Lq·Lk and is refused beyond a size limit, so
`jnp.tril(jnp.ones((L, L), bool))` would stop being causal at exactly the lengths flash
attention exists for. Here the mask's expression is evaluated symbolically instead: every
value is an affine form over the indices of its array (`iota` along axis d is index d, and so
is a constant arange such as `jnp.array(range(L))`, and a running sum of ones, as keras
counts positions; adds, subtracts, scalings, broadcasts and
static slices keep it affine), comparisons of two affine forms are half-planes (`abs(form) <= c` is two),
and `and` / `or` / `not` / `select` of constants combine them. A predicate that comes out as
a conjunction of half-planes `lo <= j - i <= hi` over the query axis i and key axis j is a
band (`band`): causal is `j - i <= 0` (top-left, as `jnp.tril`), a sliding window bounds
both sides (`jax.nn.dot_product_attention`'s `local_window_size`, `abs(i - j) <= w`).
Anything else is left to folding, or to the mask operand itself.

Positions the program computes at run time (the `gemma` library builds its sliding window
from `cumsum(input_mask) - 1`, not from iotas) have no such form. Asked to (`band(...,
positions=True)`), the reading takes them as their indices: a guess, right for left or no
padding and wrong for right padding, that a rewrite checks at every call.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from hlotool.passes.graph import MAX_FOLD_ELEMENTS, Node, fold, uniform_value

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
class Abs:
    """|form|: only ever compared with a constant (`abs(i - j) <= w`)."""

    form: Affine


@dataclasses.dataclass(frozen=True)
class HalfPlane:
    """`form <op> 0`."""

    form: Affine
    op: str

    def negated(self) -> HalfPlane:
        return HalfPlane(self.form, _NEGATE[self.op])


@dataclasses.dataclass(frozen=True)
class Pred:
    """The AND (`all_of`) or the OR of half-planes; one half-plane is either."""

    planes: tuple[HalfPlane, ...]
    all_of: bool = True

    def negated(self) -> Pred:  # De Morgan
        return Pred(tuple(p.negated() for p in self.planes), not self.all_of)

    def joined(self, other: Pred, all_of: bool) -> Pred | None:
        """self AND other (`all_of`) or self OR other; None when that mixes ANDs and ORs."""
        if any(len(p.planes) > 1 and p.all_of != all_of for p in (self, other)):
            return None
        return Pred(self.planes + other.planes, all_of)


@dataclasses.dataclass(frozen=True)
class Xor:
    """a XOR b: a band when each bounds j - i on the same side (`_slab`)."""

    a: Pred
    b: Pred


@dataclasses.dataclass(frozen=True)
class Const:
    value: float


@dataclasses.dataclass(frozen=True)
class Piecewise:
    """`where(pred, on_true, on_false)` of two constants: an additive mask."""

    pred: Pred
    on_true: float
    on_false: float


Value = Union[Affine, Abs, Pred, Xor, Const, Piecewise]


def _arange(node: Node) -> Affine | None:
    """A constant that is a · index + b along its one non-unit axis (`jnp.array(range(L))`)."""
    axes = [a for a, n in enumerate(node.shape) if n != 1]
    if len(axes) != 1 or node.size > MAX_FOLD_ELEMENTS:
        return None
    value = fold(node)
    if value is None or not np.issubdtype(value.dtype, np.number):
        return None
    flat = value.reshape(-1).astype(np.float64)
    step = flat[1] - flat[0]
    if not np.array_equal(flat, flat[0] + step * np.arange(flat.size)):
        return None
    coef = [0.0] * len(node.shape)
    coef[axes[0]] = float(step)
    return Affine(tuple(coef), float(flat[0]))


# The integers each dtype holds exactly, every one between: an iota or a running sum in
# bfloat16 stops counting at 256, and uint32 holds no negative number (`i - j` wraps there).
# A signed type's most negative value is left out, so that |x| of any value in range holds.
_EXACT = {"bfloat16": 2 ** 8, "float16": 2 ** 11, "float32": 2 ** 24, "float64": 2 ** 53}
for _bits in (8, 16, 32, 64):
    _EXACT[f"int{_bits}"] = 2 ** (_bits - 1) - 1
    _EXACT[f"uint{_bits}"] = 2 ** _bits - 1


def _exact_range(dtype: str) -> tuple[float, float] | None:
    top = _EXACT.get(dtype)
    if top is None:
        return None
    return (0.0 if dtype.startswith("uint") else -float(top)), float(top)


class Hypothesis(list):
    """The evaluation budget ([steps left]) of a reading that may hypothesise positions: an
    integer array the program computes at run time, [L] or [B, L], that no form reads (the
    `gemma` library's `cumsum(input_mask) - 1`), is taken as its index along its last axis,
    so that comparing such positions with each other reads as a band. True only for some
    inputs (left padding, no padding), so a band read so is a guess: `attention` marks its
    terms (`MaskTerm.from_positions`) and a rewrite checks per call that the program's mask
    equals the reading (`lower.reads_as_mask`)."""


def _position_guess(node: Node) -> Affine | None:
    """`node` as its index along its last axis, where it is such a run-time integer array
    (not a constant, not a layout op of one: the hypothesis lands on the array itself)."""
    if (not node.dtype.startswith(("int", "uint")) or len(node.shape) not in (1, 2)
            or node.shape[-1] < 2 or node.op in ("constant", "iota")
            or node.op in _AFFINE_OPS
            or node.op in ("broadcast", "reshape", "transpose", "slice", "dynamic_slice",
                           "dynamic-slice")):
        return None
    coef = [0.0] * len(node.shape)
    coef[-1] = 1.0
    return Affine(tuple(coef), 0.0)


def _eval(node: Node, budget: list[int]) -> Value | None:
    """The symbolic value of `node`; None where it is not one of the forms, or where an
    affine form is not exact in its dtype: it must take integer values only (a float
    position `arange * 0.1` rounds, and its comparisons with it), each one the dtype holds
    (folding decides there, or the mask is read as the values the program computes).
    Under a `Hypothesis` budget, run-time positions no form reads are their indices."""
    value = _eval_unchecked(node, budget)
    if value is None and isinstance(budget, Hypothesis) and budget[0] >= 0:
        value = _position_guess(node)
    if isinstance(value, Affine) and not _exact(value, node):
        return None
    return value


def _exact(form: Affine, node: Node) -> bool:
    """Whether every value `form` takes over `node`'s indices is an integer its dtype
    holds exactly."""
    held = _exact_range(node.dtype)
    if held is None:
        return False
    if any(c != int(c) for c in form.coef) or form.const != int(form.const):
        return False
    spans = [c * (n - 1) for c, n in zip(form.coef, node.shape)]
    lowest = form.const + sum(min(0.0, x) for x in spans)
    highest = form.const + sum(max(0.0, x) for x in spans)
    return held[0] <= lowest and highest <= held[1]


def _eval_unchecked(node: Node, budget: list[int]) -> Value | None:
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
    if op == "constant":
        return _arange(node)
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
    if op == "slice" and node.params.get("start") is not None:
        # Index a of the slice is start[a] + stride[a]·a of its input (HF slices its
        # precomputed causal mask to the sequence).
        start = node.params["start"]
        strides = node.params.get("strides") or (1,) * rank

        def shifted(form: Affine) -> Affine:
            return Affine(tuple(c * st for c, st in zip(form.coef, strides)),
                          form.const + sum(c * s0 for c, s0 in zip(form.coef, start)))

        return _relabel(_eval(node.inputs[0], budget), shifted)
    if op in ("dynamic_slice", "dynamic-slice") and node.inputs[0].shape == node.shape:
        # As large as its input, it starts at 0 whatever its start (XLA clamps it): KerasHub
        # slices its sliding-window mask at the cache index so.
        return _eval(node.inputs[0], budget)
    if op == "cumsum":
        # The running sum of a constant c is c·(index + 1) (reversed: c·(n - index)): keras'
        # causal mask compares two such counts of ones.
        inner = _eval(node.inputs[0], budget)
        if not isinstance(inner, Const):
            return None
        axis, c = node.params["axis"], float(inner.value)
        coef = [0.0] * rank
        coef[axis] = -c if node.params["reverse"] else c
        return Affine(tuple(coef), c * node.shape[axis] if node.params["reverse"] else c)
    if op == "abs":
        inner = _eval(node.inputs[0], budget)
        if isinstance(inner, Const):
            return Const(abs(inner.value))
        return Abs(inner) if isinstance(inner, Affine) else None
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
        return _compare(*(_eval(i, budget) for i in node.inputs), node.params["direction"],
                        rank)
    if op == "not":
        inner = _eval(node.inputs[0], budget)
        if isinstance(inner, Pred):
            return inner.negated()
        return Const(float(not inner.value)) if isinstance(inner, Const) else None
    if op == "select":
        pred, on_true, on_false = (_eval(i, budget) for i in node.inputs)
        if not isinstance(pred, Pred):
            return None
        if isinstance(on_true, Pred) and isinstance(on_false, Const) and not on_false.value:
            return pred.joined(on_true, all_of=True)  # jnp.tril of a boolean mask
        if not (isinstance(on_true, Const) and isinstance(on_false, Const)):
            return None
        if node.dtype != "bool":
            return Piecewise(pred, on_true.value, on_false.value)
        if on_true.value and not on_false.value:
            return pred
        if on_false.value and not on_true.value:
            return pred.negated()
        return None
    if op == "xor":  # tril ^ tril(k=-w): HF GPT-Neo's local window
        a, b = (_eval(i, budget) for i in node.inputs)
        return Xor(a, b) if isinstance(a, Pred) and isinstance(b, Pred) else None
    if op in ("and", "or"):
        a, b = (_eval(i, budget) for i in node.inputs)
        keep = op == "and"
        # x & True, x | False: the constant side drops out.
        for x, y in ((a, b), (b, a)):
            if isinstance(y, Const) and bool(y.value) == keep and isinstance(x, Pred):
                return x
        if isinstance(a, Pred) and isinstance(b, Pred):
            return a.joined(b, all_of=keep)
        return None
    return None


def _compare(a: Value | None, b: Value | None, direction: str, rank: int
             ) -> Pred | Xor | None:
    """`a <direction> b` as half-planes: one for two affine forms, two for |form| against a
    constant (|x| <= c is x <= c and -x <= c; |x| > c is x > c or -x > c)."""
    if isinstance(b, (Abs, Pred, Xor)):
        a, b, direction = b, a, _FLIP[direction]
    if isinstance(a, (Pred, Xor)):  # a boolean cast to a number, compared with 0 (mask != 0)
        if not (isinstance(b, Const) and b.value == 0.0):
            return None
        if direction in ("ne", "gt"):
            return a
        return a.negated() if direction in ("eq", "le") and isinstance(a, Pred) else None
    if isinstance(a, Abs):
        c = _as_affine(b, rank)
        if c is None or any(c.coef) or direction not in ("le", "lt", "ge", "gt"):
            return None
        minus_c = c.scaled(-1.0)
        planes = (HalfPlane(a.form + minus_c, direction),
                  HalfPlane(a.form.scaled(-1.0) + minus_c, direction))
        return Pred(planes, all_of=direction in ("le", "lt"))
    a, b = _as_affine(a, rank), _as_affine(b, rank)
    if a is None or b is None:
        return None
    return Pred((HalfPlane(a + b.scaled(-1.0), direction),))


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
    if isinstance(value, Abs):
        form = move(value.form)
        return None if form is None else Abs(form)
    if isinstance(value, Xor):
        a, b = (_relabel(p, move) for p in (value.a, value.b))
        return None if a is None or b is None else Xor(a, b)
    pred = value.pred if isinstance(value, Piecewise) else value
    planes = []
    for plane in pred.planes:
        form = move(plane.form)
        if form is None:
            return None
        planes.append(HalfPlane(form, plane.op))
    moved = Pred(tuple(planes), pred.all_of)
    if isinstance(value, Piecewise):
        return Piecewise(moved, value.on_true, value.on_false)
    return moved


def _as_affine(value: Value | None, rank: int) -> Affine | None:
    if isinstance(value, Affine):
        return value
    if isinstance(value, Const):
        return Affine((0.0,) * rank, value.value)
    return None


Band = tuple[int | None, int | None]


def _band(pred: Pred, q_axis: int, k_axis: int) -> Band | None:
    """(lo, hi) when `pred` reads lo <= j - i <= hi over (i along q_axis, j along k_axis),
    None standing for an unbounded side; None when it is not such a band."""
    if not pred.planes or (len(pred.planes) > 1 and not pred.all_of):
        return None
    lo, hi = None, None
    for plane in pred.planes:
        form, op = plane.form, plane.op
        if any(c for a, c in enumerate(form.coef) if a not in (q_axis, k_axis)):
            return None
        ci, cj = form.coef[q_axis], form.coef[k_axis]
        if cj == 0 or ci != -cj:
            return None
        # form = cj·(j - i) + c0 <op> 0, i.e. (j - i) <op'> -c0 / cj.
        bound = -form.const / cj
        if cj < 0:
            op = _FLIP[op]
        if op in ("lt", "gt"):  # j - i is an integer
            bound = np.ceil(bound) - 1 if op == "lt" else np.floor(bound) + 1
            op = "le" if op == "lt" else "ge"
        elif op in ("le", "eq", "ge"):
            bound = np.floor(bound) if op == "le" else (
                np.ceil(bound) if op == "ge" else bound)
        else:
            return None
        if bound != int(bound):
            return None  # j - i == a fraction: never
        bound = int(bound)
        if op in ("le", "eq"):
            hi = bound if hi is None else min(hi, bound)
        if op in ("ge", "eq"):
            lo = bound if lo is None else max(lo, bound)
    return lo, hi


def _slab(value: Xor, q_axis: int, k_axis: int) -> Band | None:
    """The band between two half-planes bounding j - i on the same side: (None, hi) ^ (None,
    hi') with hi' < hi is hi' < j - i <= hi (and the mirror for lower bounds)."""
    a, b = (_band(p, q_axis, k_axis) for p in (value.a, value.b))
    if a is None or b is None:
        return None
    if a[0] is None and b[0] is None and None not in (a[1], b[1]) and a[1] != b[1]:
        (_, low), (_, high) = sorted((a, b), key=lambda x: x[1])
        return low + 1, high
    if a[1] is None and b[1] is None and None not in (a[0], b[0]) and a[0] != b[0]:
        (low, _), (high, _) = sorted((a, b), key=lambda x: x[0])
        return low, high - 1
    return None


def band(mask: Node, q_axis: int, k_axis: int, hides: bool = False,
         positions: bool = False) -> Band | None:
    """(lo, hi) for a boolean mask whose visible keys are `lo <= j - i <= hi` (query index i
    along `q_axis`, key index j along `k_axis` of the mask's own array; None for an unbounded
    side; `hides`: the mask is True where keys are hidden): (None, 0) is causal. None when the
    mask is not a function of those indices of that form. `positions`: run-time positions are
    taken as their indices (`Hypothesis`): a band then holds only where that is so."""
    value = _eval(mask, Hypothesis([256]) if positions else [256])
    if isinstance(value, Xor) and not hides:
        found = _slab(value, q_axis, k_axis)
    elif not isinstance(value, Pred):
        return None
    else:
        found = _band(value.negated() if hides else value, q_axis, k_axis)
    if found is not None and None not in found and found[0] > found[1]:
        return None  # hides every key
    return found


def band_bias(bias: Node, q_axis: int, k_axis: int) -> tuple[Band, float] | None:
    """(band, value outside it) for an additive mask `where(lo <= j - i <= hi, 0, value)`."""
    value = _eval(bias, [256])
    if not isinstance(value, Piecewise):
        return None
    pred, visible, hidden = value.pred, value.on_true, value.on_false
    if visible != 0.0:
        pred, visible, hidden = pred.negated(), hidden, visible
    found = _band(pred, q_axis, k_axis)
    return None if found is None or visible != 0.0 else (found, hidden)


Window = tuple[int | None, int | None]


def window(found: Band | None, q_len: int, k_len: int) -> Window | None:
    """A band `lo <= j - i <= hi` as kernels take it, (left, right): query i sees keys
    i - left ≤ j ≤ i + right; a side no query of [q_len, k_len] reaches is None (unbounded),
    so `jnp.tril` is (None, 0), `site.CAUSAL`, whatever its shape."""
    if found is None:
        return None
    lo, hi = found
    left = None if lo is None or lo <= -(q_len - 1) else -lo
    if hi == 0:
        return left, 0  # causal stays causal where no query reaches past the keys
    right = None if hi is None or hi >= k_len - 1 else hi
    return left, right
