"""Pictures and text of a structural diff (`hlotool.passes.diff`): graphviz neighbourhoods of
each changed site, a self-contained HTML report, and a terminal summary.

Only a site's neighbourhood is drawn (the changed instructions plus `hops` operand/user
steps, at most `max_nodes` per side): `dot` needs over a minute for a 2,000-node module.
Fill colours follow XLA's hlo_graph_dumper by op category; the outline says what the
rewrite did (removed red, added green, kept grey).
"""

from __future__ import annotations

import collections
import concurrent.futures
import html
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

from hlotool.errors import HlotoolError, write_output
from hlotool.hlo.printer import print_instruction
from hlotool.passes.diff import ADDED, KEPT, REMOVED, FunctionDiff, ModuleDiff, SiteChange

FORMATS = ("svg", "png", "dot", "txt")
DEFAULT_HOPS = 2
DEFAULT_MAX_NODES = 150
_DOT_TIMEOUT_S = 120
_MAX_TOOLTIP_CHARS = 1500

# Op category → fill, after xla/service/hlo_graph_dumper.cc.
_DOTS = {"dot", "convolution", "ragged-dot"}
_REDUCTIONS = {"reduce", "reduce-window", "all-reduce", "reduce-scatter", "select-and-scatter"}
_MOVEMENT = {
    "broadcast", "transpose", "reshape", "bitcast", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reverse", "iota",
    "get-tuple-element", "tuple", "bitcast-convert",
}
_CONTROL = {"while", "conditional", "call", "fusion", "async-start", "async-done"}
FILL = {
    "dot": "#7ba7e0",  # blue
    "elementwise": "#fff2a8",  # yellow
    "reduction": "#d6b3f0",  # purple
    "custom-call": "#8fd694",  # green
    "parameter": "#ffc078",  # orange
    "constant": "#eeeeee",
    "movement": "#ffffff",
    "control": "#c9e6f0",
}
OUTLINE = {REMOVED: "#d62728", ADDED: "#2ca02c", KEPT: "#9a9a9a"}


class GraphvizMissing(HlotoolError):
    """The `dot` binary is not installed."""


def category(opcode: str) -> str:
    """The hlo_graph_dumper colour class of an opcode (a key of `FILL`)."""
    if opcode in _DOTS:
        return "dot"
    if opcode in _REDUCTIONS:
        return "reduction"
    if opcode == "custom-call":
        return "custom-call"
    if opcode == "parameter":
        return "parameter"
    if opcode == "constant":
        return "constant"
    if opcode in _MOVEMENT:
        return "movement"
    if opcode in _CONTROL:
        return "control"
    return "elementwise"


# ----------------------------------------------------------------------------- neighbourhood


def _walkable(diff: ModuleDiff, side: str, user: str, data: dict) -> bool:
    """Edges a neighbourhood grows along: operand uses, and into the bodies of changed
    fusions (a kept fusion is one node; reducers and loop bodies are drawn only when a
    change lies inside them)."""
    return data["kind"] == "operand" or _changed_fusion(diff, side, user)


def _changed_fusion(diff: ModuleDiff, side: str, node: str) -> bool:
    return diff.instruction(side, node).opcode == "fusion" and diff.status(side, node) != KEPT


def neighbourhood(diff: ModuleDiff, change: SiteChange, side: str,
                  hops: int = DEFAULT_HOPS) -> list[str]:
    """Node ids of `side` ("before" | "after") around `change`, nearest first: its changed
    nodes, the kept nodes its changes on the other side touch, everything within `hops`
    operand/user steps, and the whole body of every fusion among them."""
    if hops < 0:
        raise HlotoolError(f"hops must be >= 0, got {hops}")
    graph = diff.before_graph if side == "before" else diff.after_graph
    own, other = (change.removed, change.added) if side == "before" else \
        (change.added, change.removed)
    other_graph = diff.after_graph if side == "before" else diff.before_graph
    to_here = diff.reverse if side == "before" else diff.mapping
    seeds = set(own)
    for n in other:
        for w in (*other_graph.predecessors(n), *other_graph.successors(n)):
            if w in to_here:
                seeds.add(to_here[w])
    order = sorted(seeds, key=lambda n: diff.instruction(side, n).line)
    seen = dict.fromkeys(order)
    frontier = list(order)
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for u, v, d in (*graph.in_edges(n, data=True), *graph.out_edges(n, data=True)):
                w = u if v == n else v
                if w not in seen and _walkable(diff, side, v, d):
                    seen[w] = None
                    nxt.append(w)
        frontier = nxt
    # Whole bodies of changed fusions, so a drawn cluster is never cut in half.
    for n in list(seen):
        for u, v, d in graph.in_edges(n, data=True):
            if d["kind"] == "called" and _changed_fusion(diff, side, n):
                comp = graph.nodes[u]["computation"]
                seen.update(dict.fromkeys(diff.computation_nodes(side, comp)))
    return list(seen)


# ----------------------------------------------------------------------------- graphviz


def _dot_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _label(inst) -> str:
    shape = inst.shape
    dims = str(shape) if shape.is_tuple else \
        f"{shape.element_type}[{','.join(map(str, shape.dims))}]"
    if len(dims) > 40:
        dims = dims[:39] + "…"
    head = inst.opcode
    if inst.opcode == "custom-call":
        head = f"custom-call\n{inst.custom_call_target}"
    elif inst.opcode == "fusion":
        head = f"fusion {inst.attributes.get('kind', '')}".strip()
    elif inst.opcode == "constant" and inst.literal is not None and len(inst.literal) < 16:
        head = f"constant {inst.literal}"
    return f"{head}\n{dims}"


def _tooltip(inst) -> str:
    text = print_instruction(inst)
    if len(text) > _MAX_TOOLTIP_CHARS:
        text = text[:_MAX_TOOLTIP_CHARS] + f"… ({len(text)} chars)"
    try:
        source = inst.user_source
    except HlotoolError:
        source = None
    return f"{text}\nsource: {source or 'unknown'}"


def site_dot(diff: ModuleDiff, change: SiteChange, side: str, hops: int = DEFAULT_HOPS,
             max_nodes: int = DEFAULT_MAX_NODES, title: str = "") -> str:
    """Graphviz source of one side of a site's neighbourhood. Non-entry computations
    (fusion bodies, loop bodies) are clusters; a trailing note counts what was left out."""
    return _site_dot(diff, change, side, hops, max_nodes, title)[0]


def _site_dot(diff: ModuleDiff, change: SiteChange, side: str, hops: int, max_nodes: int,
              title: str = "") -> tuple[str, int]:
    """`site_dot`'s text and the size of the whole neighbourhood."""
    graph = diff.before_graph if side == "before" else diff.after_graph
    everything = neighbourhood(diff, change, side, hops)
    nodes = everything[:max_nodes]
    ids = {n: f"n{i}" for i, n in enumerate(nodes)}
    entry = (diff.before if side == "before" else diff.after).entry.name
    by_comp: dict[str, list[str]] = collections.defaultdict(list)
    for n in nodes:
        by_comp[graph.nodes[n]["computation"]].append(n)
    lines = [
        "digraph G {",
        "  graph [rankdir=TB, fontname=Helvetica, fontsize=11, nodesep=0.25, ranksep=0.35"
        + (f", label={_dot_string(title)}, labelloc=t" if title else "") + "];",
        "  node [shape=box, style=\"rounded,filled\", fontname=Helvetica, fontsize=9];",
        "  edge [color=\"#555555\", arrowsize=0.6];",
    ]

    def node_line(n: str) -> str:
        inst = diff.instruction(side, n)
        status = diff.status(side, n)
        width = 1 if status == KEPT else 3
        return (f"{ids[n]} [label={_dot_string(_label(inst))}, "
                f"tooltip={_dot_string(_tooltip(inst))}, "
                f"fillcolor=\"{FILL[category(inst.opcode)]}\", color=\"{OUTLINE[status]}\", "
                f"penwidth={width}, class=\"{status}\"];")

    for k, (comp, members) in enumerate(by_comp.items()):
        if comp == entry:
            lines.extend("  " + node_line(n) for n in members)
            continue
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(f"    label={_dot_string(comp)}; style=\"rounded,dashed\"; "
                     "color=\"#7f7f7f\"; fontsize=9;")
        lines.extend("    " + node_line(n) for n in members)
        lines.append("  }")
    for u in nodes:
        for _, v, d in graph.out_edges(u, data=True):
            if v in ids:
                style = "" if d["kind"] == "operand" else " [style=dashed]"
                lines.append(f"  {ids[u]} -> {ids[v]}{style};")
    if len(everything) > len(nodes):
        left = collections.Counter(graph.nodes[n]["opcode"] for n in everything[max_nodes:])
        note = f"{len(everything) - len(nodes)} more nodes not drawn: " + ", ".join(
            f"{op} ×{c}" for op, c in left.most_common(6))
        lines.append(f"  note [shape=note, style=filled, fillcolor=\"#fafafa\", "
                     f"label={_dot_string(note)}];")
    lines.append("}")
    return "\n".join(lines) + "\n", len(everything)


def run_dot(source: str, fmt: str = "svg") -> bytes:
    """`source` laid out by graphviz's `dot` as svg or png bytes."""
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizMissing(
            "graphviz's `dot` is not installed (apt-get install graphviz); "
            "the text diff (--format txt, or no -o) works without it")
    try:
        done = subprocess.run([exe, f"-T{fmt}"], input=source.encode(), capture_output=True,
                              timeout=_DOT_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise HlotoolError(f"dot took over {_DOT_TIMEOUT_S} s; draw fewer hops") from None
    if done.returncode != 0:
        first = done.stderr.decode(errors="replace").strip().splitlines()[:1]
        raise HlotoolError(f"dot failed: {first[0] if first else f'exit {done.returncode}'}")
    return done.stdout


# ----------------------------------------------------------------------------- text


def _site_title(change: SiteChange) -> str:
    s = change.site
    if s is None:
        return "changes outside any detected site"
    shape = f"q[{'×'.join(map(str, s.q_shape))}]" if s.q_shape else \
        f"Lq={s.q_len}, Lk={s.kv_len}"
    where = f" at {s.source}" if s.source else ""
    return f"attention {shape} {s.dtype}, mask {s.mask}{where}"


def change_line(f: FunctionDiff, change: SiteChange) -> str:
    return f.diff.stats(change.removed, change.added, change.site).line()


def text_summary(functions: Sequence[FunctionDiff]) -> str:
    """One header per function (whole-module counts) and one line per site."""
    out = []
    for f in functions:
        out.append(f"{f.function} ({f.stage}, {f.target}): {f.diff.stats().line()}")
        for k, change in enumerate(f.changes, 1):
            label = f"site {k}" if change.site is not None else "other"
            out.append(f"  {label}: {_site_title(change)}: {change_line(f, change)}")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- html

_SVG_HEAD = re.compile(r"\A.*?(?=<svg\b)", re.S)
_STYLE = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left}
.pair{display:flex;gap:16px;align-items:flex-start}
.pair>div{flex:1;overflow:auto;border:1px solid #ddd;padding:6px}
.pair svg{max-width:100%;height:auto}.note{color:#666;font-size:12px}
pre{font-size:11px;background:#fafafa;padding:8px;overflow:auto}
.d-{color:#b00}.d\\+{color:#070}.d\\@{color:#06c}
.legend span{display:inline-block;padding:2px 6px;margin-right:4px;border:1px solid #999;
font-size:12px}
"""


def _inline_svg(svg: bytes) -> str:
    """dot's SVG without its XML prolog and DOCTYPE, to sit inside HTML."""
    return _SVG_HEAD.sub("", svg.decode("utf-8"), count=1)


def _legend() -> str:
    cats = "".join(f'<span style="background:{c}">{html.escape(k)}</span>' for k, c in FILL.items())
    states = "".join(f'<span style="border:3px solid {c}">{s}</span>' for s, c in OUTLINE.items())
    return f'<p class="legend">{cats} &nbsp; {states}</p>'


def _diff_pre(text: str) -> str:
    rows = []
    for line in text.splitlines():
        cls = {"-": "d-", "+": "d+", "@": "d@"}.get(line[:1])
        esc = html.escape(line)
        rows.append(f'<span class="{cls}">{esc}</span>' if cls else esc)
    return "<pre>" + "\n".join(rows) + "</pre>"


def _signature(diff: ModuleDiff, change: SiteChange) -> tuple:
    """What a change looks like, names aside: layers built by one piece of code change alike
    and are drawn once."""
    def ops(side: str, nodes: set[str]) -> tuple:
        return tuple(sorted(collections.Counter(
            (i.opcode, str(i.shape)) for i in (diff.instruction(side, n) for n in nodes)
        ).items()))

    return ops("before", change.removed), ops("after", change.added)


def _same(anchor: str, same_as: dict[str, str]) -> str:
    first = same_as.get(anchor, anchor)
    if first == anchor:
        return ""
    return (f"<p class=\"note\">The same instructions change as in <a href=\"#{first}\">"
            "the site drawn above</a>; not drawn again.</p>")


def html_report(functions: Sequence[FunctionDiff], hops: int = DEFAULT_HOPS,
                max_nodes: int = DEFAULT_MAX_NODES, title: str = "hlotool diff") -> str:
    """One self-contained HTML page: a table of sites linking to each side-by-side pair of
    inline SVG neighbourhoods, and each function's normalized text diff. No scripts, no
    network."""
    pictures = []  # (anchor, side name, dot source, neighbourhood size, module size)
    same_as: dict[str, str] = {}  # anchor → anchor of an identical change drawn earlier
    drawn: dict[tuple, str] = {}
    for fi, f in enumerate(functions):
        for si, change in enumerate(f.changes):
            anchor = f"f{fi}-s{si}"
            if change.regions:
                key = (fi, _signature(f.diff, change))
                same_as[anchor] = drawn.setdefault(key, anchor)
            for side, name in (("before", "native"), ("after", "rewritten")) \
                    if change.regions and same_as[anchor] == anchor else ():
                source, total = _site_dot(f.diff, change, side, hops, max_nodes)
                module = f.diff.before if side == "before" else f.diff.after
                pictures.append((f"f{fi}-s{si}", name, source, total,
                                 sum(len(c) for c in module.computations.values())))
    # One `dot` per core: layout dominates the report's time.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        svgs = list(pool.map(lambda p: _inline_svg(run_dot(p[2])), pictures))
    panes: dict[str, list[str]] = collections.defaultdict(list)
    for (anchor, name, _, total, size), svg in zip(pictures, svgs):
        panes[anchor].append(
            f"<div><h3>{name}</h3>{svg}<p class=\"note\">{min(total, max_nodes)} of {total} "
            f"neighbourhood instructions drawn ({hops} hops); module has {size} "
            "instructions.</p></div>")
    table, sections = [], []
    for fi, f in enumerate(functions):
        for si, change in enumerate(f.changes):
            anchor, what = f"f{fi}-s{si}", html.escape(_site_title(change))
            line = html.escape(change_line(f, change))
            number = str(si + 1) if change.site is not None else "–"
            table.append(
                f"<tr><td>{number}</td><td>{html.escape(f.function)}</td>"
                f"<td>{f.stage}, {f.target}</td>"
                f"<td><a href=\"#{anchor}\">{what}</a></td><td>{line}</td></tr>")
            sections.append(
                f"<section id=\"{anchor}\"><h2>{html.escape(f.function)}: {what}</h2>"
                f"<p>{line}</p>{_same(anchor, same_as)}"
                f"<div class=\"pair\">{''.join(panes[anchor])}</div></section>")
        sections.append(
            f"<details><summary>{html.escape(f.function)}: normalized HLO diff "
            f"({f.stage}, {f.target})</summary>{_diff_pre(f.diff.unified() or 'no change')}"
            "</details>")
    stages = ", ".join(sorted({f"{f.stage} / {f.target}" for f in functions}))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>stage: {html.escape(stages)}</p>{_legend()}"
        "<table><tr><th>#</th><th>function</th><th>stage</th><th>site</th><th>change</th></tr>"
        f"{''.join(table)}</table>{''.join(sections)}</body></html>\n"
    )


# ----------------------------------------------------------------------------- pieces


def write_pieces(functions: Sequence[FunctionDiff], directory: str, fmt: str,
                 hops: int = DEFAULT_HOPS, max_nodes: int = DEFAULT_MAX_NODES) -> list[str]:
    """Writes each site's before/after picture (svg, png, dot) or each function's text diff
    (txt) into `directory`; returns the paths written."""
    if fmt not in FORMATS:
        raise HlotoolError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    os.makedirs(directory, exist_ok=True)
    written = []
    for f in functions:
        stem = re.sub(r"[^\w.-]", "_", f.function)
        if fmt == "txt":
            path = os.path.join(directory, f"{stem}.{f.stage}.{f.target}.diff.txt")
            write_output(path, text_summary([f]) + "\n" + (f.diff.unified() or "no change\n"))
            written.append(path)
            continue
        for si, change in enumerate(f.changes, 1):
            for side, name in (("before", "native"), ("after", "rewritten")):
                source = site_dot(f.diff, change, side, hops, max_nodes)
                data = source if fmt == "dot" else run_dot(source, fmt)
                path = os.path.join(directory, f"{stem}.site{si}.{name}.{fmt}")
                write_output(path, data)
                written.append(path)
    return written
