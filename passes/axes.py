"""Following axis labels through layout ops, forwards and backwards.

A label set is attached to every axis of a value: `frozenset` of tokens naming the axes of
the attention's dot products the axis carries (("b", i) the i-th batch dim of Q·Kᵀ, ("c", j)
its j-th contracting dim, ("l", a) / ("r", a) a free dim of its left / right operand,
("dv", a) a free dim of V). Merging axes with a reshape unions their labels; unit axes carry
none. This is how the softmax axis, the key axis and q/k/v layouts are identified whatever
transposes, reshapes and broadcasts a program puts around its dots.
"""

from __future__ import annotations

from hlotool.passes.graph import Node

Labels = tuple[frozenset, ...]
EMPTY: frozenset = frozenset()


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
            merged = frozenset().union(*(labels[i] for i in ga))
            for j in gb:
                out[j] = merged
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
            merged = frozenset().union(*(labels[j] for j in gb))
            for i in ga:
                out[i] = merged
        return tuple(out), []
    if len(src) != len(node.shape):
        return None
    return labels, []
