"""Following axis labels through layout ops, forwards and backwards.

A label set is attached to every axis of a value: `frozenset` of tokens naming the axes of
the attention's dot products the axis carries (("b", i) the i-th batch dim of Q·Kᵀ, ("c", j)
its j-th contracting dim, ("l", a) / ("r", a) a free dim of its left / right operand,
("dv", a) a free dim of V). Merging axes with a reshape unions their labels; unit axes carry
none. This is how the softmax axis, the key axis and q/k/v layouts are identified whatever
transposes, reshapes and broadcasts a program puts around its dots.

An axis split in several (batch and heads merged as [B·H, L, D], split back as [B, H, ...])
gives each piece the merged labels plus a part token `("part", token, i)`: piece i, outer
first. Transposes carry it with its axis, so which piece is the batch and which the heads is
known wherever they end up (both pieces carry the same token, and may have equal sizes).
Merging the pieces back drops the part tokens.
"""

from __future__ import annotations

from hlotool.passes.graph import Node

Labels = tuple[frozenset, ...]
EMPTY: frozenset = frozenset()


def is_part(token: tuple) -> bool:
    return token[0] == "part"


def without_parts(label: frozenset) -> frozenset:
    return frozenset(t for t in label if not is_part(t))


def part_of(label: frozenset, token: tuple) -> int | None:
    """Which piece of `token` an axis is, when `token` was split over several axes."""
    return next((t[2] for t in label if is_part(t) and t[1] == token), None)


def _regroup(labels: list[frozenset], into: int) -> list[frozenset]:
    """The labels of `into` axes made from the axes carrying `labels` (outer first): merged
    into one (part tokens of a complete set of pieces dropped), or one axis split in pieces."""
    merged = frozenset().union(*labels)
    if into == 1:
        parts = [t for t in merged if is_part(t)]
        whole = {t[1] for t in parts}
        if len(labels) > 1 and all(
                {p[2] for p in parts if p[1] == t} == set(range(len(labels))) for t in whole):
            merged = without_parts(merged)
        return [merged]
    if len(labels) != 1:
        return [merged] * into
    base = labels[0]
    return [base | {("part", t, i) for t in base if not is_part(t)} for i in range(into)]


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]
                   ) -> list[tuple[list[int], list[int]]] | None:
    """Pairs (src axes, dst axes) of non-unit axes whose sizes multiply to the same value."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [j for j, n in enumerate(dst) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(a[i]); pa *= src[a[i]]; i += 1
            elif pb < pa and j < len(b):
                gb.append(b[j]); pb *= dst[b[j]]; j += 1
            else:
                return None
        groups.append((ga, gb))
    return groups if i == len(a) and j == len(b) else None


def forward(node: Node, labels: Labels) -> Labels | None:
    """Labels of `node`'s axes given those of the operand that carries the chain.

    Elementwise ops keep labels; returns None for an op that cannot be followed.
    """
    op, src = node.op, node.inputs[0].shape if node.inputs else ()
    if op == "transpose":
        return tuple(labels[p] for p in node.params["perm"])
    if op == "broadcast":
        out = [EMPTY] * len(node.shape)
        for i, d in enumerate(node.params["dims"]):
            out[d] = labels[i] if src[i] == node.shape[d] else EMPTY
        return tuple(out)
    if op == "reshape":
        groups = reshape_groups(src, node.shape)
        if groups is None:
            return None
        out = [EMPTY] * len(node.shape)
        for ga, gb in groups:
            for j, label in zip(gb, _regroup([labels[i] for i in ga], len(gb))):
                out[j] = label
        return tuple(out)
    if len(labels) != len(node.shape):
        return None
    return labels


def backward(node: Node, labels: Labels) -> tuple[Labels, list[tuple[int, frozenset]]] | None:
    """Labels of `node.inputs[0]`'s axes given those of `node`'s axes.

    Also returns the output axes a broadcast created or expanded from size 1, with their
    labels (the data there is repeated, not read from the operand). None if not followable.
    """
    op, src = node.op, node.inputs[0].shape
    if op == "transpose":
        out = [EMPTY] * len(src)
        for i, p in enumerate(node.params["perm"]):
            out[p] = labels[i]
        return tuple(out), []
    if op == "broadcast":
        dims = node.params["dims"]
        created = [(d, labels[d]) for d in range(len(node.shape)) if d not in dims]
        created += [(d, labels[d]) for i, d in enumerate(dims)
                    if src[i] == 1 and node.shape[d] != 1]
        return tuple(labels[d] for d in dims), created
    if op == "reshape":
        groups = reshape_groups(src, node.shape)
        if groups is None:
            return None
        out = [EMPTY] * len(src)
        for ga, gb in groups:
            for i, label in zip(ga, _regroup([labels[j] for j in gb], len(ga))):
                out[i] = label
        return tuple(out), []
    if len(src) != len(node.shape):
        return None
    return labels, []
