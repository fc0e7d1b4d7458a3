"""A small structural pattern language over `passes.graph.Node`, after XLA's pattern_matcher.

Patterns match a node and its operands top-down (from a result towards its inputs) and
yield every way they match as a `Bindings` dict (backtracking through alternatives):

  Op("exp", x)                      node.op == "exp" and its operand matches x
  Op("mul", a, b, commutative=True) also tries the operands swapped
  Any("q")                          anything; binds the node to "q"
  Same("logits")                    the node bound to "logits", modulo layout ops
  Const(pred)                       a node that folds to one value with pred(value) true
  Alt(p1, p2)                       either
  Through(p)                        p, under any chain of layout ops (casts, reshapes, ...)
  Chain(base, *steps)               base wrapped in any sequence of elementwise steps

A name bound twice must bind the same node. `Chain` and `Through` record the nodes they
walk (`record=`) so callers can follow shapes along the matched path.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from hlotool.passes.graph import LAYOUT_OPS, Node, strip, uniform_value

Bindings = dict


def _bind(m: Bindings, name: str | None, value: object) -> Bindings | None:
    if name is None:
        return m
    if name in m:
        return m if m[name] is value else None
    return {**m, name: value}


class Pattern:
    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Any(Pattern):
    name: str | None = None

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        out = _bind(m, self.name, node)
        if out is not None:
            yield out


@dataclasses.dataclass(frozen=True)
class Same(Pattern):
    name: str

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        bound = m.get(self.name)
        if bound is not None and strip(bound, LAYOUT_OPS) is strip(node, LAYOUT_OPS):
            yield m


@dataclasses.dataclass(frozen=True)
class Const(Pattern):
    """A node that folds to a single value accepted by `accept`; binds (node, value)."""

    accept: Callable[[float], bool] = lambda v: True
    name: str | None = None

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        value = uniform_value(node)
        if value is not None and self.accept(value):
            out = _bind(m, self.name, (node, value))
            if out is not None:
                yield out


class Op(Pattern):
    def __init__(self, op: str, *operands: Pattern, name: str | None = None,
                 commutative: bool = False):
        self.op, self.operands, self.name, self.commutative = op, operands, name, commutative

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        if node.op != self.op or len(node.inputs) != len(self.operands):
            return
        start = _bind(m, self.name, node)
        if start is None:
            return
        orders = [node.inputs]
        if self.commutative and len(node.inputs) == 2:
            orders.append(node.inputs[::-1])
        for inputs in orders:
            yield from _match_all(self.operands, inputs, start)


def _match_all(pats: tuple[Pattern, ...], nodes: tuple[Node, ...], m: Bindings
               ) -> Iterator[Bindings]:
    if not pats:
        yield m
        return
    for m1 in pats[0].match(nodes[0], m):
        yield from _match_all(pats[1:], nodes[1:], m1)


class Alt(Pattern):
    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        for p in self.alternatives:
            yield from p.match(node, m)


class Through(Pattern):
    """`inner` at this node or below any chain of layout ops; `record` names the walked path."""

    def __init__(self, inner: Pattern, ops: frozenset[str] = LAYOUT_OPS,
                 record: str | None = None):
        self.inner, self.ops, self.record = inner, ops, record

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        walked: list[Node] = []
        while True:
            m1 = m if self.record is None else {**m, self.record: tuple(walked)}
            yield from self.inner.match(node, m1)
            if node.op not in self.ops or not node.inputs:
                return
            walked.append(node)
            node = node.inputs[0]


@dataclasses.dataclass(frozen=True)
class Step:
    """One elementwise op applied to the chain value: `op(..., <chain>, ...)`.

    `chain_at` lists the operand positions the chain value may take; the other operands
    must match `sides` (by position, in order of the remaining operands).
    """

    kind: str
    op: str
    chain_at: tuple[int, ...]
    sides: tuple[Pattern, ...]


@dataclasses.dataclass(frozen=True)
class Link:
    """One node on a matched chain: which operand carries the chain, and its side operands."""

    node: Node
    kind: str  # "layout" or a Step kind
    chain_input: int
    sides: tuple[Node, ...] = ()


class Chain(Pattern):
    """`base` under any sequence of layout ops and `steps`; binds the links to `record`
    and the node it matched at to `name`.

    The recorded tuple runs from the matched node down to (not including) the base node.
    """

    def __init__(self, base: Pattern, *steps: Step, record: str, name: str | None = None):
        self.base, self.steps, self.record, self.name = base, steps, record, name

    def match(self, node: Node, m: Bindings) -> Iterator[Bindings]:
        start = _bind(m, self.name, node)
        if start is not None:
            yield from self._match(node, start, ())

    def _match(self, node: Node, m: Bindings, links: tuple[Link, ...]) -> Iterator[Bindings]:
        yield from self.base.match(node, {**m, self.record: links})
        if node.op in LAYOUT_OPS and node.inputs:
            yield from self._match(node.inputs[0], m, links + (Link(node, "layout", 0),))
        for step in self.steps:
            if node.op != step.op or len(node.inputs) != len(step.sides) + 1:
                continue
            for at in step.chain_at:
                others = node.inputs[:at] + node.inputs[at + 1:]
                for m1 in _match_all(step.sides, others, m):
                    link = Link(node, step.kind, at, others)
                    yield from self._match(node.inputs[at], m1, links + (link,))
