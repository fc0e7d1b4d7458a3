"""What XLA does natively with each attention site: where its work lands after optimization.

    fates = native_fate(captured_function, "tpu-v5e")   # one `NativeFate` per site
    fates[0].placements    # top-level fusions / custom calls holding the site's work
    fates[0].score_buffers # [.., Lq, Lk] values still written to memory

XLA renames everything, so a site's pre-optimization instructions are found again through
what survives optimization: each instruction's `metadata={op_name=... stack_frame_id=...}`,
kept on fused instructions too. A top-level instruction (entry, loop body or branch) whose
own metadata or fused body carries a site's (op_name, Python stack) belongs to that site.
Some of the work loses its metadata on the way (XLA:CPU's dots, XLA:TPU's `online-softmax`
custom call, layout converts), so each site's region then grows along the dataflow through
instructions with no known metadata: those between two of its instructions, score-sized
producers before it, and the consumers of its score-sized values (the P·V contraction).

Layers written by the same line of code carry identical metadata. Their instructions are
grown together and fall into connected pieces: a piece that reads another's score-sized
values (a backward pass reading the forward's probabilities) goes with it, the others are
dealt out to the sites in program order. That is a heuristic; a site whose work XLA merged
with its neighbour's (one fusion holding the end of one layer and the start of the next)
shows that fusion under one of them only.

With `backward`, a site in a program that takes its own gradient also gets the work of its
derivative: jax's AD names each transposed equation in the forward's scope under
`transpose(...)`, at the forward's Python stack (`_transposed`). `hlotool profile` times a
train step's sites so; `inspect` shows where the forward's scores go.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from hlotool.errors import HlotoolError
from hlotool.hlo import Instruction, Module, Shape, as_module
from hlotool.passes.attention import Match
from hlotool.passes.from_hlo import find_matches
from hlotool.site import AttentionSite

if TYPE_CHECKING:
    from hlotool.capture import CapturedFunction
    from hlotool.targets import Target

# Instructions that only run other computations as whole programs (their bodies are scanned
# as program levels of their own), unlike fusions and reducers.
_LEVEL_CALLS = frozenset({"while", "conditional", "call"})
# Instructions that only relabel a value (no work, no buffer of their own).
_VIEWS = frozenset({"bitcast", "get-tuple-element", "tuple"})
ONLINE_SOFTMAX = "online-softmax"
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
# What XLA's SPMD partitioner inserts to move values between the devices of a split program
# (XLA:TPU issues them as async `-start`/`-done` pairs: the start is the one counted).
COLLECTIVES = frozenset({"all-gather", "all-to-all", "all-reduce", "reduce-scatter",
                         "collective-permute", "all-gather-start", "all-reduce-start",
                         "collective-permute-start"})

_Key = tuple[str, tuple[tuple[str, int], ...]]  # (op_name, ((file, line), ...))
# Leading jit/jvp scopes of an op_name: an inlined call's ops print their names relative to
# the call, the optimized program's in full ("jit(step)/jvp(jit(forward))/exp" → "exp").
# A backward op keeps its "transpose(...)" scope and so never passes for the forward one.
_WRAPPERS = re.compile(r"^(?:(?:jit|pjit|jvp)\([^/]*\)(?:/|$))+")
# The scope jax's AD names a transposed (backward) equation under, before the forward's own
# scopes: "transpose(jvp(Model))/" or "transpose(jvp())/".
_TRANSPOSE = re.compile(r"^transpose\((?:(?:jit|pjit|jvp)\((?:[^/()]|\([^/()]*\))*\))*\)/")


@dataclasses.dataclass(frozen=True)
class Placement:
    """One top-level instruction of the optimized program that holds part of a site.

    what: "fusion kLoop", "fusion kCustom __ynn_fusion", "custom-call tpu_custom_call
    online-softmax", or the opcode. score_sized: its output is a [.., Lq, Lk] score value.
    memory_space: where XLA placed that output, from its layout's ``S(n)``: 0 is device
    memory (HBM); XLA:TPU puts values it keeps on chip (VMEM) in space 1.
    """

    name: str
    what: str
    shape: str
    score_sized: bool
    memory_space: int = 0
    nbytes: int = 0  # the output's size on one device
    # A collective's: the site's axis it moves along ("L" of a [B, L, H, D] K or V), or the
    # operand dimension where the value is none of the site's operands.
    along: str | None = None

    @property
    def collective(self) -> bool:
        return self.what in COLLECTIVES

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class NativeFate:
    """Where one site's work ended up in the program XLA optimized for `target`."""

    site: AttentionSite
    target: str
    placements: tuple[Placement, ...]
    partitions: int = 1  # the devices XLA split the program over (its num_partitions)

    @property
    def score_buffers(self) -> int:
        """[.., Lq, Lk] values the optimized program still writes out for this site."""
        return sum(p.score_sized for p in self.placements)

    @property
    def score_buffers_on_chip(self) -> int:
        """Those of `score_buffers` XLA keeps out of device memory (memory space > 0)."""
        return sum(p.score_sized and p.memory_space > 0 for p in self.placements)

    @property
    def online_softmax(self) -> bool:
        """Whether XLA:TPU rewrote the site into its own online-softmax custom call."""
        return any(p.what.endswith(ONLINE_SOFTMAX) for p in self.placements)

    @property
    def collectives(self) -> tuple[Placement, ...]:
        """The collectives XLA put in this site's work: a split program moving its operands
        between devices (an all-gather of K and V where the sequence is split)."""
        return tuple(p for p in self.placements if p.collective)

    def collectives_summary(self) -> str:
        """``2 all-gather along L (4.0 MiB per device)``, or "" without any."""
        from hlotool.units import format_bytes

        groups: dict[tuple[str, str | None], list[Placement]] = {}
        for p in self.collectives:
            groups.setdefault((p.what.removesuffix("-start"), p.along), []).append(p)
        return ", ".join(
            f"{len(ps)} {what}{f' along {along}' if along else ''} "
            f"({format_bytes(sum(p.nbytes for p in ps))} per device)"
            for (what, along), ps in groups.items())

    def summary(self) -> str:
        """One line, e.g. ``3 fusion kLoop, 1 custom-call tpu_custom_call online-softmax``."""
        if not self.placements:
            return "not found in the optimized program"
        counts = collections.Counter(p.what for p in self.placements)
        return ", ".join(f"{n} {what}" for what, n in counts.items())

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "placements": [p.to_json() for p in self.placements],
            "score_buffers": self.score_buffers,
            "score_buffers_on_chip": self.score_buffers_on_chip,
            "online_softmax": self.online_softmax,
            "partitions": self.partitions,
            "collectives": [p.to_json() for p in self.collectives],
        }


def native_fate(function: CapturedFunction, target: str | Target = "cpu",
                backward: bool = False) -> list[NativeFate]:
    """The native fate of every attention site of `function` on `target`, in the order
    detection reports the sites. Compiles `function` for `target` only when it has a site.
    backward: also place the work of each site's derivative where the program takes one (a
    train step): what the site costs a call, rather than where its scores go."""
    from hlotool.targets import get_target

    name = get_target(target).name
    pre = as_module(function.hlo(debug_info=True, target=name))
    matches = find_matches(pre, function.name)
    if not matches:
        return []
    return _fates(pre, matches, as_module(function.optimized(name), inline=False), name,
                  backward)


def native_fates(functions: Sequence[CapturedFunction], sites: Sequence[AttentionSite],
                 targets: Sequence[str]) -> list[dict[str, NativeFate]]:
    """Per site of `sites` (detected in `functions`, in that order), its native fate on each
    of `targets`. Only functions with a site are compiled. Raises HlotoolError when a
    target's lowering holds other sites than `sites`."""
    out: list[dict[str, NativeFate]] = [{} for _ in sites]
    for target in targets:
        fates = [fate for f in functions if any(s.function == f.name for s in sites)
                 for fate in native_fate(f, target)]
        if [(s.function, s.q_shape) for s in sites] != \
                [(x.site.function, x.site.q_shape) for x in fates]:
            raise HlotoolError(f"the {target} lowering holds other attention sites than the "
                               "host's; inspect each target on its own")
        for by_target, fate in zip(out, fates):
            by_target[target] = fate
    return out


def map_sites(pre: Module | str, optimized: Module | str, target: str,
              function: str = "") -> list[NativeFate]:
    """The native fates of the sites detected in pre-optimization HLO `pre` (with debug
    info), found in `optimized`, the same program after XLA's passes for `target`. Both
    must come from one lowering: the stacks of another hold other caller frames."""
    pre = as_module(pre, "pre-optimization HLO")
    matches = find_matches(pre, function or pre.name)
    return (_fates(pre, matches, as_module(optimized, "optimized HLO", inline=False), target)
            if matches else [])


def _key(inst: Instruction) -> _Key | None:
    op_name = _WRAPPERS.sub("", inst.metadata.get("op_name", ""))
    if not op_name:
        return None
    try:
        frames = tuple((f.file, f.line) for f in inst.stack)
    except HlotoolError:
        return None
    # Without a stack ("select_n", "args[0]") the name alone would match every such op.
    return (op_name, frames) if frames else None


def score_sized(shape: Shape, site: AttentionSite, partitions: int = 1) -> bool:
    """Whether a value (or a tuple element) is one of `site`'s L×L buffers: it holds one
    [B, Hq, Lq, Lk] score matrix's elements and its dims include Lq and Lk. A [Lq, Lk] mask
    or a [B, Lq, Lk] bias before its broadcast is not one. `inspect` and `diff` both count
    with this. In a program XLA split over `partitions` devices, a device's share of one is
    too: the matrix over a divisor n of them, one of B, Hq, Lq or Lk divided by n."""
    if shape.is_tuple:
        return any(score_sized(s, site, partitions) for s in shape.tuple_shapes)
    total = site.batch * site.num_q_heads * site.q_len * site.kv_len
    lq, lk = site.q_len, site.kv_len
    for n in (d for d in range(1, partitions + 1) if partitions % d == 0):
        if shape.num_elements * n != total:
            continue
        pairs = [(lq, lk)] + [(q, k) for q, k in ((lq // n, lk), (lq, lk // n))
                              if n > 1 and lq % n == 0 and lk % n == 0]
        for q, k in pairs:
            dims = list(shape.dims)
            if q in dims:
                dims.remove(q)
                if k in dims:
                    return True
    return False


class _Program:
    """The optimized module's top-level instructions (every computation that runs as a
    program level: entry, loop bodies and conditions, branches), with their metadata keys."""

    def __init__(self, module: Module):
        self.module = module
        self.partitions = module.partitions
        called_by = module.callers()
        levels = [c for c in module.computations.values()
                  if c.is_entry or (c.name in called_by and all(
                      i.opcode in _LEVEL_CALLS for _, i in called_by[c.name]))]
        self.insts: list[tuple[str, Instruction]] = [(c.name, i) for c in levels for i in c]
        self.index = {(c, i.name): n for n, (c, i) in enumerate(self.insts)}
        self.operands: list[list[int]] = [
            [self.index[(c, o)] for o in i.operands if (c, o) in self.index]
            for c, i in self.insts
        ]
        self.users: list[list[int]] = [[] for _ in self.insts]
        for n, ops in enumerate(self.operands):
            for o in ops:
                self.users[o].append(n)
        self.keys = [self._keys(i) for _, i in self.insts]
        # Values built from constants alone (a broadcast scale, an iota causal mask) and
        # parameters: inputs several sites may share, never one site's scores.
        self.constant: set[int] = set()
        for n, (_, inst) in enumerate(self.insts):
            if inst.opcode not in ("parameter", "custom-call") and len(self.operands[n]) == len(
                    inst.operands) and all(o in self.constant for o in self.operands[n]):
                self.constant.add(n)
        self.inputs = self.constant | {n for n, (_, i) in enumerate(self.insts)
                                       if i.opcode == "parameter"}

    def _keys(self, inst: Instruction) -> set[_Key]:
        keys = {k for k in [_key(inst)] if k is not None}
        if inst.opcode in _LEVEL_CALLS:
            return keys
        stack, seen = list(inst.called_computations), set()
        while stack:
            name = stack.pop()
            comp = self.module.computations.get(name)
            if comp is None or name in seen:
                continue
            seen.add(name)
            for i in comp:
                k = _key(i)
                if k is not None:
                    keys.add(k)
                stack.extend(i.called_computations)
        return keys

    def reach(self, start: Iterable[int], edges: list[list[int]], through: set[int]) -> set[int]:
        """Nodes reachable from `start` along `edges`, stepping only onto `through`."""
        seen: set[int] = set()
        stack = [n for s in start for n in edges[s] if n in through]
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(m for m in edges[n] if m in through and m not in seen)
        return seen

    def grow(self, anchors: set[int], unknown: set[int], site: AttentionSite) -> set[int]:
        """`anchors` plus the metadata-less work around them that belongs to the site."""
        region = set(anchors)
        region |= (self.reach(anchors, self.users, unknown)
                   & self.reach(anchors, self.operands, unknown))
        scores = {n for n in unknown - self.inputs
                  if score_sized(self.insts[n][1].shape, site, self.partitions)}
        region |= self.reach(region, self.operands, scores)
        sized = [n for n in region
                 if score_sized(self.insts[n][1].shape, site, self.partitions)]
        consumers = {u for n in sized for u in self.users[n] if u in unknown}
        region |= consumers | self.reach(consumers, self.users, scores)
        return region | self.collectives_feeding(region, unknown)

    def collectives_feeding(self, region: set[int], unknown: set[int]) -> set[int]:
        """The collectives without metadata of their own (XLA:TPU's SPMD partitioner names
        them after a reshape) whose values `region` reads: the site's operands moved between
        devices for it, an async pair's start and done both."""
        found: set[int] = set()
        for n in region:
            for o in self.operands[n]:
                if o not in unknown:
                    continue
                opcode = self.insts[o][1].opcode
                if opcode.endswith("-done"):
                    starts = [s for s in self.operands[o] if s in unknown
                              and self.insts[s][1].opcode in COLLECTIVES]
                    if starts:
                        found |= {o, *starts}
                elif opcode in COLLECTIVES:
                    found.add(o)
        return found

    def components(self, nodes: set[int]) -> list[list[int]]:
        """Weakly connected pieces of `nodes`, each in program order, ordered by first node.

        Inputs (parameters, values built from constants) connect nothing: XLA's CSE merges
        one layer's constant broadcast with the next layer's, which would make two layers
        one piece. Each goes with the piece of its first user among `nodes`, or the first
        piece where none reads it.
        """
        core = nodes - self.inputs
        piece_of: dict[int, int] = {}
        pieces: list[list[int]] = []
        for start in sorted(core):
            if start in piece_of:
                continue
            piece, stack = [], [start]
            piece_of[start] = len(pieces)
            while stack:
                n = stack.pop()
                piece.append(n)
                for m in (*self.operands[n], *self.users[n]):
                    if m in core and m not in piece_of:
                        piece_of[m] = len(pieces)
                        stack.append(m)
            pieces.append(piece)
        unused = []
        for n in sorted(nodes & self.inputs):
            users = sorted(u for u in self.users[n] if u in piece_of)
            if users:
                pieces[piece_of[users[0]]].append(n)
            else:
                unused.append(n)
        pieces = sorted((sorted(p) for p in pieces), key=lambda p: p[0])
        # Inputs no piece reads (a scale constant the fusions copied in) are no layer: a
        # piece of their own would be dealt out to a site like one.
        if unused and pieces:
            pieces[0] = sorted(pieces[0] + unused)
        elif unused:
            pieces = [unused]
        return pieces


def _fates(pre: Module, matches: Sequence[Match], optimized: Module,
           target: str, backward: bool = False) -> list[NativeFate]:
    by_name = {i.name: i for i in pre.instructions()}
    site_keys = [{k for n in m.body if n.ref in by_name
                  for k in [_key(by_name[n.ref])] if k is not None} for m in matches]
    program = _Program(optimized)
    program.keys = _translate(program.keys, pre)
    if backward:
        site_keys = [keys | _transposed(keys, program.keys) for keys in site_keys]
    unknown = {n for n, keys in enumerate(program.keys) if not keys}
    anchors = _anchors(program, site_keys, [m.site for m in matches], unknown)
    regions = [program.grow(a, unknown, m.site) if a else set()
               for m, a in zip(matches, anchors)]
    return [
        NativeFate(m.site, target, tuple(_placement(program.insts[n][1], m.site,
                                                    program.partitions)
                                         for n in sorted(region)
                                         if program.insts[n][1].opcode not in _VIEWS),
                   program.partitions)
        for m, region in zip(matches, regions)
    ]


def _transposed(site_keys: set[_Key], program_keys: Sequence[set[_Key]]) -> set[_Key]:
    """The keys of the program's derivative of a site's equations: jax's AD gives each
    transposed equation the Python stack of the one it transposes and names it in the same
    scope under `transpose(...)` ("transpose(jvp(Model))/Block_0/attn/reduce_sum" for
    "Block_0/attn/exp" at one stack); its primitive is another, so the scope and stack are
    what match."""
    scopes = {(op_name.rpartition("/")[0], frames) for op_name, frames in site_keys}
    found = set()
    for keys in program_keys:
        for op_name, frames in keys:
            m = _TRANSPOSE.match(op_name)
            if m and (op_name[m.end():].rpartition("/")[0], frames) in scopes:
                found.add((op_name, frames))
    return found


def _translate(keys: Sequence[set[_Key]], pre: Module) -> list[set[_Key]]:
    """Each optimized instruction's keys as the pre-optimization keys they stand for.

    An inlined call's instructions record only the frames inside the call, the optimized
    program the whole stack: a pre-optimization stack matches when it is the innermost
    part of the optimized one.
    """
    by_start: dict[tuple, list[_Key]] = collections.defaultdict(list)
    for inst in pre.instructions():
        key = _key(inst)
        if key is not None:
            by_start[(key[0], key[1][:1])].append(key)
    out = []
    for own in keys:
        found = set()
        for op_name, frames in own:
            for key in by_start.get((op_name, frames[:1]), ()):
                if frames[:len(key[1])] == key[1]:
                    found.add(key)
        out.append(found)
    return out


def _anchors(program: _Program, site_keys: Sequence[set[_Key]],
             sites: Sequence[AttentionSite], unknown: set[int]) -> list[set[int]]:
    """Top-level instructions carrying each site's metadata.

    An instruction with a key only one site has is that site's. Those whose keys several
    sites share (layers written by one line of code) are grown together into a region
    that falls into connected pieces, taken in program order: a piece that reads the
    score-sized values of an earlier piece goes with it (a backward pass reading the
    forward's probabilities); the others are dealt out to the candidates in program
    order, evenly when there are more pieces than sites.
    """
    anchors: list[set[int]] = [set() for _ in site_keys]
    shared: dict[frozenset[int], set[int]] = collections.defaultdict(set)
    for n, keys in enumerate(program.keys):
        candidates = frozenset(i for i, sk in enumerate(site_keys) if keys & sk)
        own = {i for i in candidates
               if keys & (site_keys[i] - set().union(*(site_keys[j] for j in candidates
                                                       if j != i)))}
        if len(candidates) == 1 or len(own) == 1:
            anchors[min(own or candidates)].add(n)
        elif candidates:
            shared[candidates].add(n)
    for candidates, nodes in shared.items():
        site = min(candidates)
        pieces = program.components(program.grow(nodes, unknown, sites[site]))
        piece_of = {n: j for j, piece in enumerate(pieces) for n in piece}
        root: list[int] = []
        for j, piece in enumerate(pieces):
            read = {root[piece_of[o]] for n in piece for o in program.operands[n]
                    if piece_of.get(o, j) < j
                    and score_sized(program.insts[o][1].shape, sites[site],
                                    program.partitions)}
            root.append(read.pop() if len(read) == 1 else j)
        roots = sorted(set(root))
        order = sorted(candidates)
        for j, piece in enumerate(pieces):
            anchors[order[roots.index(root[j]) * len(order) // len(roots)]].update(piece)
    return anchors


def _placement(inst: Instruction, site: AttentionSite, partitions: int) -> Placement:
    if inst.opcode == "fusion":
        what = f"fusion {inst.attributes.get('kind', '?')}"
        config = inst.backend_config
        fusion_kind = (config.get("fusion_config") or {}).get("kind") \
            if isinstance(config, dict) else None
        if fusion_kind:
            what += f" {fusion_kind}"
    elif inst.opcode == "custom-call":
        what = f"custom-call {inst.custom_call_target or '?'}"
        op_name = inst.metadata.get("op_name", "")
        if op_name and "/" not in op_name:  # XLA's own name, e.g. online-softmax
            what += f" {op_name}"
    else:
        what = inst.opcode
    space = _MEMORY_SPACE.search(inst.shape.layout or "")
    return Placement(inst.name, what, _shape_text(inst.shape),
                     score_sized(inst.shape, site, partitions),
                     int(space.group(1)) if space else 0,
                     0 if inst.shape.is_tuple and inst.opcode not in COLLECTIVES
                     else inst.shape.nbytes,
                     _along(inst, site) if inst.opcode in COLLECTIVES else None)


def _along(inst: Instruction, site: AttentionSite) -> str | None:
    """The axis a collective moves along, named as the site's layout names it where its
    value has the shape of one of q, k or v ("L"), else "dim N"."""
    found = re.findall(r"\d+", str(inst.attributes.get("dimensions", "")))
    if len(found) != 1 or inst.shape.is_tuple:
        return None
    dim, dims = int(found[0]), tuple(inst.shape.dims)
    if dims in (tuple(site.q_shape), tuple(site.k_shape), tuple(site.v_shape)) \
            and dim < len(site.layout):
        return site.layout[dim]
    return f"dim {dim}"


def _shape_text(shape: Shape) -> str:
    """The shape without layout: ``bf16[2,1024,1024]``."""
    if shape.is_tuple:
        return "(" + ", ".join(_shape_text(s) for s in shape.tuple_shapes) + ")"
    return f"{shape.element_type}[{','.join(map(str, shape.dims))}]"
