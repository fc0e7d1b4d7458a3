"""Rendering of diffs: neighbourhood pictures (hlotool's own layout, DOT for graphviz), the
self-contained HTML report, text pieces."""

from __future__ import annotations

import html.parser
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
from test_diff import NATIVE, REWRITTEN, SITE

from hlotool.report import render
from hlotool.passes.diff import FunctionDiff, SiteChange, by_site, diff_modules


# Optimized-HLO style: the native side computes its scores in a fusion.
FUSED = """HloModule fused

fused_scores {
  a = f32[4,8]{1,0} parameter(0)
  c = f32[4,8]{1,0} parameter(1)
  d = f32[4,4]{1,0} dot(a, c), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT x = f32[4,4]{1,0} exponential(d)
}

ENTRY main {
  q = f32[4,8]{1,0} parameter(0)
  k = f32[4,8]{1,0} parameter(1)
  f = f32[4,4]{1,0} fusion(q, k), kind=kOutput, calls=fused_scores
  w = f32[4,8]{1,0} parameter(2)
  o = f32[4,8]{1,0} dot(f, w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT t = f32[4,8]{1,0} tanh(o)
}
"""


def function_diff(before=NATIVE, after=REWRITTEN) -> FunctionDiff:
    d = diff_modules(before, after)
    nodes = set(d.removed)
    return FunctionDiff("f", "hlo", "cpu", d, by_site(d, [(SITE, nodes, set())]))


def test_categories_follow_hlo_graph_dumper():
    assert [render.category(op) for op in
            ("dot", "add", "exponential", "reduce", "custom-call", "parameter", "broadcast")] == \
        ["dot", "elementwise", "elementwise", "reduction", "custom-call", "parameter", "movement"]
    assert render.FILL["dot"] == "#7ba7e0" and render.FILL["elementwise"] == "#fff2a8"


def test_site_dot_colours_and_tooltips():
    f = function_diff()
    [change] = f.changes
    before = render.site_dot(f.diff, change, "before", hops=1)
    after = render.site_dot(f.diff, change, "after", hops=1)
    # 10 removed: 6 boxes outlined red, the constant written in the reduce that uses it,
    # the reducer named in that box (as XLA's dumper does); the custom call added, green;
    # kept neighbours grey.
    assert before.count('color="#d62728"') == 6
    assert 'label="reduce by maximum\\nf32[4]\\nwith -inf"' in before
    assert "subgraph cluster_" not in before and "label=max_r" not in before
    assert after.count('color="#2ca02c"') == 1
    assert "class=kept" in before and "class=kept" in after
    # The tooltip holds the full instruction text.
    assert 'tooltip="%s = f32[4,4]{1,0} dot(%q, %k), lhs_contracting_dims={1}, ' \
           'rhs_contracting_dims={1}\\nsource: unknown"' in before
    assert f'fillcolor="{render.FILL["custom-call"]}"' in after


def test_hops_bound_the_neighbourhood():
    f = function_diff()
    [change] = f.changes
    near = render.neighbourhood(f.diff, change, "after", hops=0)
    far = render.neighbourhood(f.diff, change, "after", hops=2)
    # hops=0: the custom call plus the kept instructions the removed ones touched
    # (q, k, w feed the dots; t read the second dot).
    assert sorted(n.split("/")[1] for n in near) == ["k", "o", "q", "t", "w"]
    assert sorted(n.split("/")[1] for n in far) == ["k", "o", "out", "q", "t", "w"]
    with pytest.raises(render.HlotoolError, match="hops must be >= 0, got -1"):
        render.neighbourhood(f.diff, change, "after", hops=-1)


def test_max_nodes_summarizes_the_rest():
    f = function_diff()
    [change] = f.changes
    text = render.site_dot(f.diff, change, "before", hops=2, max_nodes=4)
    assert text.count("fillcolor=") == 5  # 4 nodes + the note
    assert re.search(r'label="\d+ more nodes not drawn:\\n', text)


def test_fusion_drawn_as_cluster_with_its_whole_body():
    f = function_diff(FUSED, REWRITTEN.replace("ROOT out", "out_unused").replace(
        "  t = f32[4,8]{1,0} tanh(o)", "  ROOT t = f32[4,8]{1,0} tanh(o)"))
    change = SiteChange(None, f.diff.regions)
    text = render.site_dot(f.diff, change, "before", hops=0)
    cluster = text[text.index("subgraph cluster_"):]
    cluster = cluster[:cluster.index("\t}")]
    assert "label=fused_scores" in cluster
    assert cluster.count("tooltip=") == 4  # a, c, d, x
    assert 'label="fusion kOutput\\nf32[4,4]"' in text


def test_pictures_need_no_graphviz(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "")  # no `dot` to run
    page = render.html_report([function_diff()])
    assert len(re.findall(r"<svg\b", page)) == 2
    [svg] = render.write_pieces([function_diff()], str(tmp_path), "svg")[:1]
    ET.parse(svg)
    # Only PNG pieces hand the picture to `dot`; without it that is one line naming both ways.
    with pytest.raises(render.GraphvizMissing, match=r"^--format png needs graphviz's `dot` "
                       r"\(apt-get install graphviz\); --format svg, dot and txt and the HTML "
                       r"report work without it$"):
        render.write_pieces([function_diff()], str(tmp_path / "png"), "png")
    summary = render.text_summary([function_diff()])
    assert "site 1" in summary and "−10 instructions, +1 (1 custom-call flash)" in summary


def test_text_summary_lines():
    f = function_diff()
    assert render.text_summary([f]).splitlines() == [
        "f (hlo, cpu): −10 instructions, +1 (1 custom-call flash)",
        "  site 1: attention Lq=4, Lk=4 float32, mask none: "
        "−10 instructions, +1 (1 custom-call flash), L×L buffers 4 → 0",
    ]
    same = diff_modules(NATIVE, NATIVE)
    assert render.text_summary([FunctionDiff("g", "hlo", "cpu", same, [])]) == \
        "g (hlo, cpu): no change"


class _Collector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links, self.tags = set(), [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href", "").startswith("#"):
            self.links.append(attrs["href"][1:])


def test_html_report_is_self_contained_and_well_formed():
    page = render.html_report([function_diff(), function_diff(FUSED, FUSED)])
    parser = _Collector()
    parser.feed(page)
    parser.close()
    # One table row per site, each linking to its section; the unchanged site has no pictures.
    assert parser.links == ["f0-s0", "f1-s0"]
    assert set(parser.links) <= parser.ids
    svgs = re.findall(r"<svg\b.*?</svg>", page, re.S)
    assert len(svgs) == 2  # native and rewritten of the one site
    for svg in svgs:
        root = ET.fromstring(svg)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert "<script" not in page and "<link" not in page and " src=" not in page
    # The identical pair says so.
    assert "f: normalized HLO diff" in page and "<pre>no change</pre>" in page


def test_write_pieces(tmp_path):
    f = function_diff()
    svgs = render.write_pieces([f], str(tmp_path / "svg"), "svg", hops=1)
    assert [p.rsplit("/", 1)[1] for p in svgs] == ["f.site1.native.svg", "f.site1.rewritten.svg"]
    for p in svgs:
        ET.parse(p)
    if shutil.which("dot"):  # PNG pieces are graphviz's (test_pictures_need_no_graphviz)
        pngs = render.write_pieces([f], str(tmp_path / "png"), "png")
        assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in pngs)
    [txt] = render.write_pieces([f], str(tmp_path / "txt"), "txt")
    assert "-  %dot.0 = f32[4,4]{1,0} dot(" in open(txt).read()
    with pytest.raises(render.HlotoolError,
                       match="unknown format 'gif'; valid formats: svg, png, dot, txt"):
        render.write_pieces([f], str(tmp_path), "gif")


def _two_layers(body: str) -> str:
    """A module running `body` (the ENTRY of NATIVE or REWRITTEN) twice over the same
    parameters, each copy with its own reducer."""
    entry = body[body.index("ENTRY main {") + len("ENTRY main {\n"):body.rindex("}")]
    reducer = body[body.index("max_r {"):body.index("ENTRY")] if "max_r {" in body else ""
    layer2 = []
    for line in entry.splitlines():
        if "parameter(" in line:
            continue
        line = re.sub(r"\b(s|e|init|r|b|p|o|t|out)\b", r"\1_2", line)
        layer2.append(line.replace("max_r", "max_r2"))
    first = entry.replace("ROOT out", "out")
    return ("HloModule two\n\n" + reducer + reducer.replace("max_r {", "max_r2 {")
            + "ENTRY main {\n" + first + "\n".join(layer2) + "\n}\n")


def test_identical_sites_drawn_once():
    d = diff_modules(_two_layers(NATIVE), _two_layers(REWRITTEN))
    assert len(d.regions) == 2
    sites = [(SITE, set(r.removed), set()) for r in d.regions]
    page = render.html_report([FunctionDiff("f", "hlo", "cpu", d, by_site(d, sites))])
    assert len(re.findall(r"<svg\b", page)) == 2
    assert page.count("not drawn again") == 1
    assert '<a href="#f0-s0">the site drawn above</a>' in page
