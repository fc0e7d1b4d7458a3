"""hlotool's own graph layout (report/layout.py) and SVG drawing (report/picture.py): the
diff report's pictures without graphviz."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET

from hlotool.report import layout, picture


def _overlap(a, b) -> bool:
    (ax, ay, aw, ah), (bx, by, bw, bh) = a, b
    return ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah


def _check(result: layout.Layout, sizes) -> None:
    """Every box whole, of its size, inside the drawing, none over another."""
    assert set(result.boxes) == set(sizes)
    for n, (x, y, w, h) in result.boxes.items():
        assert (w, h) == sizes[n]
        assert x >= -1e-6 and y >= -1e-6
        assert x + w <= result.width + 1e-6 and y + h <= result.height + 1e-6
    for a, b in itertools.combinations(result.boxes.values(), 2):
        assert not _overlap(a, b), (a, b)


# A diamond with a long edge a→e and an input that only e reads.
SIZES = {"a": (60, 30), "b": (140, 30), "c": (40, 44), "d": (80, 30), "e": (100, 30),
         "w": (50, 30)}
EDGES = [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "e"), ("a", "e"), ("w", "e")]


def test_edges_point_down_and_boxes_never_overlap():
    result = layout.layered(SIZES, EDGES)
    _check(result, SIZES)
    box = result.boxes
    for u, v, points in result.edges:
        assert box[u][1] + box[u][3] < box[v][1]  # head below tail
        (x0, y0), (x1, y1) = points[0], points[-1]
        assert y0 == box[u][1] + box[u][3] and box[u][0] <= x0 <= box[u][0] + box[u][2]
        assert y1 == box[v][1] and box[v][0] <= x1 <= box[v][0] + box[v][2]
    # The long edge a→e passes the two layers between through waypoints.
    [long] = [p for u, v, p in result.edges if (u, v) == ("a", "e")]
    assert len(long) == 6
    # An input read by one box only sits in the layer right above it, not at the top.
    assert box["w"][1] == box["d"][1]


def test_boxes_of_one_layer_keep_their_gap():
    sizes = {f"n{i}": (30 + 10 * i, 20) for i in range(6)}
    result = layout.layered({"top": (40, 20), **sizes}, [("top", n) for n in sizes])
    row = sorted(result.boxes[n] for n in sizes)
    for (x0, _, w0, _), (x1, _, _, _) in zip(row, row[1:]):
        assert x1 - (x0 + w0) >= layout.GAP - 1e-6
    # The one box above sits at the mean of the centres of the ones it feeds.
    top = result.boxes["top"]
    centre = sum(x + w / 2 for x, _, w, _ in row) / len(row)
    assert abs(top[0] + top[2] / 2 - centre) < 1.0


def test_crossings_are_untangled():
    # Reading order puts x's user right and y's left; the layout swaps them.
    sizes = {n: (40, 20) for n in ("x", "y", "uy", "ux")}
    result = layout.layered(sizes, [("x", "ux"), ("y", "uy")])
    box = result.boxes
    assert (box["x"][0] < box["y"][0]) == (box["ux"][0] < box["uy"][0])


def test_a_cycle_is_drawn_with_one_edge_upward():
    sizes = {n: (40, 20) for n in "abc"}
    result = layout.layered(sizes, [("a", "b"), ("b", "c"), ("c", "a")])
    _check(result, sizes)
    assert len(result.edges) == 3
    ups = [(u, v) for u, v, pts in result.edges if pts[-1][1] < pts[0][1]]
    assert ups == [("c", "a")]


def test_unconnected_parts_wrap_into_rows():
    sizes = {f"n{i}": (100, 20) for i in range(10)}
    result = layout.layered(sizes, [], wrap=400)
    _check(result, sizes)
    assert result.width <= 400
    assert len({y for _, y, _, _ in result.boxes.values()}) == 4  # 3 + 3 + 3 + 1 per row
    assert layout.layered({}, [], wrap=400) == layout.Layout(0.0, 0.0, {}, [])


def _picture() -> picture.Picture:
    pic = picture.Picture("a title")
    for n, status in (("p", "kept"), ("f", "removed"), ("x", "removed"), ("y", "removed"),
                      ("k", "kernel"), ("<&>", "added")):
        pic.nodes[n] = picture.Node(f"{n}\nf32[4]", "#ffffff", "#d62728", status,
                                    tooltip=f"tooltip of {n}")
    pic.clusters["body <1>"] = ["x", "y"]
    pic.edges += [("p", "f", False), ("x", "y", False), ("y", "f", True), ("f", "k", False),
                  ("k", "<&>", False)]
    return pic


def test_svg_is_well_formed_with_clusters_around_their_members():
    drawing = picture.draw(_picture())
    root = ET.fromstring(drawing.svg())
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    groups = {g.get("class"): g for g in root.iter(f"{ns}g") if g.get("class")}
    assert "node kernel" in groups and "node added" in groups
    assert groups["node added"].find(f"{ns}title").text == "tooltip of <&>"
    [cluster] = [g for g in root.iter(f"{ns}g") if g.get("class") == "cluster"]
    rect = cluster.find(f"{ns}rect")
    cx, cy = float(rect.get("x")), float(rect.get("y"))
    cw, ch = float(rect.get("width")), float(rect.get("height"))
    members = [g for g in root.iter(f"{ns}g") if g.get("class") == "node removed"
               and g.find(f"{ns}text").text in ("x", "y")]
    assert len(members) == 2
    for g in members:
        r = g.find(f"{ns}rect")
        x, y = float(r.get("x")), float(r.get("y"))
        assert cx <= x and x + float(r.get("width")) <= cx + cw
        assert cy <= y and y + float(r.get("height")) <= cy + ch
    assert len(root.findall(f".//{ns}path[@stroke-dasharray]")) == 1  # the call edge


def test_drawing_scales_by_its_size_not_its_coordinates():
    drawing = picture.draw(_picture())
    half = drawing.svg(0.5)
    width, view = re.search(r'width="(\d+)" height="\d+" viewBox="0 0 (\d+) ', half).groups()
    assert abs(int(width) - drawing.width / 2) <= 1 and abs(int(view) - drawing.width) <= 1


def test_dot_source_of_the_same_picture():
    source = picture.dot(_picture())
    # Labels are quoted strings, never HTML-like <...> labels.
    assert "subgraph cluster_0" in source and 'label="body <1>"' in source
    assert "shape=box3d" in source and "style=dashed" in source
    assert source.count(" -> ") == 5
