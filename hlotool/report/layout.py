"""A layered layout of a small directed graph, top to bottom, in plain Python: the diff
report draws its pictures with it, so they need no graphviz binary.

The steps are Sugiyama's, each kept simple because a picture holds a few hundred boxes at
most: layers by longest path (a box without inputs moved down next to its first user),
a waypoint in every layer an edge crosses, the order within each layer by barycentre
sweeps (the order with the fewest crossings wins), and x positions by weighted least
squares towards each box's neighbours under the layer's spacing, solved exactly per layer
by pool-adjacent-violators. Boxes of any size; the caller nests clusters by laying each
out on its own and placing it here as one box of its size.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence

GAP = 14.0  # px between boxes of one layer
WAYPOINT_GAP = 4.0  # px beside an edge's waypoint
LAYER_GAP = 22.0  # px between layers
SWEEPS = 12
_WAYPOINT = 4.0  # width reserved for an edge passing through a layer


@dataclasses.dataclass
class Layout:
    """Where everything goes: `boxes[id]` = (left, top, width, height); each edge as the
    points it passes through, from the bottom of its tail to the top of its head."""

    width: float
    height: float
    boxes: dict[str, tuple[float, float, float, float]]
    edges: list[tuple[str, str, list[tuple[float, float]]]]


def layered(sizes: Mapping[str, tuple[float, float]], edges: Sequence[tuple[str, str]],
            wrap: float | None = None) -> Layout:
    """Lays out boxes of `sizes` (id → (width, height), in a preferred reading order) with
    `edges` (tail, head) pointing down. Self-loops and repeats are dropped; a cycle is
    broken by drawing one of its edges upward. With `wrap`, unconnected parts are laid out
    on their own and placed left to right in rows at most `wrap` px wide (a part wider
    than that gets a row of its own)."""
    edges = list(dict.fromkeys((u, v) for u, v in edges
                               if u != v and u in sizes and v in sizes))
    parts = _components(list(sizes), edges) if wrap else [list(sizes)]
    if len(parts) <= 1:
        return _layered(sizes, edges)
    placed = []
    x = y = row_height = 0.0
    for part in parts:
        members = set(part)
        sub = _layered({n: sizes[n] for n in part},
                       [(u, v) for u, v in edges if u in members])
        if x and x + sub.width > wrap:
            x, y, row_height = 0.0, y + row_height + LAYER_GAP, 0.0
        placed.append((sub, x, y))
        x += sub.width + 2 * GAP
        row_height = max(row_height, sub.height)
    boxes = {n: (bx + dx, by + dy, bw, bh) for sub, dx, dy in placed
             for n, (bx, by, bw, bh) in sub.boxes.items()}
    routes = [(u, v, [(px + dx, py + dy) for px, py in pts]) for sub, dx, dy in placed
              for u, v, pts in sub.edges]
    return Layout(max(sub.width + dx for sub, dx, _ in placed), y + row_height, boxes, routes)


def _components(ids: list[str], edges: list[tuple[str, str]]) -> list[list[str]]:
    """The weakly connected parts of the graph, each in reading order, by first member."""
    parent = {n: n for n in ids}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for u, v in edges:
        parent[find(u)] = find(v)
    parts: dict[str, list[str]] = {}
    for n in ids:
        parts.setdefault(find(n), []).append(n)
    return list(parts.values())


def _layered(sizes: Mapping[str, tuple[float, float]],
             edges: list[tuple[str, str]]) -> Layout:
    ids = list(sizes)
    index = {n: i for i, n in enumerate(ids)}
    down = _acyclic(ids, edges)
    layer = _layers(ids, down)
    chains, width, level = _waypoints(ids, sizes, down, layer)
    rows = _order(ids, index, chains, level)
    x = _positions(rows, chains, width)
    tops, heights = [], []
    y = 0.0
    for row in rows:
        h = max((sizes[n][1] for n in row if n in sizes), default=0.0)
        tops.append(y)
        heights.append(h)
        y += h + LAYER_GAP
    boxes = {}
    for r, row in enumerate(rows):
        for n in row:
            if n in sizes:
                w, h = sizes[n]
                boxes[n] = (x[n] - w / 2, tops[r] + (heights[r] - h) / 2, w, h)
    left = min((b[0] for b in boxes.values()), default=0.0)
    left = min([left, *(x[p] - _WAYPOINT / 2 for c in chains.values() for p in c[1:-1])])
    boxes = {n: (bx - left, by, bw, bh) for n, (bx, by, bw, bh) in boxes.items()}
    points = _routes(edges, down, chains, x, level, tops, heights, boxes, left)
    right = max((bx + bw for bx, _, bw, _ in boxes.values()), default=0.0)
    right = max([right, *(px for _, _, pts in points for px, _ in pts)])
    return Layout(right, max(y - LAYER_GAP, 0.0), boxes, points)


def _acyclic(ids: list[str], edges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`edges` with those that close a cycle turned around (depth-first, in `ids` order)."""
    out: dict[str, list[str]] = {n: [] for n in ids}
    for u, v in edges:
        out[u].append(v)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    back = set()
    for start in ids:
        if start in state:
            continue
        stack = [(start, iter(out[start]))]
        state[start] = 1
        while stack:
            n, pending = stack[-1]
            m = next(pending, None)
            if m is None:
                state[n] = 2
                stack.pop()
            elif state.get(m) == 1:
                back.add((n, m))
            elif m not in state:
                state[m] = 1
                stack.append((m, iter(out[m])))
    return [(v, u) if (u, v) in back else (u, v) for u, v in edges]


def _layers(ids: list[str], down: list[tuple[str, str]]) -> dict[str, int]:
    preds: dict[str, list[str]] = {n: [] for n in ids}
    succs: dict[str, list[str]] = {n: [] for n in ids}
    for u, v in down:
        preds[v].append(u)
        succs[u].append(v)
    layer: dict[str, int] = {}
    order = []
    waiting = {n: len(preds[n]) for n in ids}
    ready = [n for n in ids if not waiting[n]]
    while ready:
        n = ready.pop(0)
        order.append(n)
        layer[n] = max((layer[p] + 1 for p in preds[n]), default=0)
        for s in succs[n]:
            waiting[s] -= 1
            if not waiting[s]:
                ready.append(s)
    # A box without inputs (a parameter, a constant) sits right above its first user.
    for n in reversed(order):
        if not preds[n] and succs[n]:
            layer[n] = min(layer[s] for s in succs[n]) - 1
    low = min(layer.values(), default=0)
    return {n: k - low for n, k in layer.items()}


def _waypoints(ids, sizes, down, layer):
    """Each edge as the chain of items it passes, one per layer (its ends and a waypoint
    in each layer between); the width of every item and its layer."""
    width = {n: sizes[n][0] for n in ids}
    level = dict(layer)
    chains = {}
    for k, (u, v) in enumerate(down):
        chain = [u]
        for depth in range(layer[u] + 1, layer[v]):
            p = f"\0{k}.{depth}"
            width[p], level[p] = _WAYPOINT, depth
            chain.append(p)
        chains[(u, v)] = [*chain, v]
    return chains, width, level


def _order(ids, index, chains, level) -> list[list[str]]:
    """Items of each layer, left to right: barycentre sweeps from a first order by reading
    order, keeping the order with the fewest crossings."""
    rows: list[list[str]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for item in sorted(level, key=lambda n: (index.get(n, len(index)), n)):
        rows[level[item]].append(item)
    above: dict[str, list[str]] = {n: [] for n in level}
    below: dict[str, list[str]] = {n: [] for n in level}
    for chain in chains.values():
        for a, b in zip(chain, chain[1:]):
            below[a].append(b)
            above[b].append(a)
    # Waypoints start beside their edge's tail, so the first sweep begins untangled.
    for r in range(1, len(rows)):
        place = {n: i for i, n in enumerate(rows[r - 1])}
        rows[r].sort(key=lambda n: _mean([place[m] for m in above[n]], -1.0))
    best, fewest = [list(r) for r in rows], _crossings(rows, below)
    for sweep in range(SWEEPS):
        downward = sweep % 2 == 0
        span = range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)
        for r in span:
            ref = rows[r - 1] if downward else rows[r + 1]
            place = {n: i for i, n in enumerate(ref)}
            near = above if downward else below
            current = {n: i for i, n in enumerate(rows[r])}
            rows[r].sort(key=lambda n: _mean([place[m] for m in near[n]], current[n]))
        count = _crossings(rows, below)
        if count < fewest:
            best, fewest = [list(r) for r in rows], count
        if not fewest:
            break
    return best


def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default


def _crossings(rows: list[list[str]], below: dict[str, list[str]]) -> int:
    total = 0
    for r in range(len(rows) - 1):
        place = {n: i for i, n in enumerate(rows[r + 1])}
        ends = sorted((i, place[b]) for i, a in enumerate(rows[r]) for b in below[a])
        seen: list[int] = []
        for _, j in ends:
            total += len(seen) - bisect.bisect_right(seen, j)
            bisect.insort(seen, j)
    return total


def _positions(rows, chains, width) -> dict[str, float]:
    """Centre x of every item: packed first, then pulled towards the mean of its
    neighbours above, below, and both, layer by layer (long edges pull hardest, so they
    run straight)."""
    near: dict[str, list[tuple[str, float, bool]]] = {n: [] for row in rows for n in row}
    for chain in chains.values():
        for a, b in zip(chain, chain[1:]):
            weight = 1.0 + 3.0 * (_is_waypoint(a) + _is_waypoint(b))
            near[a].append((b, weight, False))
            near[b].append((a, weight, True))
    x: dict[str, float] = {}
    for row in rows:
        at = 0.0
        for i, n in enumerate(row):
            at += _gap(row, i, width) if i else width[n] / 2
            x[n] = at
    for sweep in range(8):
        side = (True, False, None)[sweep % 3] if sweep < 6 else None
        order = range(len(rows)) if side is not False else range(len(rows) - 1, -1, -1)
        for r in order:
            row = rows[r]
            targets, weights = [], []
            for n in row:
                pulls = [(x[m], w) for m, w, up in near[n] if side is None or up == side]
                total = sum(w for _, w in pulls)
                if total:
                    targets.append(sum(p * w for p, w in pulls) / total)
                    weights.append(total)
                else:
                    targets.append(x[n])
                    weights.append(0.01)
            for n, value in zip(row, _spread(row, targets, weights, width)):
                x[n] = value
    return x


def _is_waypoint(item: str) -> bool:
    return item.startswith("\0")


def _gap(row: list[str], i: int, width: dict[str, float]) -> float:
    """Distance between the centres of row[i - 1] and row[i]."""
    a, b = row[i - 1], row[i]
    space = WAYPOINT_GAP if _is_waypoint(a) or _is_waypoint(b) else GAP
    return (width[a] + width[b]) / 2 + space


def _spread(row, targets, weights, width) -> list[float]:
    """x minimizing Σ weight·(x − target)² with every item at least its gap right of the
    one before (pool-adjacent-violators on x minus the cumulative gaps)."""
    offsets = [0.0]
    for i in range(1, len(row)):
        offsets.append(offsets[-1] + _gap(row, i, width))
    blocks: list[list[float]] = []  # [weight, weighted sum, count]
    for t, w, off in zip(targets, weights, offsets):
        blocks.append([w, w * (t - off), 1])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
            w2, s2, c2 = blocks.pop()
            blocks[-1][0] += w2
            blocks[-1][1] += s2
            blocks[-1][2] += c2
    out = []
    for w, s, c in blocks:
        out.extend([s / w] * c)
    return [y + off for y, off in zip(out, offsets)]


def _routes(edges, down, chains, x, level, tops, heights, boxes, left):
    """Each edge's points: out of the bottom of its tail and into the top of its head,
    the ends of several edges at one box spread along its side, in the order of the
    boxes they come from."""
    ports_out: dict[str, list[tuple[float, str, str]]] = {}
    ports_in: dict[str, list[tuple[float, str, str]]] = {}
    for u, v in down:
        chain = chains[(u, v)]
        ports_out.setdefault(u, []).append((x[chain[1]], u, v))
        ports_in.setdefault(v, []).append((x[chain[-2]], u, v))

    def spread(ports: dict[str, list[tuple[float, str, str]]]) -> dict[tuple, float]:
        at = {}
        for n, found in ports.items():
            found.sort()
            step = min(12.0, boxes[n][2] / (len(found) + 1))
            for i, (_, u, v) in enumerate(found):
                at[(u, v)] = boxes[n][0] + boxes[n][2] / 2 + (i - (len(found) - 1) / 2) * step
        return at

    start, end = spread(ports_out), spread(ports_in)
    out = []
    for (u, v), (du, dv) in zip(edges, down):
        chain = chains[(du, dv)]
        pts = [(start[(du, dv)], boxes[du][1] + boxes[du][3])]
        for p in chain[1:-1]:
            r = level[p]
            pts += [(x[p] - left, tops[r]), (x[p] - left, tops[r] + heights[r])]
        pts.append((end[(du, dv)], boxes[dv][1]))
        out.append((u, v, pts if (u, v) == (du, dv) else pts[::-1]))
    return out
