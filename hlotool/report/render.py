"""Pictures and text of a structural diff (`hlotool.passes.diff`): graphviz neighbourhoods of
each changed site, a self-contained HTML report, and a terminal summary.

Only a site's neighbourhood is drawn (the changed instructions plus `hops` operand/user
steps, at most `max_nodes` per side): `dot` needs over a minute for a 2,000-node module.
Fill colours follow XLA's hlo_graph_dumper by op category; the outline says what the
rewrite did (removed red, added green, kept grey). A kernel hlotool put in is drawn as one
box, as XLA:TPU draws its own custom call, and its inside as a picture of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import html
import os
import re
from collections.abc import Sequence

import graphviz

from hlotool import kernels
from hlotool.errors import MARK, HlotoolError, write_output
from hlotool.hlo.printer import print_instruction
from hlotool.passes.diff import ADDED, KEPT, REMOVED, FunctionDiff, ModuleDiff, SiteChange
from hlotool.report.console import Term, printable

FORMATS = ("svg", "png", "dot", "txt")
DEFAULT_HOPS = 2
DEFAULT_MAX_NODES = 150
_MAX_TOOLTIP_CHARS = 1500

# Op category → fill, after xla/service/hlo_graph_dumper.cc.
_DOTS = {"dot", "convolution", "ragged-dot"}
_REDUCTIONS = {"reduce", "reduce-window", "all-reduce", "reduce-scatter", "select-and-scatter"}
_MOVEMENT = {
    "broadcast", "transpose", "reshape", "bitcast", "copy", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "gather", "scatter", "reverse", "iota",
    "get-tuple-element", "tuple", "bitcast-convert",
}
_CONTAINERS = {"while", "conditional", "call", "fusion", "async-start", "async-done"}
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
    if opcode in _CONTAINERS:
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


# ----------------------------------------------------------------------------- kernel box

# Where hlotool's kernels live: an instruction with a frame in here was put in by the rewrite.
_KERNELS_DIR = os.path.dirname(os.path.abspath(kernels.__file__))


@dataclasses.dataclass(frozen=True)
class KernelBox:
    """The instructions of one side that make up the kernel a rewrite put in, drawn as one
    box; `name` is the kernel's registry name where its frames say it."""

    name: str
    nodes: frozenset[str]

    def label(self, diff: ModuleDiff, side: str) -> str:
        ops = collections.Counter(diff.instruction(side, n).opcode for n in self.nodes)
        top = ", ".join(f"{op} ×{c}" for op, c in ops.most_common(3))
        return f"{self.name} kernel\n{len(self.nodes)} instructions\n{top}"


def _kernel_frames(inst) -> list[str] | None:
    """Module names of the frames in hlotool's kernels that made `inst`; None when XLA
    recorded no frames for it (tuples, loop plumbing)."""
    try:
        stack = inst.stack
    except HlotoolError:
        return None
    if not stack:
        return None
    return [os.path.splitext(os.path.basename(f.file))[0] for f in stack
            if os.path.dirname(os.path.abspath(f.file)) == _KERNELS_DIR]


def kernel_box(diff: ModuleDiff, change: SiteChange, side: str) -> KernelBox | None:
    """The added instructions of `change` that hlotool's kernel code made (by their stack
    frames), with the frameless plumbing XLA added among them (loop tuples, constants),
    when that is more than one instruction; None on the native side or when no added
    instruction comes from a kernel (no debug info)."""
    if side != "after":
        return None
    names: collections.Counter[str] = collections.Counter()
    nodes, plumbing = set(), set()
    registered = set(kernels.names())
    for n in change.added:
        frames = _kernel_frames(diff.instruction(side, n))
        if frames is None:
            plumbing.add(n)
        elif frames:
            nodes.add(n)
            names.update(f for f in frames if f in registered)
    if not nodes or len(nodes | plumbing) < 2:
        return None
    nodes |= plumbing
    return KernelBox(names.most_common(1)[0][0] if names else "flash", frozenset(nodes))


# ----------------------------------------------------------------------------- graphviz


def _dot_text(text: str) -> str:
    """`text` for a DOT label or tooltip: its backslashes and <...> literal, its lines
    joined with DOT's own line break."""
    return "\\n".join(graphviz.escape(line) for line in text.split("\n"))


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
    (fusion bodies, loop bodies) are clusters; a kernel the rewrite put in is one box; a
    trailing note counts what was left out."""
    return _site_graph(diff, change, side, hops, max_nodes, title)[0].source


def kernel_dot(diff: ModuleDiff, box: KernelBox, max_nodes: int = DEFAULT_MAX_NODES) -> str:
    """Graphviz source of the inside of a kernel box."""
    nodes = sorted(box.nodes, key=lambda n: diff.instruction("after", n).line)
    return _graph(diff, "after", nodes, max_nodes, f"inside the {box.name} kernel").source


def _site_graph(diff: ModuleDiff, change: SiteChange, side: str, hops: int, max_nodes: int,
                title: str = "") -> tuple[graphviz.Digraph, int, KernelBox | None]:
    """The graph of one side, the size of the whole neighbourhood, and the kernel box."""
    everything = neighbourhood(diff, change, side, hops)
    box = kernel_box(diff, change, side)
    if box is not None:
        inside = _called_by(diff.after_graph, box.nodes)
        everything = [n for n in everything if n not in box.nodes
                      and diff.after_graph.nodes[n]["computation"] not in inside]
    return _graph(diff, side, everything, max_nodes, title, box), len(everything), box


def _called_by(graph, nodes: frozenset[str]) -> set[str]:
    """Computations that `nodes` call (reducers, loop bodies), transitively: they belong
    inside a kernel box, not beside it."""
    called: set[str] = set()
    frontier = set(nodes)
    while frontier:
        found = {graph.nodes[u]["computation"] for n in frontier
                 for u, _, d in graph.in_edges(n, data=True) if d["kind"] == "called"}
        found -= called
        called |= found
        frontier = {n for n, data in graph.nodes(data=True) if data["computation"] in found}
    return called


def _graph(diff: ModuleDiff, side: str, everything: list[str], max_nodes: int,
           title: str = "", box: KernelBox | None = None) -> graphviz.Digraph:
    graph = diff.before_graph if side == "before" else diff.after_graph
    nodes = everything[:max_nodes]
    ids = {n: f"n{i}" for i, n in enumerate(nodes)}
    entry = (diff.before if side == "before" else diff.after).entry.name
    g = graphviz.Digraph(
        "G",
        graph_attr={"rankdir": "TB", "fontname": "Helvetica", "fontsize": "11",
                    "nodesep": "0.25", "ranksep": "0.35",
                    **({"label": _dot_text(title), "labelloc": "t"} if title else {})},
        node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica",
                   "fontsize": "10"},
        edge_attr={"color": "#555555", "arrowsize": "0.6"})

    def add(target: graphviz.Digraph, n: str) -> None:
        inst = diff.instruction(side, n)
        status = diff.status(side, n)
        target.node(ids[n], label=_dot_text(_label(inst)), tooltip=_dot_text(_tooltip(inst)),
                    fillcolor=FILL[category(inst.opcode)], color=OUTLINE[status],
                    penwidth="1" if status == KEPT else "3", **{"class": status})

    by_comp: dict[str, list[str]] = collections.defaultdict(list)
    for n in nodes:
        by_comp[graph.nodes[n]["computation"]].append(n)
    for k, (comp, members) in enumerate(by_comp.items()):
        if comp == entry:
            for n in members:
                add(g, n)
            continue
        with g.subgraph(name=f"cluster_{k}", graph_attr={
                "label": _dot_text(comp), "style": "rounded,dashed", "color": "#7f7f7f",
                "fontsize": "10"}) as cluster:
            for n in members:
                add(cluster, n)
    if box is not None:
        ids.update(dict.fromkeys(box.nodes, "kernel"))
        g.node("kernel", label=_dot_text(box.label(diff, side)), shape="box3d",
               fillcolor=FILL["custom-call"], color=OUTLINE[ADDED], penwidth="3",
               fontsize="12", tooltip=_dot_text(f"{box.name}: {len(box.nodes)} instructions; "
                                                "drawn below the pair"),
               **{"class": "kernel"})
    edges = set()
    for u in [*nodes, *(box.nodes if box else ())]:
        for _, v, d in graph.out_edges(u, data=True):
            if v in ids and ids[u] != ids[v] and (ids[u], ids[v]) not in edges:
                edges.add((ids[u], ids[v]))
                g.edge(ids[u], ids[v], **({} if d["kind"] == "operand" else
                                          {"style": "dashed"}))
    if len(everything) > len(nodes):
        left = collections.Counter(graph.nodes[n]["opcode"] for n in everything[max_nodes:])
        note = f"{len(everything) - len(nodes)} more nodes not drawn: " + ", ".join(
            f"{op} ×{c}" for op, c in left.most_common(6))
        g.node("note", label=_dot_text(note), shape="note", style="filled",
               fillcolor="#fafafa")
    return g


def run_dot(source: str, fmt: str = "svg") -> bytes:
    """`source` laid out by graphviz's `dot` as svg or png bytes. A neighbourhood of at
    most `DEFAULT_MAX_NODES` lays out in well under a second, so no timeout is needed."""
    try:
        return graphviz.pipe("dot", fmt, source.encode(), quiet=True)
    except graphviz.ExecutableNotFound:
        raise GraphvizMissing(
            "graphviz's `dot` is not installed (apt-get install graphviz); "
            "the text diff (--format txt, or no -o) works without it") from None
    except graphviz.CalledProcessError as e:
        first = (e.stderr or b"").decode(errors="replace").strip().splitlines()[:1]
        raise HlotoolError(f"dot failed: {first[0] if first else f'exit {e.returncode}'}"
                           ) from None


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


def text_summary(functions: Sequence[FunctionDiff], verdicts: Sequence[str | None] = (),
                 term: Term | None = None) -> str:
    """One header per function (whole-module counts), the verdict that made the diff show
    a kernel auto would not use (if any), and one line per site; wrapped to `term`."""
    term = term or Term()
    out = []
    for f, verdict in zip(functions, [*verdicts, *[None] * len(functions)]):
        out.append(term.wrap(f"{printable(f.function)} ({f.stage}, {f.target}): "
                             f"{f.diff.stats().line()}", "", "    "))
        if verdict:
            out.append(term.style(term.wrap(verdict, "  ", "    "), "yellow"))
        for k, change in enumerate(f.changes, 1):
            label = f"site {k}" if change.site is not None else "other"
            out.append(term.wrap(f"{label}: {printable(_site_title(change))}: "
                                 f"{change_line(f, change)}", "  ", "    "))
    return "\n".join(out)


# ----------------------------------------------------------------------------- html

_SVG_HEAD = re.compile(r"\A.*?(?=<svg\b)", re.S)
# Pictures are drawn at dot's own size (10 pt labels: 13 px) in scrolling panes, both
# sides of a pair at one scale that its buttons change together; "enlarge" fills the
# window. CSS only: the page runs no script.
_STYLE = """
body{font-family:Helvetica,Arial,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:left}
.verdict{background:#fff8db;border:1px solid #e6c200;padding:8px 12px;font-size:14px}
.pair{display:flex;gap:12px;align-items:flex-start}
.side{flex:1;min-width:0;border:1px solid #ddd;padding:6px;background:#fff}
.side h3{margin:2px 0 6px 0;font-size:15px}
.pane{overflow:auto;max-height:75vh;cursor:grab}
.pane svg{display:block}
.controls{font-size:13px;margin:6px 0}
.controls label{border:1px solid #999;border-radius:3px;padding:1px 6px;margin-right:4px;
cursor:pointer}
.controls input{display:none}
.controls input:checked+label{background:#333;color:#fff}
.z50:checked~.pair .pane svg{zoom:.5}.z100:checked~.pair .pane svg{zoom:1}
.z200:checked~.pair .pane svg{zoom:2}
.big{display:none}.big:checked+.side{position:fixed;inset:8px;z-index:9;
box-shadow:0 0 0 100vmax rgba(0,0,0,.45)}
.big:checked+.side .pane{max-height:calc(100vh - 80px)}
.enlarge{float:right;font-size:13px;border:1px solid #999;border-radius:3px;padding:1px 6px;
cursor:pointer;font-weight:normal}
.big:checked+.side .enlarge::after{content:" (click to close)"}
.note{color:#666;font-size:12px}
pre{font-size:12px;background:#fafafa;padding:8px;overflow:auto;max-height:60vh}
.d-{color:#b00}.d\\+{color:#070}.d\\@{color:#06c}
.legend span{display:inline-block;padding:2px 6px;margin-right:4px;border:1px solid #999;
font-size:12px}
"""


_SVG_SIZE = re.compile(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"')
# A pane of the pair at 1600 px, in px; dot's labels are 10 pt (13.3 px) at scale 1, and
# at `_MIN_SCALE` still 9.3 px.
_PANE_PX = 740
_MIN_SCALE = 0.7


def _inline_svg(svg: bytes) -> str:
    """dot's SVG without its XML prolog and DOCTYPE, to sit inside HTML."""
    return _SVG_HEAD.sub("", svg.decode("utf-8"), count=1)


def _scale(svgs: Sequence[str]) -> float:
    """One scale for pictures shown side by side: the widest fits its pane, unless that
    would take labels below 9 px (then the panes scroll)."""
    widest = max((float(m.group(1)) for m in map(_SVG_SIZE.search, svgs) if m), default=1.0)
    return max(_MIN_SCALE, min(1.0, _PANE_PX / (widest * 4 / 3)))


def _scaled(svg: str, scale: float) -> str:
    """`svg` drawn at `scale` of dot's size (its viewBox keeps the drawing whole)."""
    return _SVG_SIZE.sub(lambda m: f'<svg width="{float(m.group(1)) * scale:.0f}pt" '
                         f'height="{float(m.group(2)) * scale:.0f}pt"', svg, count=1)


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


def _pair(anchor: str, sides: Sequence[str]) -> str:
    """The side-by-side panes with their shared scale buttons."""
    scales = "".join(
        f'<input type="radio" name="z-{anchor}" id="z{z}-{anchor}" class="z{z}"'
        f'{" checked" if z == 100 else ""}><label for="z{z}-{anchor}">{z}%</label>'
        for z in (50, 100, 200))
    return (f'<div class="controls">scale (both sides): {scales}<div class="pair">'
            f'{"".join(sides)}</div></div>')


def html_report(functions: Sequence[FunctionDiff], hops: int = DEFAULT_HOPS,
                max_nodes: int = DEFAULT_MAX_NODES, title: str = "hlotool diff",
                verdicts: Sequence[str | None] = ()) -> str:
    """One self-contained HTML page: the verdicts on top (where the diff shows a kernel
    auto keeps out), a table of sites linking to each side-by-side pair of inline SVG
    neighbourhoods at one scale, each kernel's inside on demand, and each function's
    normalized text diff. No scripts, no network."""
    verdicts = [*verdicts, *[None] * len(functions)]
    pictures = []  # (anchor, side name, dot source, neighbourhood size, module size)
    insides = {}  # anchor → (kernel name, instructions) of the kernel drawn on its own
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
                g, total, box = _site_graph(f.diff, change, side, hops, max_nodes)
                module = f.diff.before if side == "before" else f.diff.after
                pictures.append((anchor, name, g.source, total,
                                 sum(len(c) for c in module.computations.values())))
                if box is not None:
                    insides[anchor] = (box.name, len(box.nodes))
                    pictures.append((anchor, "kernel", kernel_dot(f.diff, box, max_nodes),
                                     len(box.nodes), 0))
    # One `dot` per core: layout dominates the report's time.
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        svgs = list(pool.map(lambda p: _inline_svg(run_dot(p[2])), pictures))
    scales = {}
    for anchor in dict.fromkeys(p[0] for p in pictures):
        scales[anchor] = _scale([svg for p, svg in zip(pictures, svgs)
                                 if p[0] == anchor and p[1] != "kernel"])
    panes: dict[str, list[str]] = collections.defaultdict(list)
    inside_html: dict[str, str] = {}
    for (anchor, name, _, total, size), svg in zip(pictures, svgs):
        svg = _scaled(svg, _scale([svg]) if name == "kernel" else scales[anchor])
        if name == "kernel":
            kname, count = insides[anchor]
            inside_html[anchor] = (
                f"<details><summary>inside the {html.escape(kname)} kernel ({count} "
                f"instructions, drawn as one box above)</summary><div class=\"pane\">{svg}"
                f"</div></details>")
            continue
        big = f"big-{anchor}-{name}"
        panes[anchor].append(
            f'<input type="checkbox" class="big" id="{big}"><div class="side">'
            f'<h3>{name}<label class="enlarge" for="{big}">enlarge</label></h3>'
            f'<div class="pane">{svg}</div><p class="note">{min(total, max_nodes)} of '
            f"{total} neighbourhood instructions drawn ({hops} hops); module has {size} "
            "instructions.</p></div>")
    table, sections, banners = [], [], []
    for fi, (f, verdict) in enumerate(zip(functions, verdicts)):
        if verdict:
            banners.append(f'<p class="verdict"><b>{html.escape(f.function)}</b>: '
                           f"{html.escape(verdict)}</p>")
        for si, change in enumerate(f.changes):
            anchor, what = f"f{fi}-s{si}", html.escape(_site_title(change))
            line = html.escape(change_line(f, change))
            number = str(si + 1) if change.site is not None else "–"
            table.append(
                f"<tr><td>{number}</td><td>{html.escape(f.function)}</td>"
                f"<td>{f.stage}, {f.target}</td>"
                f"<td><a href=\"#{anchor}\">{what}</a></td><td>{line}</td></tr>")
            pair = _pair(anchor, panes[anchor]) if panes[anchor] else ""
            sections.append(
                f"<section id=\"{anchor}\"><h2>{html.escape(f.function)}: {what}</h2>"
                f"<p>{line}</p>{_same(anchor, same_as)}{pair}"
                f"{inside_html.get(anchor, '')}</section>")
        sections.append(
            f"<details open><summary>{html.escape(f.function)}: normalized HLO diff "
            f"({f.stage}, {f.target})</summary>{_diff_pre(f.diff.unified() or 'no change')}"
            "</details>")
    stages = ", ".join(sorted({f"{f.stage} / {f.target}" for f in functions}))
    return (
        f"<!DOCTYPE html>\n<!-- {MARK} -->\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{''.join(banners)}"
        f"<p>stage: {html.escape(stages)}</p>{_legend()}"
        "<table><tr><th>#</th><th>function</th><th>stage</th><th>site</th><th>change</th></tr>"
        f"{''.join(table)}</table>{''.join(sections)}</body></html>\n"
    )


# ----------------------------------------------------------------------------- pieces


def _stems(functions: Sequence[FunctionDiff]) -> list[str]:
    """A file-name stem per function, made unique: two functions may share a name."""
    seen: collections.Counter[str] = collections.Counter()
    stems = []
    for f in functions:
        stem = re.sub(r"[^\w.-]", "_", f.function)
        seen[stem] += 1
        stems.append(stem if seen[stem] == 1 else f"{stem}-{seen[stem]}")
    return stems


def write_pieces(functions: Sequence[FunctionDiff], directory: str, fmt: str,
                 hops: int = DEFAULT_HOPS, max_nodes: int = DEFAULT_MAX_NODES,
                 force: bool = False) -> list[str]:
    """Writes each site's before/after picture (svg, png, dot) or each function's text diff
    (txt) into `directory`; returns the paths written. A file there that hlotool did not
    write stops it, unless `force`."""
    if fmt not in FORMATS:
        raise HlotoolError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    os.makedirs(directory, exist_ok=True)
    written = []

    def write(name: str, data: str | bytes) -> None:
        path = os.path.join(directory, name)
        write_output(path, data, force=force, listed=True)
        written.append(path)

    for f, stem in zip(functions, _stems(functions)):
        if fmt == "txt":
            write(f"{stem}.{f.stage}.{f.target}.diff.txt",
                  text_summary([f]) + "\n\n" + (f.diff.unified() or "no change\n"))
            continue
        for si, change in enumerate(f.changes, 1):
            for side, name in (("before", "native"), ("after", "rewritten")):
                source = site_dot(f.diff, change, side, hops, max_nodes)
                write(f"{stem}.site{si}.{name}.{fmt}",
                      source if fmt == "dot" else run_dot(source, fmt))
            box = kernel_box(f.diff, change, "after")
            if box is not None:
                source = kernel_dot(f.diff, box, max_nodes)
                write(f"{stem}.site{si}.kernel.{fmt}",
                      source if fmt == "dot" else run_dot(source, fmt))
    return written
