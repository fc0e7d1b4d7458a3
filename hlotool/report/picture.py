"""A picture of part of a graph, independent of how it is drawn: boxes with labels, colours
and tooltips, clusters (one level: the bodies of fusions and loops), edges and a note.
`svg` draws it with hlotool's own layout (`hlotool.report.layout`), so it needs nothing
installed; `dot` writes it as Graphviz source, for `--format dot` and for `dot -Tpng`.
"""

from __future__ import annotations

import dataclasses
import html

import graphviz

from hlotool.report import layout

FONT = "DejaVu Sans Mono,Menlo,Consolas,monospace"
FONT_PX = 11.0  # labels of the boxes; the browser test checks they stay >= 9 px on screen
CHAR_PX = 0.6 * FONT_PX  # advance of one character of a monospace font
LINE_PX = 14.0
PAD_X, PAD_Y = 8.0, 5.0
KERNEL_FONT_PX = 13.0
CLUSTER_PAD = 10.0
TITLE_PX = 18.0
WRAP_PX = 720.0  # unconnected parts of a picture wrap into rows about one pane wide


@dataclasses.dataclass
class Node:
    label: str  # lines separated by "\n"
    fill: str
    outline: str
    status: str  # CSS class: kept | removed | added | kernel | note
    tooltip: str = ""
    thick: bool = False


@dataclasses.dataclass
class Picture:
    title: str = ""
    nodes: dict[str, Node] = dataclasses.field(default_factory=dict)  # in reading order
    clusters: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # label → ids
    edges: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)  # dashed?


# ----------------------------------------------------------------------------- svg


def _size(node: Node) -> tuple[float, float]:
    lines = node.label.split("\n")
    px = KERNEL_FONT_PX if node.status == "kernel" else FONT_PX
    w = max(map(len, lines)) * 0.6 * px + 2 * PAD_X
    h = len(lines) * LINE_PX * px / FONT_PX + 2 * PAD_Y
    return (w + 12, h + 12) if node.status == "kernel" else (w, h)


def _text(node: Node, x: float, y: float, w: float) -> str:
    px = KERNEL_FONT_PX if node.status == "kernel" else FONT_PX
    weight = ' font-weight="bold"' if node.status == "kernel" else ""
    rows = []
    for i, line in enumerate(node.label.split("\n")):
        base = y + PAD_Y + (i + 0.8) * LINE_PX * px / FONT_PX
        rows.append(f'<text x="{x + w / 2:.1f}" y="{base:.1f}" font-size="{px:g}"{weight}>'
                    f"{html.escape(line)}</text>")
    return "".join(rows)


def _box(node: Node, x: float, y: float, w: float, h: float) -> str:
    title = f"<title>{html.escape(node.tooltip)}</title>" if node.tooltip else ""
    stroke = 3 if node.thick else 1
    if node.status == "kernel":
        # Drawn as a stack, as XLA's dumper draws a custom call's box: one box, more inside.
        x, y, w, h = x, y + 6, w - 6, h - 6
        shape = (f'<rect x="{x + 6:.1f}" y="{y - 6:.1f}" width="{w:.1f}" height="{h:.1f}" '
                 f'rx="4" fill="{node.fill}" stroke="{node.outline}" stroke-width="2"/>'
                 f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="4" '
                 f'fill="{node.fill}" stroke="{node.outline}" stroke-width="{stroke}"/>')
    else:
        dash = ' stroke-dasharray="4 3"' if node.status == "note" else ""
        shape = (f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="5" '
                 f'fill="{node.fill}" stroke="{node.outline}" stroke-width="{stroke}"{dash}/>')
    return f'<g class="node {node.status}">{title}{shape}{_text(node, x, y, w)}</g>'


def _path(points: list[tuple[float, float]], dx: float, dy: float, dashed: bool) -> str:
    """A smooth curve through `points`, leaving and entering each vertically."""
    (x0, y0), rest = points[0], points[1:]
    d = [f"M{x0 + dx:.1f},{y0 + dy:.1f}"]
    for x1, y1 in rest:
        mid = (y1 - y0) / 2
        d.append(f"C{x0 + dx:.1f},{y0 + mid + dy:.1f} {x1 + dx:.1f},{y1 - mid + dy:.1f} "
                 f"{x1 + dx:.1f},{y1 + dy:.1f}")
        x0, y0 = x1, y1
    dash = ' stroke-dasharray="5 4"' if dashed else ""
    return f'<path d="{" ".join(d)}"{dash} marker-end="url(#arrow)"/>'


@dataclasses.dataclass(frozen=True)
class Drawing:
    """A laid-out picture: its size in px at scale 1 and its SVG elements."""

    width: float
    height: float
    body: str

    def svg(self, scale: float = 1.0) -> str:
        """One standalone SVG element, drawn at `scale` (its viewBox keeps it whole)."""
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width * scale:.0f}" '
                f'height="{self.height * scale:.0f}" viewBox="0 0 {self.width:.0f} '
                f'{self.height:.0f}" font-family="{FONT}" text-anchor="middle">{self.body}'
                "</svg>")


def draw(picture: Picture) -> Drawing:
    """Lays the picture out: each cluster on its own, then each cluster as one box among
    the other nodes (an edge into or out of a cluster meets its border)."""
    where = {n: c for c, members in picture.clusters.items() for n in members}
    inner = {c: layout.layered({n: _size(picture.nodes[n]) for n in members},
                               [(u, v) for u, v, _ in picture.edges
                                if where.get(u) == c and where.get(v) == c])
             for c, members in picture.clusters.items()}

    def top(n: str) -> str:
        return f"\0cluster:{where[n]}" if n in where else n

    sizes = {}
    for n, node in picture.nodes.items():
        if n not in where:
            sizes[n] = _size(node)
        elif top(n) not in sizes:
            c = where[n]
            sizes[top(n)] = (max(inner[c].width, len(c) * CHAR_PX) + 2 * CLUSTER_PAD,
                             inner[c].height + 2 * CLUSTER_PAD + LINE_PX)
    dashed = {(u, v): d for u, v, d in picture.edges}
    dashed.update({(top(u), top(v)): d for u, v, d in picture.edges})
    outer = layout.layered(sizes, [(top(u), top(v)) for u, v, _ in picture.edges], WRAP_PX)
    head = TITLE_PX + 8 if picture.title else 4.0
    width = max(outer.width, len(picture.title) * 0.6 * 13) + 8
    paths, boxes = [], []
    if picture.title:
        boxes.append(f'<text class="title" x="{width / 2:.1f}" y="{TITLE_PX:.1f}" '
                     f'font-size="13">{html.escape(picture.title)}</text>')
    paths += [_path(points, 4, head, dashed[(u, v)]) for u, v, points in outer.edges]
    for c, sub in inner.items():
        x, y, w, h = outer.boxes[f"\0cluster:{c}"]
        x, y = x + 4, y + head
        boxes.append(f'<g class="cluster"><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
                     f'height="{h:.1f}" rx="6" fill="none" stroke="#7f7f7f" '
                     f'stroke-dasharray="5 3"/><text x="{x + w / 2:.1f}" '
                     f'y="{y + LINE_PX:.1f}" font-size="{FONT_PX:g}">{html.escape(c)}</text>'
                     "</g>")
        ox, oy = x + CLUSTER_PAD, y + CLUSTER_PAD + LINE_PX
        paths += [_path(points, ox, oy, dashed[(u, v)]) for u, v, points in sub.edges]
        boxes += [_box(picture.nodes[n], bx + ox, by + oy, bw, bh)
                  for n, (bx, by, bw, bh) in sub.boxes.items()]
    boxes += [_box(picture.nodes[n], bx + 4, by + head, bw, bh)
              for n, (bx, by, bw, bh) in outer.boxes.items() if n in picture.nodes]
    return Drawing(width, outer.height + head + 4, (
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,1L10,5L0,9z" fill="#555"/></marker>'
        f'</defs><g fill="none" stroke="#555" stroke-width="1.2">{"".join(paths)}</g>'
        f'<g fill="#222">{"".join(boxes)}</g>'))


# ----------------------------------------------------------------------------- dot


def _dot_text(text: str) -> str:
    """`text` for a DOT label or tooltip: its backslashes and <...> literal, its lines
    joined with DOT's own line break."""
    return "\\n".join(graphviz.escape(line) for line in text.split("\n"))


def dot(picture: Picture) -> str:
    """The picture as Graphviz source (for `--format dot`, and `dot -Tpng`)."""
    title = {"label": _dot_text(picture.title), "labelloc": "t"} if picture.title else {}
    g = graphviz.Digraph(
        "G", graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11",
                         "nodesep": "0.25", "ranksep": "0.35", **title},
        node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                   "fontsize": "10"},
        edge_attr={"color": "#555555", "arrowsize": "0.6"})
    ids = {n: f"n{i}" for i, n in enumerate(picture.nodes)}

    def add(target: graphviz.Digraph, n: str) -> None:
        node = picture.nodes[n]
        shape = {"kernel": {"shape": "box3d", "fontsize": "12"},
                 "note": {"shape": "note", "style": "filled"}}.get(node.status, {})
        target.node(ids[n], label=_dot_text(node.label), tooltip=_dot_text(node.tooltip),
                    fillcolor=node.fill, color=node.outline,
                    penwidth="3" if node.thick else "1", **shape, **{"class": node.status})

    clustered = {n for members in picture.clusters.values() for n in members}
    for n in picture.nodes:
        if n not in clustered:
            add(g, n)
    for k, (label, members) in enumerate(picture.clusters.items()):
        with g.subgraph(name=f"cluster_{k}", graph_attr={
                "label": _dot_text(label), "style": "rounded,dashed", "color": "#7f7f7f",
                "fontsize": "10"}) as cluster:
            for n in members:
                add(cluster, n)
    for u, v, dashed in picture.edges:
        g.edge(ids[u], ids[v], **({"style": "dashed"} if dashed else {}))
    return g.source
