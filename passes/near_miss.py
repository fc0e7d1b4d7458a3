"""Near misses: almost-attention that is not detected, and the first rule it breaks.

A candidate is two dots around an exp — `dot(f(exp(g(dot(...)))), ...)` — that is not a
detected site. Like XLA's `explain_os`, each says why, in user terms:

    a floor between the scores and the softmax
    random values multiply the probabilities (not dropout's keep / keep_prob)
    the second dot does not contract the key axis the softmax runs over

Scores side (exp's input down to the first dot): the pattern's vocabulary is layout ops,
scale, bias, mask, tanh and concatenate steps and the row max; the first op outside it is the
reason. Probability side (exp up to the dot that reads it): layout ops, the normalization by
exp's own sum, `where(m, p, 0)`, dropout's `p * (keep / keep_prob)`, constant factors and
slices.
When both sides are clean, the pattern's own shape checks (`attention.rejection`) say why.

Only attention-shaped code is a near miss: two dots around a softmax, an exp divided by its
own sum (before the value dot or after it). An exp whose sum is only logged — a model's
`log_softmax` loss head, whose backward pass puts a dot after it — is no attention at all.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from typing import Any, Sequence

from hlotool.passes.attention import Match, from_bits, rejection
from hlotool.passes.graph import LAYOUT_OPS, Graph, Node, drawn_from_bits, uniform_value

# Ops the logits chain may hold between the scores' dot and the exp.
_CHAIN = LAYOUT_OPS | {"mul", "div", "add", "sub", "select", "max", "neg", "reduce_max", "tanh",
                       "concatenate"}
# How far to look from an exp for the dots around it.
_REACH = 40


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """An exp between two dots that is not attention, where it is and why."""

    function: str
    source: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def near_misses(graph: Graph, sites: Sequence[Match], function: str = "") -> list[NearMiss]:
    """The near misses of one graph region, given the sites found in it."""
    covered = {id(n) for m in sites for n in m.body}
    users: dict[int, list[Node]] = defaultdict(list)
    for n in graph.nodes:
        for i in n.inputs:
            users[id(i)].append(n)
    found, seen = [], set()
    for exp in graph.anchors("exp"):
        if id(exp) in covered:
            continue
        scores, before = _scores_side(exp)
        value_dot, after = _probs_side(exp, users)
        if scores is None or value_dot is None or id(value_dot) in seen:
            continue
        if not _normalized_by_own_sum(exp, users):
            continue  # no softmax between the dots: not attention-shaped
        seen.add(id(value_dot))
        reason = before or after or rejection(graph, value_dot) or (
            "the exp is not normalized by its own sum along one axis before the value dot")
        found.append(NearMiss(function, exp.source or value_dot.source or scores.source,
                              reason))
    return found


def _normalized_by_own_sum(exp: Node, users: dict[int, list[Node]]) -> bool:
    """Whether something computed from `exp` (its probabilities, or the value dot's output
    when the normalization comes last) is divided by a sum of `exp` along an axis."""
    sums, stack = set(), [exp]
    while stack:  # the sums of exp, or of a cast or relayout of it
        for user in users[id(stack.pop())]:
            if user.op == "reduce_sum":
                sums.add(id(user))
            elif user.op in LAYOUT_OPS:
                stack.append(user)
    queue, seen = deque([exp]), {id(exp)}
    while queue and len(seen) < _REACH:
        for user in users[id(queue.popleft())]:
            if id(user) in seen:
                continue
            seen.add(id(user))
            if _divides_by_sum(user, sums, exp):
                return True
            queue.append(user)
    return False


def _divides_by_sum(node: Node, sums: set[int], exp: Node) -> bool:
    """`x / s` or `x * (1 / s)` for `s` in `sums` and `x` computed from `exp`. A backward
    pass divides other values by the sum too (log_softmax's cotangent `g / s`): the
    numerator must come from the exp."""
    if len(node.inputs) != 2 or node.op not in ("div", "mul"):
        return False
    x, divisor = node.inputs
    if node.op == "mul":
        x, divisor = (x, divisor) if _sum_of(divisor, sums, inverted=True) else (divisor, x)
    return (_sum_of(divisor, sums, inverted=node.op == "mul")
            and _derives_from(x, {id(exp)}))


def _sum_of(node: Node, sums: set[int], inverted: bool = False) -> bool:
    """`node` is one of `sums` (`1 / s` of one when `inverted`) through layout ops and
    constant guards (`max(s, eps)`, `s + eps`)."""
    while id(node) not in sums:
        constant = [i for i in node.inputs if uniform_value(i) is not None]
        if node.op in LAYOUT_OPS and node.inputs:
            node = node.inputs[0]
        elif node.op in ("max", "add") and len(node.inputs) == 2 and len(constant) == 1:
            node = next(i for i in node.inputs if i is not constant[0])
        elif inverted and node.op == "div" and constant and constant[0] is node.inputs[0]:
            node, inverted = node.inputs[1], False
        elif inverted and node.op == "integer_pow" and node.params.get("y") == -1:
            node, inverted = node.inputs[0], False
        else:
            return False
    return not inverted


def _scores_side(exp: Node) -> tuple[Node | None, str | None]:
    """The nearest dot below `exp`, and the first op outside the chain vocabulary on the way
    to it (None when the way is clean)."""
    queue = deque([(exp.inputs[0], None)])
    visited = 0
    while queue and visited < _REACH:
        node, blocker = queue.popleft()
        visited += 1
        if node.op == "dot_general":
            return node, blocker
        if node.op in ("constant", "parameter", "iota") or not node.inputs:
            continue
        here = blocker
        if here is None and (node.op not in _CHAIN or node.op == "select" and _select_fill(node)
                             is None):
            here = _scores_blocker(node)
        for i in (node.inputs[1:] if node.op == "select" else node.inputs):
            queue.append((i, here))
    return None, None


def _select_fill(node: Node) -> float | None:
    values = [uniform_value(i) for i in node.inputs[1:]]
    return next((v for v in values if v is not None), None)


def _scores_blocker(node: Node) -> str:
    if node.op == "select":
        return "a where() between the scores and the softmax whose fill is not a constant"
    return f"a {node.op} between the scores and the softmax"


def _probs_side(exp: Node, users: dict[int, list[Node]]) -> tuple[Node | None, str | None]:
    """The nearest dot reading `exp` (through the normalization), and the first op on the
    way that is neither a layout op nor the normalization by exp's own sum."""
    sums = {id(u) for u in users[id(exp)] if u.op == "reduce_sum"}
    queue = deque([(exp, None)])
    visited, done = 0, set()
    while queue and visited < _REACH:
        node, blocker = queue.popleft()
        if id(node) in done:
            continue
        done.add(id(node))
        visited += 1
        for user in users[id(node)]:
            if user.op == "dot_general":
                return user, blocker
            if user.op == "reduce_sum" and id(user) in sums:
                continue  # the normalizer's own branch
            here = blocker
            if here is None and not _normalizes(user, node, sums, users):
                here = _probs_blocker(user, node)
            queue.append((user, here))
    return None, None


def _derives_from(node: Node, ids: set[int], depth: int = 6) -> bool:
    stack = [(node, 0)]
    while stack:
        n, d = stack.pop()
        if id(n) in ids:
            return True
        if d < depth:
            stack.extend((i, d + 1) for i in n.inputs)
    return False


def _normalizes(user: Node, prev: Node, sums: set[int], users) -> bool:
    """A layout op, a slice, `where(m, p, 0)`, or the division by (multiplication with the
    reciprocal of) exp's sum."""
    if user.op in LAYOUT_OPS or user.op == "slice":
        return True
    if user.op == "select" and any(uniform_value(i) == 0.0 for i in user.inputs[1:]
                                   if i is not prev):
        return True
    if user.op in ("div", "mul") and len(user.inputs) == 2:
        other = user.inputs[1] if user.inputs[0] is prev else user.inputs[0]
        # Dropout's keep / keep_prob and constant factors are part of a site (the pattern
        # says which constants it refuses): what blocks is further on.
        return (_derives_from(other, sums) or (user.op == "mul" and from_bits(other))
                or uniform_value(other) is not None)
    return False


def _probs_blocker(user: Node, prev: Node) -> str:
    if user.op == "select":
        return "a where() after the softmax that does not zero what it drops"
    if user.op in ("mul", "div") and len(user.inputs) == 2:
        other = user.inputs[1] if user.inputs[0] is prev else user.inputs[0]
        if drawn_from_bits(other):
            return "random values multiply the probabilities (not dropout's keep / keep_prob)"
        return ("the probabilities are multiplied by a tensor after the softmax (a head mask "
                "or dropout)")
    return f"a {user.op} between the softmax and the value dot"
