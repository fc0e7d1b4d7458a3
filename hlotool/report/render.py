"""Pictures and text of a structural diff (`hlotool.passes.diff`): each changed site's
neighbourhood, native and rewritten, a self-contained HTML report, and a terminal summary.

Only a site's neighbourhood is drawn (its changed instructions, the kept ones around them
within `hops` operand/user steps, at most `max_nodes` per side), and only its own changes:
another site's instructions are left out, so every red or green box in a picture is counted
in the numbers above it. Small constants are written inside the boxes that use them, as
XLA's hlo_graph_dumper does. Fill colours follow that dumper by op category; the outline
says what the rewrite did (removed red, added green, kept grey). A kernel hlotool put in is
one box, as XLA:TPU draws its own custom call, and its inside a picture of its own.
Pictures are laid out by `hlotool.report.layout` (no graphviz needed); graphviz's `dot`
is used only to turn them into PNG.
"""

from __future__ import annotations

import collections
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
from hlotool.report import picture
from hlotool.report.console import Term, printable

FORMATS = ("svg", "png", "dot", "txt")
DEFAULT_HOPS = 1
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
    """The `dot` binary is not installed (only PNG pieces need it)."""


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


def reducers(module) -> set[str]:
    """Computations that reductions, scatters and sorts apply: a box shows them by their
    root's opcode ("reduce by add"), as XLA's dumper does, instead of drawing them."""
    return {c for comp in module.computations.values() for i in comp
            for c in i.called_computations if i.opcode not in _PROGRAM_CALLS}


_PROGRAM_CALLS = {"while", "conditional", "call", "fusion", "async-start", "async-done"}


def neighbourhood(diff: ModuleDiff, change: SiteChange, side: str,
                  hops: int = DEFAULT_HOPS, elsewhere: frozenset[str] = frozenset()
                  ) -> list[str]:
    """Node ids of `side` ("before" | "after") around `change`, nearest first: its changed
    nodes, the kept nodes its changes on the other side touch, everything within `hops`
    operand/user steps, and the whole body of every fusion among them; never a node of
    `elsewhere` (the other changes of the function: they have pictures of their own) nor
    of a reducer."""
    if hops < 0:
        raise HlotoolError(f"hops must be >= 0, got {hops}")
    graph = diff.before_graph if side == "before" else diff.after_graph
    own, other = (change.removed, change.added) if side == "before" else \
        (change.added, change.removed)
    other_graph = diff.after_graph if side == "before" else diff.before_graph
    to_here = diff.reverse if side == "before" else diff.mapping
    skip = reducers(diff.before if side == "before" else diff.after)
    elsewhere = elsewhere | {n for n, c in graph.nodes(data="computation") if c in skip}
    seeds = set(own) - elsewhere
    for n in other:
        for w, _, d in (*other_graph.in_edges(n, data=True),
                        *((v, 0, d) for _, v, d in other_graph.out_edges(n, data=True))):
            here = to_here.get(w)
            if d["kind"] == "operand" and here is not None and here not in elsewhere and \
                    diff.in_place(*((here, w) if side == "before" else (w, here))):
                seeds.add(here)
    order = sorted(seeds, key=lambda n: diff.instruction(side, n).line)
    seen = dict.fromkeys(order)
    frontier = list(order)
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for u, v, d in (*graph.in_edges(n, data=True), *graph.out_edges(n, data=True)):
                w = u if v == n else v
                if w not in seen and w not in elsewhere and _walkable(diff, side, v, d):
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
    frames), with the frameless plumbing XLA added among them (loop tuples, constants) and
    the added instructions of the computations they run (loop bodies jax prints once for
    all the layers that call them; a reducer kept from the native program stays out), when
    that is more than one instruction; None on the native side or when no added
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
    inside = _called_by(diff.after_graph, frozenset(nodes))
    nodes |= {n for n, comp in diff.after_graph.nodes(data="computation")
              if comp in inside and diff.status(side, n) == ADDED}
    return KernelBox(names.most_common(1)[0][0] if names else "flash", frozenset(nodes))


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


# ----------------------------------------------------------------------------- pictures


def _label(inst, module) -> str:
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
    elif inst.opcode not in _PROGRAM_CALLS and inst.called_computations:
        roots = [module.computations[c].root.opcode for c in inst.called_computations
                 if c in module.computations]
        head = f"{inst.opcode} by {', '.join(dict.fromkeys(roots))}" if roots else head
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


def _constant_text(diff: ModuleDiff, side: str, node: str) -> str | None:
    """The value of a small constant, or of a broadcast of one (how jax writes a scalar
    operand), as its users' boxes show it; None for anything else."""
    inst = diff.instruction(side, node)
    if inst.opcode == "broadcast" and len(inst.operands) == 1:
        graph = diff.before_graph if side == "before" else diff.after_graph
        [source] = [u for u, _, d in graph.in_edges(node, data=True) if d["kind"] == "operand"]
        inst = diff.instruction(side, source)
    if inst.opcode == "constant" and inst.literal is not None and len(inst.literal) < 16:
        return inst.literal
    return None


@dataclasses.dataclass
class Drawn:
    """A side's picture and what it holds: the neighbourhood's size, the boxes drawn by
    status, and the constants written inside their users."""

    picture: picture.Picture
    total: int
    statuses: collections.Counter
    folded: int
    box: KernelBox | None = None

    @property
    def drawn(self) -> int:
        return sum(self.statuses.values())


def site_picture(diff: ModuleDiff, change: SiteChange, side: str, hops: int = DEFAULT_HOPS,
                 max_nodes: int = DEFAULT_MAX_NODES, title: str = "",
                 elsewhere: frozenset[str] = frozenset()) -> Drawn:
    """One side of a site's neighbourhood. Non-entry computations (fusion bodies, loop
    bodies) are clusters; a kernel the rewrite put in is one box; a trailing note counts
    what was left out."""
    everything = neighbourhood(diff, change, side, hops, elsewhere)
    box = kernel_box(diff, change, side)
    if box is not None:
        inside = _called_by(diff.after_graph, box.nodes)
        everything = [n for n in everything if n not in box.nodes
                      and diff.after_graph.nodes[n]["computation"] not in inside]
    return _picture(diff, side, everything, max_nodes, title, box)


def site_dot(diff: ModuleDiff, change: SiteChange, side: str, hops: int = DEFAULT_HOPS,
             max_nodes: int = DEFAULT_MAX_NODES, title: str = "") -> str:
    """Graphviz source of one side of a site's neighbourhood (`site_picture`)."""
    return picture.dot(site_picture(diff, change, side, hops, max_nodes, title).picture)


def kernel_picture(diff: ModuleDiff, box: KernelBox,
                   max_nodes: int = DEFAULT_MAX_NODES) -> Drawn:
    """The inside of a kernel box."""
    nodes = sorted(box.nodes, key=lambda n: diff.instruction("after", n).line)
    return _picture(diff, "after", nodes, max_nodes, f"inside the {box.name} kernel")


def kernel_dot(diff: ModuleDiff, box: KernelBox, max_nodes: int = DEFAULT_MAX_NODES) -> str:
    """Graphviz source of the inside of a kernel box."""
    return picture.dot(kernel_picture(diff, box, max_nodes).picture)


def _chains(diff: ModuleDiff, side: str, shown: list[str]) -> dict[str, str]:
    """Member → first node of each run of data-movement ops (reshape, broadcast, ...) that
    pass one value along, alike in status and computation: jax writes `keepdims` and
    broadcasting as such runs, and one box for each run keeps the pictures short."""
    graph = diff.before_graph if side == "before" else diff.after_graph
    drawn = set(shown)

    def linked(n: str, out: bool) -> set[str]:
        edges = graph.out_edges(n, data=True) if out else graph.in_edges(n, data=True)
        return {(v if out else u) for u, v, d in edges
                if d["kind"] == "operand" and (v if out else u) in drawn}

    def key(n: str) -> tuple:
        return (diff.status(side, n), graph.nodes[n]["computation"])

    head: dict[str, str] = {}
    for n in sorted(shown, key=lambda n: diff.instruction(side, n).line):
        if category(diff.instruction(side, n).opcode) != "movement":
            continue
        [p] = linked(n, False) if len(linked(n, False)) == 1 else [None]
        if p is not None and category(diff.instruction(side, p).opcode) == "movement" \
                and linked(p, True) == {n} and key(p) == key(n):
            head[n] = head.get(p, p)
    return head


def _picture(diff: ModuleDiff, side: str, everything: list[str], max_nodes: int,
             title: str = "", box: KernelBox | None = None) -> Drawn:
    graph = diff.before_graph if side == "before" else diff.after_graph
    module = diff.before if side == "before" else diff.after
    skip = reducers(module)
    everything = [n for n in everything if graph.nodes[n]["computation"] not in skip]
    chosen = everything[:max_nodes]
    inside = set(chosen)
    constants = {n: t for n in chosen if (t := _constant_text(diff, side, n)) is not None}
    # A small constant is written in the boxes that use it, not drawn on its own.
    users = inside | (box.nodes if box else frozenset())
    folded: set[str] = set()
    for _ in range(2):  # a constant, then the broadcast of it that a box uses
        folded |= {n for n in constants if any(
            v in users and (v not in constants or v in folded) for v in graph.successors(n))}
    shown = [n for n in chosen if n not in folded]
    head = _chains(diff, side, shown)
    runs: dict[str, list[str]] = {}
    for n in shown:
        runs.setdefault(head.get(n, n), []).append(n)
    ids = {n: f"n{i}" for i, first in enumerate(runs) for n in runs[first]}
    entry = module.entry.name
    pic = picture.Picture(title)
    statuses: collections.Counter[str] = collections.Counter(
        diff.status(side, n) for n in shown)
    for first, run in runs.items():
        insts = [diff.instruction(side, n) for n in run]
        status = diff.status(side, first)
        label = _label(insts[-1], module)
        if len(run) > 1:
            label = f"{' → '.join(i.opcode for i in insts)}\n{label.split(chr(10))[-1]}"
            if len(label.split("\n")[0]) > 40:
                ops = ", ".join(dict.fromkeys(i.opcode for i in insts))
                label = f"{ops} ({len(run)} ops)\n{label.split(chr(10))[-1]}"
        values = [constants[o] for n in run for o, _, d in graph.in_edges(n, data=True)
                  if o in folded and d["kind"] == "operand"]
        if values:
            text = ", ".join(dict.fromkeys(values))
            label += "\nwith " + (text if len(text) <= 24 else text[:23] + "…")
        tip = "\n".join(_tooltip(i) for i in insts)
        pic.nodes[ids[first]] = picture.Node(label, FILL[category(insts[-1].opcode)],
                                             OUTLINE[status], status, tip,
                                             thick=status != KEPT)
        comp = graph.nodes[first]["computation"]
        if comp != entry:
            pic.clusters.setdefault(comp, []).append(ids[first])
    if box is not None:
        ids.update(dict.fromkeys(box.nodes, "kernel"))
        pic.nodes["kernel"] = picture.Node(
            box.label(diff, side), FILL["custom-call"], OUTLINE[ADDED], "kernel",
            f"{box.name}: {len(box.nodes)} instructions; drawn below the pair", thick=True)
    for u in [*shown, *(box.nodes if box else ())]:
        for _, v, d in graph.out_edges(u, data=True):
            edge = (ids[u], ids.get(v), d["kind"] != "operand")
            if v in ids and edge[0] != edge[1] and edge not in pic.edges:
                pic.edges.append(edge)
    if len(everything) > len(chosen):
        left = collections.Counter(graph.nodes[n]["opcode"] for n in everything[max_nodes:])
        pic.nodes["note"] = picture.Node(
            f"{len(everything) - len(chosen)} more nodes not drawn:\n" + ", ".join(
                f"{op} ×{c}" for op, c in left.most_common(4)), "#fafafa", "#999999", "note")
    return Drawn(pic, len(everything), statuses, len(folded), box)


def run_dot(source: str, fmt: str = "png") -> bytes:
    """`source` laid out by graphviz's `dot` as svg or png bytes (only PNG pieces need it).
    A neighbourhood of at most `DEFAULT_MAX_NODES` lays out in well under a second."""
    try:
        return graphviz.pipe("dot", fmt, source.encode(), quiet=True)
    except graphviz.ExecutableNotFound:
        raise GraphvizMissing(
            "--format png needs graphviz's `dot` (apt-get install graphviz); --format svg, "
            "dot and txt and the HTML report work without it") from None
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
    return f"attention {shape} {s.dtype}, mask {s.mask_text}{where}"


def change_line(f: FunctionDiff, change: SiteChange) -> str:
    """The counts of one change, as the text summary and the report both show them: what
    its regions removed and added, with every instruction of its kernel (loop bodies jax
    prints once for several layers count at each site that runs them, and the line says
    so), and how many of its L×L values are the kernel's own tiles (at short lengths one
    tile spans every key)."""
    d = f.diff
    box = kernel_box(d, change, "after")
    inside = box.nodes if box is not None else frozenset()
    line = d.stats(change.removed, change.added | inside, change.site).line()
    if change.site is not None and inside:
        tiles = sum(d.score_sized("after", n, change.site)
                    for n in inside if not d.fused("after", n))
        if tiles:
            line += (f" ({tiles} of them the kernel's tiles: at Lk={change.site.kv_len} one "
                     "tile spans every key)")
    shared = inside - change.added
    owners = [f"site {k}" if c.site is not None else "the changes outside any site"
              for k, c in enumerate(f.changes, 1) if c is not change and shared & c.added]
    if owners:
        line += (f"; {len(shared)} of the added are loop bodies shared with "
                 + ", ".join(owners))
    return line


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

# The report opens on the first site's pair: a short header, then native and rewritten
# side by side, each in a scrolling pane at one scale that its buttons change together;
# "enlarge" fills the window. CSS only: the page runs no script.
_STYLE = """
body{font-family:Helvetica,Arial,sans-serif;margin:16px 24px;color:#222}
h1{font-size:22px;margin:0 0 6px 0}h2{font-size:16px;margin:18px 0 4px 0}
table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 8px;font-size:13px;text-align:left}
.meta{font-size:13px;margin:4px 0}
.verdict{background:#fff8db;border:1px solid #e6c200;padding:4px 10px;font-size:13px;margin:6px 0}
.line{font-size:13px;margin:2px 0 4px 0}
.pair{display:flex;gap:12px;align-items:flex-start}
.side{flex:1;min-width:0;border:1px solid #ddd;padding:4px 6px;background:#fff}
.side h3{margin:0 0 4px 0;font-size:14px}
.pane{overflow:auto;max-height:80vh;cursor:grab}
.pane svg{display:block}
.controls{font-size:13px;margin:4px 0}
.controls label{border:1px solid #999;border-radius:3px;padding:0 6px;margin-right:4px;
cursor:pointer}
.controls input{display:none}
.controls input:checked+label{background:#333;color:#fff}
.z50:checked~.pair .pane svg{zoom:.5}.z100:checked~.pair .pane svg{zoom:1}
.z200:checked~.pair .pane svg{zoom:2}
.big{display:none}.big:checked+.side{position:fixed;inset:8px;z-index:9;
box-shadow:0 0 0 100vmax rgba(0,0,0,.45)}
.big:checked+.side .pane{max-height:calc(100vh - 80px)}
.enlarge{float:right;font-size:12px;border:1px solid #999;border-radius:3px;padding:0 6px;
cursor:pointer;font-weight:normal}
.big:checked+.side .enlarge::after{content:" (click to close)"}
.note{color:#666;font-size:12px;margin:4px 0}
pre{font-size:12px;background:#fafafa;padding:8px;overflow:auto;max-height:60vh}
.d-{color:#b00}.d\\+{color:#070}.d\\@{color:#06c}
.legend span{display:inline-block;padding:0 5px;margin-right:3px;border:1px solid #999;
font-size:12px}
"""

# A pane of the pair at 1600 px, in px; labels are 11 px at scale 1 and at `_MIN_SCALE`
# still 9 px (and a little, as sizes are written in whole px).
_PANE_PX = 740
_MIN_SCALE = 9.1 / picture.FONT_PX


def _scale(widths: Sequence[float]) -> float:
    """One scale for pictures shown side by side: the widest fits its pane, unless that
    would take labels below 9 px (then the panes scroll)."""
    return max(_MIN_SCALE, min(1.0, _PANE_PX / max(widths, default=1.0)))


def _legend() -> str:
    cats = "".join(f'<span style="background:{c}">{html.escape(k)}</span>' for k, c in FILL.items())
    states = "".join(f'<span style="border:3px solid {c}">{s}</span>' for s, c in OUTLINE.items())
    return f'<span class="legend">{cats} &nbsp; {states}</span>'


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


def _side_note(drawn: Drawn, hops: int, module_size: int) -> str:
    """What a pane shows, in numbers that add up to the picture."""
    parts = [f"{drawn.statuses[s]} {s}" for s in (REMOVED, ADDED) if drawn.statuses[s]]
    if drawn.box is not None:
        parts.insert(0, f"the {drawn.box.name} kernel's {len(drawn.box.nodes)} instructions "
                     "as one box")
    parts.append(f"{drawn.statuses[KEPT]} kept within {hops} hop{'s' if hops != 1 else ''}")
    if drawn.folded:
        parts.append(f"{drawn.folded} small constants written in their users")
    shown = drawn.drawn + drawn.folded
    cut = f"; {shown} of {drawn.total} drawn" if shown < drawn.total else ""
    return (f'<p class="note">{", ".join(parts)}{cut}. Module: {module_size} '
            "instructions.</p>")


def _site_panes(f: FunctionDiff, change: SiteChange, anchor: str, hops: int,
                max_nodes: int) -> tuple[str, str]:
    """The pair of one change, and the inside of its kernel (or "")."""
    sides = _sides(f, change, hops, max_nodes)
    drawings = [picture.draw(drawn.picture) for _, _, drawn in sides]
    scale = _scale([d.width for d in drawings])
    panes = []
    for (name, side, drawn), drawing in zip(sides, drawings):
        big = f"big-{anchor}-{name}"
        module = f.diff.before if side == "before" else f.diff.after
        panes.append(
            f'<input type="checkbox" class="big" id="{big}"><div class="side">'
            f'<h3>{name}<label class="enlarge" for="{big}">enlarge</label></h3>'
            f'<div class="pane">{drawing.svg(scale)}</div>'
            f"{_side_note(drawn, hops, sum(len(c) for c in module.computations.values()))}"
            "</div>")
    box = sides[1][2].box
    inside = ""
    if box is not None:
        drawing = picture.draw(kernel_picture(f.diff, box, max_nodes).picture)
        inside = (f"<details><summary>inside the {html.escape(box.name)} kernel "
                  f"({len(box.nodes)} instructions, drawn as one box above)</summary>"
                  f'<div class="pane">{drawing.svg(_scale([drawing.width]))}</div></details>')
    return _pair(anchor, panes), inside


def _sides(f: FunctionDiff, change: SiteChange, hops: int, max_nodes: int
           ) -> list[tuple[str, str, Drawn]]:
    """(name, side, picture) of the native and the rewritten side of `change`, each
    without the other changes' instructions."""
    out = []
    for side, name, own in (("before", "native", lambda c: c.removed),
                            ("after", "rewritten", lambda c: c.added)):
        elsewhere = frozenset().union(*(own(c) for c in f.changes if c is not change))
        out.append((name, side, site_picture(f.diff, change, side, hops, max_nodes,
                                             elsewhere=elsewhere)))
    return out


def html_report(functions: Sequence[FunctionDiff], hops: int = DEFAULT_HOPS,
                max_nodes: int = DEFAULT_MAX_NODES, title: str = "hlotool diff",
                verdicts: Sequence[str | None] = ()) -> str:
    """One self-contained HTML page that opens on the first site: a short header (the
    verdicts, where the diff shows a kernel auto keeps out, and a table of sites), then per
    site its line of counts, native and rewritten side by side at one scale, and its
    kernel's inside on demand; each function's normalized text diff after its sites.
    No scripts, no network."""
    verdicts = [*verdicts, *[None] * len(functions)]
    said: dict[str, list[str]] = {}
    for f, verdict in zip(functions, verdicts):
        if verdict:
            said.setdefault(verdict, []).append(f.function)
    banners = "".join(f'<p class="verdict"><b>{html.escape(", ".join(names))}</b>: '
                      f"{html.escape(v)}</p>" for v, names in said.items())
    table, sections = [], []
    same_as: dict[str, str] = {}  # anchor → anchor of an identical change drawn earlier
    drawn_first: dict[tuple, str] = {}
    for fi, f in enumerate(functions):
        for si, change in enumerate(f.changes):
            anchor, what = f"f{fi}-s{si}", html.escape(_site_title(change))
            line = html.escape(change_line(f, change))
            number = str(si + 1) if change.site is not None else "–"
            table.append(
                f"<tr><td>{number}</td><td>{html.escape(f.function)}</td>"
                f"<td><a href=\"#{anchor}\">{what}</a></td><td>{line}</td></tr>")
            pair = inside = ""
            if change.regions:
                first = drawn_first.setdefault((fi, _signature(f.diff, change)), anchor)
                same_as[anchor] = first
                if first == anchor:
                    pair, inside = _site_panes(f, change, anchor, hops, max_nodes)
            label = f"site {number}" if change.site is not None else "other"
            sections.append(
                f"<section id=\"{anchor}\"><h2>{html.escape(f.function)} · {label}: {what}"
                f"</h2><p class=\"line\">{line}</p>{_same(anchor, same_as)}{pair}{inside}"
                "</section>")
        sections.append(
            f"<details open><summary>{html.escape(f.function)}: normalized HLO diff "
            f"({f.stage}, {f.target})</summary>{_diff_pre(f.diff.unified() or 'no change')}"
            "</details>")
    stages = ", ".join(sorted({f"{f.stage} / {f.target}" for f in functions}))
    return (
        f"<!DOCTYPE html>\n<!-- {MARK} -->\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>{banners}"
        f"<p class=\"meta\">stage: {html.escape(stages)} &nbsp; {_legend()}</p>"
        "<table><tr><th>#</th><th>function</th><th>site</th><th>change</th></tr>"
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


def _piece(drawn: Drawn, fmt: str) -> str | bytes:
    if fmt == "svg":
        return f"<!-- {MARK} -->\n" + picture.draw(drawn.picture).svg()
    source = picture.dot(drawn.picture)
    return source if fmt == "dot" else run_dot(source, fmt)


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
            sides = _sides(f, change, hops, max_nodes)
            for name, _, drawn in sides:
                write(f"{stem}.site{si}.{name}.{fmt}", _piece(drawn, fmt))
            box = sides[1][2].box
            if box is not None:
                write(f"{stem}.site{si}.kernel.{fmt}",
                      _piece(kernel_picture(f.diff, box, max_nodes), fmt))
    return written
