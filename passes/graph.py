"""The normalized op graph both detection front ends produce.

HLO instructions and jaxpr equations are adapted into `Node`s with one vocabulary, so the
attention pattern (`passes/attention.py`) is written once:

  dot_general   params lhs_contract, rhs_contract, lhs_batch, rhs_batch (axis tuples)
  reduce_max, reduce_sum   params axes
  broadcast     params dims (operand axis i becomes output axis dims[i])
  transpose     params perm (output axis i is operand axis perm[i])
  reshape, convert, copy, stop_gradient
  select        inputs (pred, on_true, on_false)
  compare       params direction in {"eq", "ne", "lt", "le", "gt", "ge"}
  iota          params dimension
  constant      params value (numpy array, or None when the front end could not read it)
  parameter     a value entering the graph from outside
  exp, sub, add, mul, div, neg, max, min, and, or, not, sqrt, rsqrt, ...  elementwise
Anything else keeps its own op name and is opaque to the pattern.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

# Unary ops that only move, cast or relabel data: the pattern looks through them.
LAYOUT_OPS = frozenset(
    {"convert", "copy", "stop_gradient", "reduce_precision", "broadcast", "reshape", "transpose"}
)

# Ops that draw random bits (jaxpr primitive names), and with them every op that draws or
# handles a PRNG key, by its jaxpr or HLO name.
RANDOM_BITS = frozenset({"random_bits", "threefry2x32", "rng_bit_generator"})
RANDOM_OPS = RANDOM_BITS | {"rng", "random_wrap", "random_unwrap", "rng-bit-generator",
                            "rng-get-and-update-state"}

# Refuse to constant-fold anything larger: masks are folded only to classify them.
MAX_FOLD_ELEMENTS = 1 << 24


@dataclasses.dataclass(eq=False)
class Node:
    """One value in the normalized graph: the op that produced it and its type."""

    op: str
    inputs: tuple[Node, ...]
    shape: tuple[int, ...]
    dtype: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    # "path:line" of the user code that produced it, or a function computing it on demand
    # (resolving stack frames for every node would dominate detection time).
    where: str | Callable[[], str] = ""
    ref: Any = None  # the front end's handle (jaxpr location or HLO instruction name)

    @property
    def source(self) -> str:
        if callable(self.where):
            self.where = self.where()
        return self.where

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self) -> str:
        return f"Node({self.op}, {self.dtype}{list(self.shape)}, ref={self.ref!r})"


@dataclasses.dataclass
class Graph:
    """Nodes of one program region in definition order, plus where the region sits.

    `path` locates the region inside its program (jaxpr: the chain of equations and
    parameters leading to a nested scan/while/cond body; HLO: the computation name).
    """

    nodes: list[Node]
    path: tuple[Any, ...] = ()

    def anchors(self, op: str) -> Iterator[Node]:
        return (n for n in self.nodes if n.op == op)


def as_product(dot: Node, inner_ref: Any = None) -> list[Node] | None:
    """A dot_general that contracts nothing, as the elementwise product it is:
    `einsum("...hqk,h->...hqk", p, head_mask)` is transpose(p) · broadcast(head_mask). Returns
    the nodes to put in the graph instead (the last one stands for `dot` and keeps its ref;
    the others get `inner_ref`), or None.

    dot_general's output is its batch axes, then lhs's free axes, then rhs's; each side is
    brought to that order and broadcast over the other's free axes.
    """
    p = dot.params
    if p["lhs_contract"] or p["rhs_contract"]:
        return None
    lhs, rhs = dot.inputs
    nb = len(p["lhs_batch"])
    lfree = [a for a in range(len(lhs.shape)) if a not in p["lhs_batch"]]
    rfree = [a for a in range(len(rhs.shape)) if a not in p["rhs_batch"]]
    out_rank = nb + len(lfree) + len(rfree)
    nodes: list[Node] = []

    def side(x: Node, batch: tuple[int, ...], free: list[int], at: list[int]) -> Node:
        perm = tuple(batch) + tuple(free)
        if perm != tuple(range(len(x.shape))):
            x = Node("transpose", (x,), tuple(x.shape[a] for a in perm), x.dtype,
                     {"perm": perm}, dot.where, inner_ref)
            nodes.append(x)
        if len(x.shape) != out_rank:
            x = Node("broadcast", (x,), dot.shape, x.dtype, {"dims": tuple(at)}, dot.where,
                     inner_ref)
            nodes.append(x)
        return x

    left = side(lhs, p["lhs_batch"], lfree, list(range(nb + len(lfree))))
    right = side(rhs, p["rhs_batch"], rfree,
                 list(range(nb)) + list(range(nb + len(lfree), out_rank)))
    nodes.append(Node("mul", (left, right), dot.shape, dot.dtype, {}, dot.where, dot.ref))
    return nodes


def rounds_to_itself(dtype: str, exponent_bits: int, mantissa_bits: int) -> bool:
    """Whether a reduce_precision to these bits leaves every `dtype` value as it is (a copy):
    jax's remat writes such ops on the values a checkpoint policy saves."""
    try:
        info = np.finfo(_np_dtype(dtype))
    except (TypeError, ValueError):
        return False
    return (exponent_bits, mantissa_bits) == (info.nexp, info.nmant)


def _number_kind(dtype: str) -> tuple[str, int, int] | None:
    """("float", exponent bits, mantissa bits) or ("int", signed, bits) of a dtype name;
    None for anything else (bool, complex, keys)."""
    try:
        np_dtype = _np_dtype(dtype)
    except TypeError:
        return None
    if np_dtype.kind == "f" or dtype.startswith(("bfloat", "float")):
        info = ml_dtypes.finfo(np_dtype)
        return "float", int(info.nexp), int(info.nmant)
    if np_dtype.kind in ("i", "u"):
        return "int", int(np_dtype.kind == "i"), 8 * np_dtype.itemsize
    return None


def _int_range(signed: int, bits: int) -> tuple[int, int]:
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2 ** bits - 1)


def covers(wide: str, narrow: str) -> bool:
    """Whether every value of dtype `narrow` is a value of dtype `wide`, so a convert from
    `narrow` to `wide` changes nothing (bool to any number included)."""
    if wide == narrow or narrow == "bool":
        return True
    w, n = _number_kind(wide), _number_kind(narrow)
    if w is None or n is None:
        return False
    if w[0] == n[0] == "float":
        return w[1] >= n[1] and w[2] >= n[2]
    if w[0] == n[0] == "int":
        return _int_range(*w[1:])[0] <= _int_range(*n[1:])[0] and \
            _int_range(*w[1:])[1] >= _int_range(*n[1:])[1]
    if w[0] == "float" and n[0] == "int":  # every integer of n counted exactly
        return w[2] + 1 >= n[2] - n[1]
    return False


def strip(node: Node, ops: Iterable[str] = ("convert", "copy", "stop_gradient")) -> Node:
    """The node under any chain of the given unary ops."""
    ops = frozenset(ops)
    while node.op in ops and node.inputs:
        node = node.inputs[0]
    return node


def fold(node: Node) -> np.ndarray | None:
    """The value of `node` if it depends only on constants and iotas, else None.

    Broadcasts stay numpy views, so folding a [Lq, Lk] mask broadcast to [B, H, Lq, Lk]
    costs [Lq, Lk]; anything that would materialize more than MAX_FOLD_ELEMENTS is refused.
    At most FOLD_BUDGET nodes are visited, which keeps detection linear in program size:
    masks and scales are small expressions, and a value computed from the program's inputs
    is given up on after the budget.
    """
    try:
        return _fold_memo(node, {})
    except _OverBudget:
        return None


FOLD_BUDGET = 256


class _OverBudget(Exception):
    pass


def _fold_memo(node: Node, memo: dict[int, np.ndarray | None]) -> np.ndarray | None:
    key = id(node)
    if key not in memo:
        if len(memo) >= FOLD_BUDGET:
            raise _OverBudget
        memo[key] = None
        try:
            memo[key] = _fold(node, memo)
        except (ValueError, TypeError, FloatingPointError, OverflowError, KeyError):
            memo[key] = None
    return memo[key]


_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "max": np.maximum, "min": np.minimum, "and": np.logical_and, "or": np.logical_or,
    "pow": np.power, "rem": np.remainder,
}
_UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "abs": np.abs,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "not": np.logical_not, "floor": np.floor,
    "ceil": np.ceil, "sign": np.sign,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}


def _np_dtype(dtype: str) -> Any:
    """The numpy dtype a value is folded in: the program's own, so each folded op rounds as
    the program's does (bfloat16 counts exactly only up to 256)."""
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _fold(node: Node, memo: dict) -> np.ndarray | None:
    op = node.op
    if op == "constant":
        value = node.params.get("value")
        return None if value is None else np.broadcast_to(np.asarray(value), node.shape)
    if op == "iota":
        if node.size > MAX_FOLD_ELEMENTS:
            return None
        dim = node.params["dimension"]
        ar = np.arange(node.shape[dim], dtype=_np_dtype(node.dtype))
        view = [1] * len(node.shape)
        view[dim] = node.shape[dim]
        return np.broadcast_to(ar.reshape(view), node.shape)
    if not node.inputs:
        return None
    if node.size > MAX_FOLD_ELEMENTS and op not in ("broadcast", "transpose", "reshape"):
        return None  # refused before computing it, not after
    args = []
    for x in node.inputs:
        args.append(_fold_memo(x, memo))
        if args[-1] is None:
            return None
    if op == "broadcast":
        (x,) = args
        view = [1] * len(node.shape)
        for i, d in enumerate(node.params["dims"]):
            view[d] = x.shape[i]
        return np.broadcast_to(x.reshape(view), node.shape)
    if op == "transpose":
        return np.transpose(args[0], node.params["perm"])
    if op in ("convert", "copy", "stop_gradient", "reduce_precision"):
        return args[0].astype(_np_dtype(node.dtype), copy=False)
    if op == "reshape":
        return _guard(np.reshape(args[0], node.shape))
    if op == "select":
        return _guard(np.where(*args))
    if op == "compare":
        return _guard(_COMPARE[node.params["direction"]](*args))
    if op == "integer_pow":
        return _guard(np.power(args[0], node.params["y"]))
    if op in ("div", "rem") and np.issubdtype(_np_dtype(node.dtype), np.integer):
        return _integer_division(op, *args)
    if op in _BINARY:
        with np.errstate(all="ignore"):
            return _guard(np.asarray(_BINARY[op](*args)))
    if op in _UNARY:
        with np.errstate(all="ignore"):
            return _guard(np.asarray(_UNARY[op](*args)))
    return None


def _integer_division(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """XLA's integer div and rem: the quotient rounds toward zero and the remainder takes
    the dividend's sign (numpy's // and % floor); None on a zero divisor, which XLA gives
    no portable value."""
    if np.any(b == 0):
        return None
    remainder = np.fmod(a, b)
    if op == "rem":
        return _guard(np.asarray(remainder, a.dtype))
    return _guard(np.asarray((a - remainder) // b, a.dtype))


# Ops whose folded value is the program's bit for bit: they move or select values, cast
# them, or compare them. Float arithmetic is left out: XLA may fuse it, keep excess
# precision or use other approximations of exp, so numpy's result can differ in a last bit,
# and a comparison after it may flip.
_EXACT_FOLD_OPS = frozenset({"constant", "iota", "broadcast", "reshape", "transpose",
                             "convert", "copy", "stop_gradient", "slice", "select",
                             "concatenate", "compare", "and", "or", "not", "xor"})


def _integer(dtype: str) -> bool:
    kind = _number_kind(dtype)
    return dtype == "bool" or (kind is not None and kind[0] == "int")


def fold_exact(node: Node) -> np.ndarray | None:
    """`fold(node)` where every value it folds is the one the program computes (integer
    arithmetic, comparisons, casts, layout ops); None where float arithmetic enters."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if len(seen) > FOLD_BUDGET:
            return None
        if n.op not in _EXACT_FOLD_OPS and not _integer(n.dtype):
            return None
        stack.extend(n.inputs)
    return fold(node)


def _guard(x: np.ndarray) -> np.ndarray | None:
    return x if x.size <= MAX_FOLD_ELEMENTS else None


def compares_with_constant(node: Node) -> bool:
    """`x <op> c` for a constant c: elementwise, so it commutes with the broadcasts of x."""
    return (node.op == "compare" and len(node.inputs) == 2
            and uniform_value(node.inputs[1]) is not None)


def uniform_value(node: Node) -> float | None:
    """The single value every element of a constant node holds, else None."""
    casts = []  # converts are applied to the one value, as the program applies them
    while node.op in ("broadcast", "convert", "reshape", "copy") and node.inputs:
        if node.op == "convert":
            casts.append(node.dtype)
        node = node.inputs[0]
    value = fold(node)
    if value is None or value.size == 0:
        return None
    first = value.flat[0]
    if value.size > 1 and not np.all(value == first):
        return None
    with np.errstate(all="ignore"):
        for dtype in reversed(casts):
            try:
                first = np.asarray(first).astype(_np_dtype(dtype))
            except (TypeError, ValueError, OverflowError):
                return None
    return float(first)


# jax.random.uniform moves random bits into a float's mantissa with a bitcast; in HLO that
# bitcast is what names the draw, the threefry loop before it keeping no name.
_BITCASTS = frozenset({"bitcast_convert_type", "bitcast-convert"})


def drawn_from_bits(node: Node, limit: int = 64) -> bool:
    """Whether `node` is computed from random bits: within `limit` values of its cone, an op
    that draws them (jaxpr) or unsigned integers bitcast to floats (both front ends)."""
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in RANDOM_OPS or (n.op in _BITCASTS and n.inputs
                                  and n.inputs[0].dtype.startswith("uint")):
            return True
        stack.extend(n.inputs)
    return False
