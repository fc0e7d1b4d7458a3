"""Structural diff of two HLO modules: which instructions a rewrite removed, added and kept.

Instructions are matched by structure, never by name (XLA renumbers names on every
lowering). The matching follows XLA's own ``hlo_diff`` tool (xla/hlo/tools/hlo_diff):

1. the entry roots are mapped to each other when they agree in opcode and shape;
2. exact subgraphs: every instruction gets a fingerprint of its opcode, shape, attributes
   and, recursively, its operands' and called computations' fingerprints; equal
   fingerprints are paired tallest first, and a paired subgraph maps node by node;
3. top-down: operands at the same position of mapped instructions are mapped when their
   opcode and shape agree (this reaches what sits *under* a changed subgraph);
4. bottom-up: users of mapped instructions are mapped when they take the mapped operand at
   the same position and agree in opcode, shape and attributes (this reaches the layers
   *after* a swapped attention, whose fingerprints all changed).

What stays unmatched is removed (before only) or added (after only). Connected removed and
added instructions form `Region`s, the unit a report shows per attention site.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import heapq
from collections.abc import Iterable, Sequence

import networkx as nx

from hlotool.errors import HlotoolError
from hlotool.hlo import Computation, Instruction, Module, as_module, node_id, to_graph
from hlotool.hlo.ir import CALLED_COMPUTATION_ATTRS, split_names
from hlotool.hlo.printer import print_instruction
from hlotool.passes.native import score_sized
from hlotool.site import AttentionSite

# Attributes that say where an instruction came from, not what it computes.
_IGNORED_ATTRS = frozenset({"metadata", *CALLED_COMPUTATION_ATTRS})
# Longest attribute value the normalized text keeps (a Mosaic kernel body runs to megabytes).
_MAX_ATTR_CHARS = 160

KEPT, REMOVED, ADDED = "kept", "removed", "added"

# Operand-free instructions whose value is not fixed by the program text.
_NOT_CONSTANT = frozenset({
    "parameter", "custom-call", "rng", "rng-bit-generator", "rng-get-and-update-state",
    "infeed", "recv", "partition-id", "replica-id", "after-all",
})


def _local_key(inst: Instruction) -> tuple:
    """What an instruction computes, apart from its inputs."""
    attrs = tuple(sorted((k, v) for k, v in inst.attributes.items() if k not in _IGNORED_ATTRS))
    return (inst.opcode, str(inst.shape), inst.literal, inst.parameter_number, attrs)


@dataclasses.dataclass
class _Side:
    """One module prepared for matching: graph, instructions by node id, fingerprints."""

    module: Module
    graph: nx.MultiDiGraph
    inst: dict[str, Instruction]
    order: dict[str, int]  # text position
    fingerprint: dict[str, int]
    height: dict[str, int]
    local: dict[str, tuple]
    constant: set[str]  # values computed from constants alone (a mask built from iotas)
    callers: dict[str, list[str]]  # computation → node ids of instructions that call it

    @classmethod
    def build(cls, module: Module) -> _Side:
        graph = to_graph(module)
        inst = {n: d["instruction"] for n, d in graph.nodes(data=True)}
        order = {n: i for i, n in enumerate(node_id(c.name, i.name)
                                            for c in module.computations.values() for i in c)}
        callers = {callee: [node_id(c, i.name) for c, i in calls]
                   for callee, calls in module.callers().items()}
        side = cls(module, graph, inst, order, {}, {}, {}, set(), callers)
        side._fingerprint()
        return side

    def operands(self, n: str) -> list[str]:
        comp = self.graph.nodes[n]["computation"]
        return [node_id(comp, o) for o in self.inst[n].operands]

    def callee_roots(self, n: str) -> list[str]:
        comps = self.module.computations
        return [node_id(c, comps[c].root.name) for c in self.inst[n].called_computations
                if c in comps]

    def is_entry_parameter(self, n: str) -> bool:
        return (self.inst[n].opcode == "parameter"
                and self.graph.nodes[n]["computation"] == self.module.entry.name)

    def users(self, n: str) -> list[tuple[str, int]]:
        """(user, operand position) for every operand use of `n`."""
        return [(v, d["index"]) for _, v, d in self.graph.out_edges(n, data=True)
                if d["kind"] == "operand"]

    def _topological(self, deps: dict[str, list[str]]) -> list[str]:
        """Every node after its dependencies (text order is one already, almost always)."""
        done: set[str] = set()
        out: list[str] = []
        for start in sorted(deps, key=self.order.__getitem__):
            if start in done:
                continue
            stack, active = [(start, iter(deps[start]))], {start}
            while stack:
                n, pending = stack[-1]
                d = next((d for d in pending if d not in done), None)
                if d is None:
                    stack.pop()
                    active.discard(n)
                    done.add(n)
                    out.append(n)
                elif d in active:
                    raise HlotoolError(f"HLO module {self.module.name!r} has an operand "
                                       f"cycle through {d}")
                else:
                    active.add(d)
                    stack.append((d, iter(deps[d])))
        return out

    def _fingerprint(self) -> None:
        deps = {n: [*self.operands(n), *self.callee_roots(n)] for n in self.inst}
        for n in self._topological(deps):
            local = _local_key(self.inst[n])
            self.local[n] = local
            self.fingerprint[n] = hash((local, *(self.fingerprint[d] for d in deps[n])))
            self.height[n] = 1 + max((self.height[d] for d in deps[n]), default=0)
            inst = self.inst[n]
            if (inst.opcode not in _NOT_CONSTANT
                    and (inst.opcode == "fusion" or not inst.called_computations)
                    and all(d in self.constant for d in self.operands(n))):
                self.constant.add(n)


class _Matcher:
    def __init__(self, a: _Side, b: _Side):
        self.a, self.b = a, b
        self.fwd: dict[str, str] = {}
        self.back: dict[str, str] = {}

    def free(self, x: str, y: str) -> bool:
        return x not in self.fwd and y not in self.back

    def alike(self, x: str, y: str) -> bool:
        """Same opcode and shape, enough to pair two operands of paired instructions; a
        custom-call must match in full (XLA's online-softmax and a splash kernel are two
        calls of one target and one shape)."""
        la, lb = self.a.local[x], self.b.local[y]
        return la == lb if la[0] == "custom-call" else la[:2] == lb[:2]

    def pair(self, x: str, y: str) -> None:
        self.fwd[x] = y
        self.back[y] = x

    def run(self) -> dict[str, str]:
        ra = node_id(self.a.module.entry.name, self.a.module.entry.root.name)
        rb = node_id(self.b.module.entry.name, self.b.module.entry.root.name)
        self._exact()
        if self.free(ra, rb) and self.alike(ra, rb):
            self.pair(ra, rb)
        worklist = list(self.fwd.items())
        while worklist:
            more = self._top_down(worklist) + self._bottom_up(worklist)
            worklist = more
        self._shared_callees()
        self._equal_constants()
        return self.fwd

    def _equal_constants(self) -> None:
        """An unmatched value built from constants alone that equals one on the other side
        (same fingerprint) is kept, many-to-one: re-tracing a site natively repeats the
        literals jax had shared, which changes the text but no value."""
        for one, other, ours in ((self.a, self.b, self.fwd), (self.b, self.a, self.back)):
            by_fingerprint = {other.fingerprint[n]: n for n in other.constant}
            for n in sorted(one.constant, key=one.order.__getitem__):
                twin = by_fingerprint.get(one.fingerprint[n])
                if n not in ours and twin is not None:
                    ours[n] = twin

    def _shared_callees(self) -> None:
        """Kept callers whose called computations are identical but were printed once on one
        side and once per caller on the other (jax shares a reducer between reductions only
        sometimes): the extra copies are kept too, mapped many-to-one."""
        for x, y in list(self.fwd.items()):
            for rx, ry in zip(self.a.callee_roots(x), self.b.callee_roots(y)):
                if self.a.fingerprint[rx] != self.b.fingerprint[ry]:
                    continue
                stack = [(rx, ry)]
                while stack:
                    u, v = stack.pop()
                    if u in self.fwd and v in self.back:
                        continue
                    self.fwd.setdefault(u, v)
                    self.back.setdefault(v, u)
                    stack.extend(zip(self.a.operands(u), self.b.operands(v)))

    def _exact(self) -> None:
        groups_b: dict[int, list[str]] = collections.defaultdict(list)
        for n in sorted(self.b.inst, key=self.b.order.__getitem__):
            groups_b[self.b.fingerprint[n]].append(n)
        for x in sorted(self.a.inst, key=lambda n: (-self.a.height[n], self.a.order[n])):
            if x in self.fwd:
                continue
            candidates = groups_b.get(self.a.fingerprint[x], [])
            while candidates and candidates[0] in self.back:
                candidates.pop(0)
            if candidates:
                self._map_subgraph(x, candidates.pop(0))

    def _map_subgraph(self, x: str, y: str) -> None:
        """Maps two instructions with equal fingerprints and everything beneath them."""
        stack = [(x, y)]
        while stack:
            x, y = stack.pop()
            if not self.free(x, y):
                continue
            self.pair(x, y)
            stack.extend(zip(self.a.operands(x), self.b.operands(y)))
            stack.extend(zip(self.a.callee_roots(x), self.b.callee_roots(y)))

    def _top_down(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        found = []
        stack = list(pairs)
        while stack:
            x, y = stack.pop()
            below = [*zip(self.a.operands(x), self.b.operands(y)),
                     *zip(self.a.callee_roots(x), self.b.callee_roots(y))]
            for ox, oy in below:
                if self.free(ox, oy) and self.alike(ox, oy):
                    self.pair(ox, oy)
                    found.append((ox, oy))
                    stack.append((ox, oy))
        return found

    def _bottom_up(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        found = []
        stack = list(pairs)
        while stack:
            x, y = stack.pop()
            if _is_leaf(self.a.inst[x]) and not self.a.is_entry_parameter(x):
                continue  # a constant or a loop's state has users everywhere: no evidence
            users_b = [(u, i) for u, i in self.b.users(y) if u not in self.back]
            for ux, index in sorted(self.a.users(x), key=lambda t: self.a.order[t[0]]):
                if ux in self.fwd:
                    continue
                for uy, index_b in users_b:
                    if (index_b == index and uy not in self.back
                            and self.a.local[ux] == self.b.local[uy]):
                        self.pair(ux, uy)
                        found.append((ux, uy))
                        stack.append((ux, uy))
                        break
        return found


@dataclasses.dataclass(frozen=True)
class Region:
    """Connected instructions the rewrite removed (node ids of `before`) and added (of `after`)."""

    removed: frozenset[str]
    added: frozenset[str]


@dataclasses.dataclass(frozen=True)
class ChangeStats:
    """Counts that summarize a change. `score_buffers` counts the site's L×L buffers
    (`hlotool.passes.native.score_sized`) outside fusion bodies and reducers, before → after."""

    removed: int
    added: int
    custom_calls_added: tuple[str, ...]  # target (and XLA's op name) of each added custom-call
    custom_calls_removed: tuple[str, ...]
    fusions_removed: int
    fusions_added: int
    score_buffers: tuple[int, int] | None = None

    def line(self) -> str:
        """One line, e.g.
        ``−14 instructions, +3 (1 custom-call tpu_custom_call), L×L buffers 2 → 0``."""
        if not (self.removed or self.added):
            return "no change"
        parts = [f"−{self.removed} instructions", f"+{self.added}"] if self.removed else \
            [f"+{self.added} instructions"]
        extra = [f"{n} custom-call {t}" for t, n in
                 collections.Counter(self.custom_calls_added).items()]
        if extra:
            parts[-1] += f" ({', '.join(extra)})"
        for t, n in collections.Counter(self.custom_calls_removed).items():
            parts.append(f"−{n} custom-call {t}")
        if self.fusions_removed or self.fusions_added:
            parts.append(f"fusions −{self.fusions_removed} +{self.fusions_added}")
        if self.score_buffers is not None:
            parts.append(f"L×L buffers {self.score_buffers[0]} → {self.score_buffers[1]}")
        return ", ".join(parts)


@dataclasses.dataclass
class ModuleDiff:
    """Two modules (calls inlined) and how their instructions correspond.

    `mapping` maps kept node ids of `before` to node ids of `after` (``"computation/name"``,
    as `hlotool.hlo.to_graph` names nodes; many-to-one where one side prints a shared
    computation once and the other once per caller); `removed` and `added` are in text
    order.
    """

    before: Module
    after: Module
    before_graph: nx.MultiDiGraph
    after_graph: nx.MultiDiGraph
    mapping: dict[str, str]
    reverse: dict[str, str]  # kept node ids of `after` → `before`
    removed: list[str]
    added: list[str]
    regions: list[Region]
    _before_side: _Side = dataclasses.field(repr=False)
    _after_side: _Side = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        self._added = frozenset(self.added)

    @property
    def unchanged(self) -> bool:
        return not (self.removed or self.added)

    def status(self, side: str, node: str) -> str:
        """`KEPT`, `REMOVED` or `ADDED` for a node of side "before" or "after"."""
        if side == "before":
            return KEPT if node in self.mapping else REMOVED
        return ADDED if node in self._added else KEPT

    def computation_nodes(self, side: str, computation: str) -> list[str]:
        """Node ids of the instructions of `computation` on `side`, in text order."""
        module = self.before if side == "before" else self.after
        return [node_id(computation, i.name) for i in module.computations[computation]]

    def in_place(self, before: str, after: str) -> bool:
        """Whether kept `before` and its counterpart `after` sit in corresponding
        computations (a value built from constants alone may be kept as its twin inside
        a kernel's loop body)."""
        return _same_place(self._before_side, self._after_side, self.mapping, before, after)

    def instruction(self, side: str, node: str) -> Instruction:
        return (self._before_side if side == "before" else self._after_side).inst[node]

    def score_sized(self, side: str, node: str, site: AttentionSite) -> bool:
        """Whether `node` is one of `site`'s L×L buffers (a device's share in a split
        program), as `inspect` counts them (`hlotool.passes.native.score_sized`)."""
        module = self.before if side == "before" else self.after
        return score_sized(self.instruction(side, node).shape, site, module.partitions)

    def fused(self, side: str, node: str) -> bool:
        """True when `node` lives in a fusion body or a reducer, not in a program-level
        computation (entry, loop body, branch), so it is no buffer of its own."""
        s = self._before_side if side == "before" else self._after_side
        comp = s.graph.nodes[node]["computation"]
        return any(s.inst[c].opcode not in ("while", "conditional", "call")
                   for c in s.callers.get(comp, ()))

    def stats(self, removed: Iterable[str] | None = None, added: Iterable[str] | None = None,
              site: AttentionSite | None = None) -> ChangeStats:
        """Counts over the given removed/added nodes (default: the whole diff)."""
        removed = list(self.removed if removed is None else removed)
        added = list(self.added if added is None else added)
        a = [self.instruction("before", n) for n in removed]
        b = [self.instruction("after", n) for n in added]
        buffers = None
        if site is not None:
            buffers = (
                sum(self.score_sized("before", n, site) for n in removed
                    if not self.fused("before", n)),
                sum(self.score_sized("after", n, site) for n in added
                    if not self.fused("after", n)),
            )
        return ChangeStats(
            removed=len(a), added=len(b),
            custom_calls_added=tuple(_custom_call(i) for i in b if i.opcode == "custom-call"),
            custom_calls_removed=tuple(_custom_call(i) for i in a if i.opcode == "custom-call"),
            fusions_removed=sum(i.opcode == "fusion" for i in a),
            fusions_added=sum(i.opcode == "fusion" for i in b),
            score_buffers=buffers,
        )

    def normalized_texts(self) -> tuple[str, str]:
        """Both modules printed with names that do not depend on XLA's numbering: a kept
        instruction has the same name on both sides, so a text diff shows only changes.
        Metadata is dropped and long attribute values are shortened."""
        names_a: dict[str, str] = {}
        names_b: dict[str, str] = {}
        counters: collections.Counter[str] = collections.Counter()
        for n in sorted(self._before_side.inst, key=self._before_side.order.__getitem__):
            op = self._before_side.inst[n].opcode
            names_a[n] = f"{op}.{counters[op]}"
            counters[op] += 1
        new: collections.Counter[str] = collections.Counter()
        for n in sorted(self._after_side.inst, key=self._after_side.order.__getitem__):
            if n in self.reverse:
                names_b[n] = names_a[self.reverse[n]]
            else:
                op = self._after_side.inst[n].opcode
                names_b[n] = f"{op}.new{new[op]}"
                new[op] += 1
        a, b = self._before_side, self._after_side
        rank = {y: a.order[x] for x, y in self.mapping.items()}
        return _print(a, names_a, a.order), _print(b, names_b, rank)

    def unified(self, context: int = 3) -> str:
        """Unified diff of the normalized texts ("" when nothing changed)."""
        a, b = self.normalized_texts()
        return "".join(difflib.unified_diff(
            a.splitlines(keepends=True), b.splitlines(keepends=True),
            fromfile=f"native/{self.before.name}", tofile=f"rewritten/{self.after.name}",
            n=context,
        ))


def _custom_call(inst: Instruction) -> str:
    """The call's target, plus the op name XLA gave it when XLA made it (XLA:TPU's own
    attention is ``tpu_custom_call[online-softmax]``; jax's op names are paths with '/')."""
    target = inst.custom_call_target or "?"
    op_name = inst.metadata.get("op_name", "")
    return f"{target}[{op_name}]" if op_name and "/" not in op_name else target


def _computation_names(side: _Side, names: dict[str, str]) -> dict[str, str]:
    """A computation is named after its root instruction's normalized name."""
    out = {}
    for comp in side.module.computations.values():
        root = names[node_id(comp.name, comp.root.name)]
        out[comp.name] = ("ENTRY" if comp.is_entry else "comp") + f"<{root}>"
    return out


def _aligned(side: _Side, nodes: list[str], rank: dict[str, int]) -> list[str]:
    """`nodes` in an order that puts operands first and otherwise follows `rank` (the text
    position of each kept node's counterpart), so that both sides print in the same order
    and a text diff aligns them; an unranked (added) node follows its operands, or precedes
    its first user when it has no ranked operand."""
    inside = set(nodes)
    deps = {n: [o for o in side.operands(n) if o in inside] for n in nodes}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for n, ops in deps.items():
        for o in ops:
            users[o].append(n)
    waiting = {n: len(set(ops)) for n, ops in deps.items()}
    text_order = sorted(nodes, key=side.order.__getitem__)
    key: dict[str, int | None] = {}
    for n in text_order:
        known = [key[o] for o in deps[n] if key[o] is not None]
        key[n] = rank.get(n, max(known, default=None))
    # Added constants (and what is built from them alone) go just before their first user.
    for n in reversed(text_order):
        if key[n] is None:
            known = [key[u] for u in users[n] if key[u] is not None]
            key[n] = min(known, default=-1)
    ready = [(key[n], side.order[n], n) for n in nodes if not waiting[n]]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in set(users[n]):
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (key[u], side.order[u], u))
    return out


def _print(side: _Side, names: dict[str, str], rank: dict[str, int]) -> str:
    comp_names = _computation_names(side, names)
    comps = sorted(side.module.computations.values(),
                   key=lambda c: rank.get(node_id(c.name, c.root.name), 1 << 60))
    blocks = []
    for comp in comps:
        lines = [f"{comp_names[comp.name]} {{"]
        order = _aligned(side, [node_id(comp.name, i.name) for i in comp], rank)
        for inst in (side.inst[n] for n in order):
            attrs = {}
            for key, value in inst.attributes.items():
                if key == "metadata":
                    continue
                if key in CALLED_COMPUTATION_ATTRS:
                    called = [f"%{comp_names.get(c, c)}" for c in split_names(value)]
                    value = called[0] if len(called) == 1 and not value.startswith("{") \
                        else "{" + ", ".join(called) + "}"
                elif len(value) > _MAX_ATTR_CHARS:
                    value = f"{value[:_MAX_ATTR_CHARS]}…<{len(value)} chars>"
                attrs[key] = value
            clone = dataclasses.replace(
                inst, name=names[node_id(comp.name, inst.name)], attributes=attrs,
                operands=[names[node_id(comp.name, o)] for o in inst.operands],
                is_root=inst is comp.root,
            )
            lines.append("  " + print_instruction(clone))
        lines.append("}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _regions(a: _Side, b: _Side, mapping: dict[str, str], removed: list[str],
             added: list[str]) -> list[Region]:
    """Groups changed nodes. Two changed nodes of one side join when an operand edge or a
    call edge links them (a computation with several callers, such as a shared reducer,
    joins its first caller only); a removed and an added node join when they touch the same
    kept instruction. Constant values (literals, iotas, masks built from them) are shared too
    widely to say anything: a changed one joins its first changed user only, so a mask
    constant shared by two sites does not merge them, and one with none (a constant left
    dead by the rewrite) joins the group nearest to it in text order."""
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(x: tuple[str, str]) -> tuple[str, str]:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x: tuple[str, str], y: tuple[str, str]) -> None:
        parent[find(x)] = find(y)

    parent.update({("a", n): ("a", n) for n in removed})
    parent.update({("b", n): ("b", n) for n in added})
    # Kept instructions a change feeds (its consumers) and reads (its inputs), by after id:
    # only those kept in the same place on both sides (a value built from constants alone
    # may be kept as its twin inside a kernel's loop body) and in no computation that
    # several layers share.
    linking = {y for x, y in mapping.items() if _same_place(a, b, mapping, x, y)
               and not _generic(a, x) and not _generic(b, y)}
    feeds: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    reads: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
    for tag, side, changed in (("a", a, removed), ("b", b, added)):
        for n in changed:
            edges = [*side.graph.in_edges(n, data=True), *side.graph.out_edges(n, data=True)]
            for u, v, d in edges:
                if d["kind"] == "called" and side.callers[d["computation"]][0] != v:
                    continue  # a shared computation (reducer) belongs to its first caller
                w = u if v == n else v
                if (tag, w) in parent:
                    if n not in side.constant and w not in side.constant:
                        union((tag, w), (tag, n))
                elif w not in side.constant and d["kind"] == "operand" and \
                        (mapping.get(w) if tag == "a" else w) in linking:
                    kept = mapping[w] if tag == "a" else w
                    (feeds if w == v else reads)[kept].append((tag, n))

    def link(touching: dict[str, list[tuple[str, str]]]) -> None:
        for members in touching.values():
            if {t for t, _ in members} == {"a", "b"}:
                for m in members[1:]:
                    union(members[0], m)

    # A site's output has its own consumers while its inputs (a shared mask, the same
    # activations) may feed several sites: join on consumers first, and on inputs only
    # the changes still seen on one side.
    link(feeds)
    sides: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for x in parent:
        sides[find(x)].add(x[0])
    one_sided = {x for x in parent if len(sides[find(x)]) == 1}
    link({k: [m for m in members if m in one_sided] for k, members in reads.items()})
    for tag, side, changed in (("a", a, removed), ("b", b, added)):
        for n in changed:
            users = sorted((u for u, _ in side.users(n) if (tag, u) in parent),
                           key=side.order.__getitem__)
            if n in side.constant and users:
                union((tag, n), (tag, users[0]))
    groups: dict[tuple[str, str], list[tuple[str, str]]] = collections.defaultdict(list)
    for x in parent:
        groups[find(x)].append(x)

    def position(x: tuple[str, str]) -> int:
        return (a if x[0] == "a" else b).order[x[1]]

    def leaves_only(g: list[tuple[str, str]]) -> bool:
        return all(n in (a if t == "a" else b).constant for t, n in g)

    def distance(group: list[tuple[str, str]], x: tuple[str, str]) -> int:
        same = [abs(position(y) - position(x)) for y in group if y[0] == x[0]]
        return min(same, default=1 << 60)

    roots = sorted(groups, key=lambda r: min(map(position, groups[r])))
    anchors = [r for r in roots if not leaves_only(groups[r])]
    for r in roots:
        if anchors and leaves_only(groups[r]):
            nearest = min(anchors, key=lambda q: distance(groups[q], groups[r][0]))
            groups[nearest].extend(groups.pop(r))
    return [
        Region(frozenset(n for t, n in groups[r] if t == "a"),
               frozenset(n for t, n in groups[r] if t == "b"))
        for r in roots if r in groups
    ]


def _generic(side: _Side, node: str) -> bool:
    """Whether kept `node` lives in a computation that is no one site's: a reducer or
    fusion body, or one that several instructions call (jax prints a loop body or reducer
    once for every layer that runs it). Two changes touching it may be different layers."""
    callers = side.callers.get(side.graph.nodes[node]["computation"], ())
    return len(callers) > 1 or any(side.inst[c].opcode not in ("while", "conditional", "call")
                                   for c in callers)


def _same_place(a: _Side, b: _Side, mapping: dict[str, str], x: str, y: str) -> bool:
    """Whether kept `x` (before) and `y` (after) sit in computations that correspond: the
    root of `x`'s maps to the root of `y`'s."""
    ca = a.module.computations[a.graph.nodes[x]["computation"]]
    cb = b.module.computations[b.graph.nodes[y]["computation"]]
    return mapping.get(node_id(ca.name, ca.root.name)) == node_id(cb.name, cb.root.name)


def _is_leaf(inst: Instruction) -> bool:
    return not inst.operands and not inst.called_computations


def _as_module(module: Module | str, what: str) -> Module:
    return _forward_tuples(as_module(module, f"diff's {what}", source=what))


def _forward_tuples(module: Module) -> Module:
    """`module` with each `get-tuple-element(tuple(...))` read as the element itself, and
    tuples and reads left unused dropped: inlining a jit that returns several values leaves
    such pairs, which are packaging, not computation."""
    computations = {}
    for comp in module.computations.values():
        by_name = {i.name: i for i in comp}
        alias: dict[str, str] = {}
        for inst in comp:
            source = by_name.get(inst.operands[0]) if inst.operands else None
            if inst.opcode == "get-tuple-element" and source is not None \
                    and source.opcode == "tuple":
                element = source.operands[int(inst.attributes["index"])]
                alias[inst.name] = alias.get(element, element)
        if not alias:
            computations[comp.name] = comp
            continue
        root = comp.root
        kept = [dataclasses.replace(i, operands=[alias.get(o, o) for o in i.operands])
                for i in comp if i.name not in alias or i is root]
        used = {o for i in kept for o in i.operands}
        kept = [i for i in kept if i.opcode != "tuple" or i.name in used or i.name == root.name]
        kept[[i.name for i in kept].index(root.name)].is_root = True
        computations[comp.name] = Computation(comp.name, kept, comp.is_entry, comp.signature,
                                              comp.line)
    return Module(module.name, computations, dict(module.attributes), module.stack_table,
                  module.source_name)


def diff_modules(before: Module | str, after: Module | str) -> ModuleDiff:
    """The structural diff of `before` (native) and `after` (rewritten), calls inlined first
    (so jit nesting does not count as change, and node ids agree with `passes.from_hlo`)."""
    a = _Side.build(_as_module(before, "before"))
    b = _Side.build(_as_module(after, "after"))
    matcher = _Matcher(a, b)
    mapping = matcher.run()
    removed = sorted((n for n in a.inst if n not in mapping), key=a.order.__getitem__)
    added = sorted((n for n in b.inst if n not in matcher.back), key=b.order.__getitem__)
    return ModuleDiff(a.module, b.module, a.graph, b.graph, mapping, matcher.back, removed,
                      added, _regions(a, b, mapping, removed, added), a, b)


@dataclasses.dataclass
class SiteChange:
    """What the rewrite did to one attention site: the regions attributed to it."""

    site: AttentionSite | None  # None: changes no detected site accounts for
    regions: list[Region]

    @property
    def removed(self) -> set[str]:
        return set().union(*(r.removed for r in self.regions))

    @property
    def added(self) -> set[str]:
        return set().union(*(r.added for r in self.regions))


SiteNodes = tuple[AttentionSite, set[str], set[str]]


def site_nodes(module: Module | str, function: str = "") -> list[SiteNodes]:
    """The attention sites detected in pre-optimization HLO, each with the node ids of its
    body (in the module `diff_modules` makes of the same text) and its user source lines."""
    from hlotool.passes.from_hlo import find_matches

    module = _as_module(module, "module")
    ids = {i.name: node_id(c.name, i.name) for c in module.computations.values() for i in c}
    return [
        (m.site, {ids[n.ref] for n in m.body if n.ref in ids},
         {n.source for n in m.body if n.source})
        for m in find_matches(module, function or module.name)
    ]


def by_site(diff: ModuleDiff, sites: Sequence[SiteNodes]) -> list[SiteChange]:
    """Attributes each region to the site it overlaps most: by node ids of `before` when the
    site was detected in the same module, else by the user source lines both share (the
    optimized stage, where fusion renamed everything); a region that fits several sites
    equally (layers written by one line of code) goes to the first of them still without
    one. `sites` holds (site, node ids, source lines). Regions no site accounts for come
    last, under site None."""
    changes = [SiteChange(s, []) for s, _, _ in sites]
    other = SiteChange(None, [])
    for region in diff.regions:
        lines = {_line(diff.instruction("before", n)) for n in region.removed} | \
                {_line(diff.instruction("after", n)) for n in region.added}
        lines.discard(None)
        scores = [(len(region.removed & ids), len(lines & src)) for _, ids, src in sites]
        top = max(scores, default=(0, 0))
        if top == (0, 0):
            other.regions.append(region)
            continue
        # Layers share source lines: among equal candidates, the next site in program order.
        tied = [i for i, score in enumerate(scores) if score == top]
        best = min(tied, key=lambda i: (len(changes[i].regions), i))
        changes[best].regions.append(region)
    return changes + ([other] if other.regions else [])


def _line(inst: Instruction) -> str | None:
    try:
        return inst.user_source
    except HlotoolError:
        return None


@dataclasses.dataclass
class FunctionDiff:
    """One captured function diffed at one stage: what a report shows for it."""

    function: str
    stage: str  # "hlo" (pre-optimization) or "optimized"
    target: str
    diff: ModuleDiff
    changes: list[SiteChange]
