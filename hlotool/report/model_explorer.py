"""`hlotool diff --format model-explorer`: native and rewritten HLO as Model Explorer graphs.

    files = write_model_explorer(diffs, directory)   # FunctionDiffs of `hlotool diff`

Model Explorer (PyPI `ai-edge-model-explorer`) loads a graph JSON file of its own format —
`model_explorer.graph_builder`: a `GraphCollection` {label, graphs: [Graph {id, nodes: [
GraphNode {id, label, namespace, attrs, incomingEdges}]}]} — and node-data overlays
(`node_data_builder`: per graph id a `GraphNodeData` {name, results: {node id: {value,
bgColor}}, gradient}). This module writes those as plain JSON, so hlotool needs no Model
Explorer to write them; the tests read them back through the package's own dataclasses.

Written into the directory: `native.json` and `rewritten.json` (one graph per function,
``native: NAME (STAGE, TARGET)`` and ``rewritten: …``: the viewer renames a graph id another
model already uses, so each side has its own) and per side three overlays: `*.change.json` (−1 removed, 0 kept, +1 added, coloured), `*.flops.json` and
`*.bytes.json`. Nodes are grouped by namespace: an attention site's instructions under
``siteN FILE:LINE`` on both sides (the ones the rewrite removed on the left, the kernel it
added on the right), a fusion's body under the fusion's name, a loop's body under the loop.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hlotool.errors import write_output

if TYPE_CHECKING:
    from hlotool.hlo import Instruction, Module
    from hlotool.passes.diff import FunctionDiff

SIDES = (("native", "before"), ("rewritten", "after"))
OVERLAYS = ("change", "flops", "bytes")
# Model Explorer colours; removed/added match the HTML report's.
_REMOVED, _ADDED = "#f4b6b6", "#b9e4b0"
_CHANGE = {"removed": -1, "kept": 0, "added": 1}
# Ops that run other computations as programs of their own (drawn nested, not summarized).
_PROGRAMS = frozenset({"fusion", "while", "conditional", "call"})
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "exponential", "log",
    "negate", "abs", "sqrt", "rsqrt", "tanh", "power", "select", "compare", "and", "or",
    "not", "xor", "exponential-minus-one", "log-plus-one", "logistic", "floor", "ceil",
    "round-nearest-even", "sign", "sine", "cosine", "clamp", "remainder", "atan2", "erf",
})
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _elements(shape: Any) -> int:
    if shape.is_tuple:
        return sum(_elements(s) for s in shape.tuple_shapes)
    return math.prod(max(d, 0) for d in shape.dims)


def output_bytes(shape: Any) -> int:
    """Bytes of an instruction's result (tuples: the sum of their leaves)."""
    if shape.is_tuple:
        return sum(output_bytes(s) for s in shape.tuple_shapes)
    return _elements(shape) * _BYTES.get(shape.element_type, 4)


def flops(inst: Instruction, shapes: dict[str, Any]) -> int:
    """An estimate: 2·(result elements)·(contracted size) for a dot, one per result element
    for elementwise ops, one per input element for a reduce, 0 for data movement."""
    if inst.opcode == "dot":
        lhs = shapes.get(inst.operands[0]) if inst.operands else None
        if lhs is None or lhs.is_tuple:
            return 0
        try:
            contracted = math.prod(lhs.dims[d] for d in inst.dims("lhs_contracting_dims"))
        except Exception:  # no contracting dims printed: an outer product
            contracted = 1
        return 2 * _elements(inst.shape) * contracted
    if inst.opcode in _ELEMENTWISE:
        return _elements(inst.shape)
    if inst.opcode == "reduce" and inst.operands:
        first = shapes.get(inst.operands[0])
        return _elements(first) if first is not None else 0
    return 0


class _Side:
    """One module drawn as Model Explorer nodes; node ids are `hlotool.hlo.node_id`s."""

    def __init__(self, module: Module, status: Any, site_of: dict[str, str]):
        self.module, self.status, self.site_of = module, status, site_of
        self.nodes: list[dict[str, Any]] = []
        self.by_id: dict[str, dict[str, Any]] = {}
        self.values: dict[str, dict[str, float]] = {k: {} for k in OVERLAYS}
        self.changes: dict[str, str] = {}
        # A fusion is drawn as its body: its users read the body's root.
        self.alias: dict[str, str] = {}

    def build(self) -> None:
        self._computation(self.module.entry.name, "")

    def _computation(self, name: str, namespace: str) -> None:
        from hlotool.hlo import node_id

        comp = self.module.computations[name]
        shapes = {i.name: i.shape for i in comp.instructions}
        for inst in comp.instructions:
            nid = node_id(name, inst.name)
            own = namespace or self.site_of.get(nid, "")
            if inst.opcode == "fusion" and inst.called_computations:
                body = self.module.computations.get(inst.called_computations[0])
                if body is not None:
                    inner = f"{own}/{inst.name}".strip("/")
                    self._computation(body.name, inner)
                    self.alias[nid] = node_id(body.name, body.root.name)
                    # The body's parameters read the fusion's operands.
                    for p in body.parameters:
                        pid = node_id(body.name, p.name)
                        node = self.by_id[pid]
                        if p.parameter_number is not None and \
                                p.parameter_number < len(inst.operands):
                            src = node_id(name, inst.operands[p.parameter_number])
                            node["incomingEdges"] = [self._edge(src, 0)]
                    continue
            self._node(nid, inst, own, name, shapes)
            if inst.opcode in _PROGRAMS:
                for callee in inst.called_computations:
                    self._computation(callee, f"{own}/{inst.name}/{callee}".strip("/"))

    def _edge(self, source: str, index: int) -> dict[str, str]:
        return {"sourceNodeId": self.alias.get(source, source), "sourceNodeOutputId": "0",
                "targetNodeInputId": str(index)}

    def _node(self, nid: str, inst: Instruction, namespace: str, comp: str,
              shapes: dict[str, Any]) -> None:
        from hlotool.hlo import node_id

        status = self.status(nid)
        attrs = [("name", inst.name), ("shape", _shape_text(inst.shape)), ("change", status)]
        for key in ("op_name",):
            if inst.metadata.get(key):
                attrs.append((key, inst.metadata[key]))
        try:
            source = inst.user_source
        except Exception:  # a stack-frame id missing from the tables: no source, no error
            source = None
        if source:
            attrs.append(("source", source))
        if inst.opcode == "custom-call" and inst.custom_call_target:
            attrs.append(("custom_call_target", inst.custom_call_target))
        node = {
            "id": nid, "label": inst.opcode, "namespace": namespace,
            "attrs": [{"key": k, "value": str(v)} for k, v in attrs],
            "incomingEdges": [self._edge(node_id(comp, o), i)
                              for i, o in enumerate(inst.operands) if o in shapes],
        }
        self.nodes.append(node)
        self.by_id[nid] = node
        self.changes[nid] = status
        self.values["change"][nid] = _CHANGE[status]
        self.values["flops"][nid] = flops(inst, shapes)
        self.values["bytes"][nid] = output_bytes(inst.shape)


def _shape_text(shape: Any) -> str:
    if shape.is_tuple:
        return "(" + ", ".join(_shape_text(s) for s in shape.tuple_shapes) + ")"
    return f"{shape.element_type}[{','.join(map(str, shape.dims))}]"


def _site_label(index: int, site: Any) -> str:
    where = os.path.basename(site.source) if site.source else "?"
    return f"site{index} {where}"


def _sides(d: FunctionDiff) -> dict[str, _Side]:
    """Both sides of one function diff, each site's changed nodes under its namespace."""
    md = d.diff
    site_of: dict[str, dict[str, str]] = {"before": {}, "after": {}}
    for k, change in enumerate(d.changes, 1):
        label = _site_label(k, change.site) if change.site is not None else "other changes"
        for n in change.removed:
            site_of["before"][n] = label
        for n in change.added:
            site_of["after"][n] = label
    out = {}
    for name, side in SIDES:
        module = md.before if side == "before" else md.after
        s = _Side(module, lambda n, side=side: md.status(side, n).lower(), site_of[side])
        s.build()
        out[name] = s
    return out


def graph_id(d: FunctionDiff, side: str) -> str:
    """The graph's id in side `side`'s collection (and in that side's overlays)."""
    return f"{side}: {d.function} ({d.stage}, {d.target})"


def _overlay(name: str, values: dict[str, float], side: _Side) -> dict[str, Any]:
    if name == "change":
        colours = {"removed": _REMOVED, "added": _ADDED}
        return {"name": "hlotool change (−1 removed, 0 kept, +1 added)",
                "results": {n: ({"value": v, "bgColor": colours[side.changes[n]]}
                                if side.changes[n] in colours else {"value": v})
                            for n, v in values.items()},
                "thresholds": [{"value": -1, "bgColor": _REMOVED},
                               {"value": 0, "bgColor": "#ffffff"},
                               {"value": 1, "bgColor": _ADDED}]}
    title = {"flops": "hlotool FLOPs (estimate: 2·M·N·K per dot, 1 per element otherwise)",
             "bytes": "hlotool result bytes"}[name]
    return {"name": title, "results": {n: {"value": v} for n, v in values.items()},
            "gradient": [{"stop": 0, "bgColor": "#ffffff"}, {"stop": 1, "bgColor": "#d97706"}]}


def documents(diffs: Sequence[FunctionDiff]) -> dict[str, dict[str, Any]]:
    """File name → JSON document: the two graph collections and their overlays."""
    docs: dict[str, dict[str, Any]] = {}
    graphs: dict[str, list[dict[str, Any]]] = {"native": [], "rewritten": []}
    overlays: dict[tuple[str, str], dict[str, Any]] = {}
    for d in diffs:
        sides = _sides(d)
        group_attrs = {}
        for k, change in enumerate(d.changes, 1):
            if change.site is None:
                continue
            s = change.site
            group_attrs[_site_label(k, s)] = {
                "source": s.source or "?", "q k v": f"{list(s.q_shape)} {list(s.k_shape)} "
                f"{list(s.v_shape)}", "mask": s.mask_text,
                "change": d.diff.stats(change.removed, change.added, s).line()}
        for name, side in sides.items():
            gid = graph_id(d, name)
            graphs[name].append({
                "id": gid, "nodes": side.nodes,
                "groupNodeAttributes": {"": {"function": d.function, "stage": d.stage,
                                             "target": d.target, "side": name},
                                        **group_attrs}})
            for overlay in OVERLAYS:
                overlays[(name, overlay)] = overlays.get((name, overlay), {})
                overlays[(name, overlay)][gid] = _overlay(overlay, side.values[overlay], side)
    for name, _ in SIDES:
        docs[f"{name}.json"] = {"label": name, "graphs": graphs[name]}
        for overlay in OVERLAYS:
            docs[f"{name}.{overlay}.json"] = overlays[(name, overlay)]
    return docs


def write_model_explorer(diffs: Sequence[FunctionDiff], directory: str,
                         force: bool = False) -> list[str]:
    """Write `documents(diffs)` into `directory` (listed in its manifest, so a later run
    replaces them); returns the paths, graphs first."""
    paths = []
    for name, doc in documents(diffs).items():
        path = os.path.join(directory, name)
        write_output(path, json.dumps(doc, indent=1), force=force, listed=True)
        paths.append(path)
    return paths


def open_command(directory: str) -> list[str]:
    """The `model-explorer` command line that opens both graphs. Its --node_data_paths
    cannot name the model an overlay is for (all go to the first), so overlays are left to
    `hlotool diff --open` or the viewer's "Add per-node data"."""
    models = ",".join(os.path.join(directory, f"{n}.json") for n, _ in SIDES)
    return ["model-explorer", models]


def serve(directory: str, host: str = "localhost", port: int = 8080) -> None:
    """Start Model Explorer on `host:port` with both graphs and every overlay (each overlay
    on its own model); returns when the user stops it (Ctrl-C)."""
    import model_explorer

    config = model_explorer.config()
    for name, _ in SIDES:
        config.add_model_from_path(os.path.join(directory, f"{name}.json"))
    for name, _ in SIDES:
        for overlay in OVERLAYS:
            # The viewer matches an overlay's model by the collection's label.
            config.add_node_data_from_path(os.path.join(directory, f"{name}.{overlay}.json"),
                                           model_name=name)
    model_explorer.visualize_from_config(config, host=host, port=port)
