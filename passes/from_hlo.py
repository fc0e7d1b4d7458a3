"""HLO front end: instructions of pre-optimization HLO → normalized graph, one per computation.

Calls are inlined first (`Module.inline_calls`), so masks built in `call(..., to_apply=_where)`
are seen in place; `while` bodies and `conditional` branches are computations of their own
and are matched in place, their name giving the site's path.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Protocol

import numpy as np

from hlotool.hlo import Computation, Instruction, Module, as_module
from hlotool.passes.attention import Match, find
from hlotool.passes.near_miss import NearMiss, near_misses
from hlotool.passes.graph import (
    MAX_FOLD_ELEMENTS, Graph, Node, as_product, rounds_to_itself, uniform_value,
)
from hlotool.site import AttentionSite
from hlotool.source import user_source

_DTYPES = {
    "pred": "bool", "f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
    "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
}
_RENAMED = {
    "exponential": "exp", "subtract": "sub", "multiply": "mul", "divide": "div",
    "negate": "neg", "maximum": "max", "minimum": "min", "power": "pow", "bitcast": "reshape",
    "reduce-precision": "reduce_precision", "remainder": "rem",
}
_REDUCERS = {"maximum": "reduce_max", "add": "reduce_sum"}
# The init value that makes a reduce a plain max / sum.
_IDENTITY = {"reduce_max": lambda v: v == -np.inf or v <= -3e38, "reduce_sum": lambda v: v == 0,
             "cumsum": lambda v: v == 0}
_NUMBER = re.compile(r"-?inf|nan|true|false|[-+0-9.eE]+")


def _literal(text: str | None, shape: tuple[int, ...], dtype: str) -> np.ndarray | None:
    """A constant's value from its HLO literal text, or None when it is not printed."""
    if text is None or int(np.prod(shape, dtype=np.int64)) > MAX_FOLD_ELEMENTS:
        return None
    tokens = _NUMBER.findall(text)
    if len(tokens) != int(np.prod(shape, dtype=np.int64)):
        return None
    values = [{"true": 1, "false": 0}.get(t, t) for t in tokens]
    try:
        array = np.array([float(v) for v in values])
    except ValueError:
        return None
    np_dtype = np.float32 if dtype in ("bfloat16", "float16") else np.dtype(dtype)
    return array.astype(np_dtype).reshape(shape)


def _normalize(inst: Instruction, module: Module) -> tuple[str, dict, list[str]]:
    """(op, params, operand names) of an instruction in the graph vocabulary."""
    op, operands = inst.opcode, list(inst.operands)
    if op == "dot":
        return "dot_general", {
            "lhs_contract": inst.dims("lhs_contracting_dims"),
            "rhs_contract": inst.dims("rhs_contracting_dims"),
            "lhs_batch": inst.dims("lhs_batch_dims") if "lhs_batch_dims" in inst.attributes
            else (),
            "rhs_batch": inst.dims("rhs_batch_dims") if "rhs_batch_dims" in inst.attributes
            else (),
        }, operands
    if op == "reduce" and len(operands) == 2 and inst.called_computations:
        reducer = module.computations.get(inst.called_computations[0])
        kind = _REDUCERS.get(reducer.root.opcode) if reducer is not None else None
        if kind is not None:
            return kind, {"axes": inst.dims("dimensions")}, operands[:1]
    if op == "reduce-window" and len(operands) == 2 and inst.called_computations:
        cumsum = _running_sum_axis(inst, module)
        if cumsum is not None:
            return "cumsum", cumsum, operands[:1]
    if op == "broadcast":
        return "broadcast", {"dims": inst.dims("dimensions")}, operands
    if op == "transpose":
        return "transpose", {"perm": inst.dims("dimensions")}, operands
    if op == "compare":
        return "compare", {"direction": inst.attributes["direction"].lower()}, operands
    if op == "slice":
        bounds = [[int(x) for x in part.split(":")] for part in
                  re.findall(r"\[([0-9:]+)\]", inst.attributes.get("slice", ""))]
        return "slice", {"start": tuple(b[0] for b in bounds),
                         "limit": tuple(b[1] for b in bounds),
                         "strides": tuple(b[2] if len(b) > 2 else 1 for b in bounds)}, operands
    if op == "concatenate":
        return "concatenate", {"axis": inst.dims("dimensions")[0]}, operands
    if op == "iota":
        return "iota", {"dimension": int(inst.attributes["iota_dimension"])}, operands
    if op == "reduce-precision" and rounds_to_itself(
            _DTYPES.get(inst.shape.element_type, ""),
            int(inst.attributes.get("exponent_bits", -1)),
            int(inst.attributes.get("mantissa_bits", -1))):
        return "copy", {}, operands
    return _RENAMED.get(op, op), {}, operands


def _running_sum_axis(inst: Instruction, module: Module) -> dict[str, Any] | None:
    """{axis, reverse} where a reduce-window is jax's cumsum on the CPU: an add over a window
    of the whole axis, padded by its length - 1 before it (after it: reversed), 1 elsewhere."""
    reducer = module.computations.get(inst.called_computations[0])
    window = re.fullmatch(r"\{size=([0-9x]+) pad=([0-9_x]+)\}", inst.attributes.get("window", ""))
    if reducer is None or reducer.root.opcode != "add" or window is None:
        return None
    sizes = [int(x) for x in window.group(1).split("x")]
    pads = [tuple(int(y) for y in x.split("_")) for x in window.group(2).split("x")]
    dims = tuple(inst.shape.dims)
    summed = [a for a, size in enumerate(sizes) if size != 1]
    if len(summed) != 1 or len(sizes) != len(dims):
        return None
    (axis,) = summed
    n = dims[axis]
    if sizes[axis] != n or any(p != (0, 0) for a, p in enumerate(pads) if a != axis):
        return None
    if pads[axis] not in ((n - 1, 0), (0, n - 1)):
        return None
    return {"axis": axis, "reverse": pads[axis] == (0, n - 1)}


def _source(inst: Instruction) -> str:
    return user_source((f.file, f.line) for f in inst.stack)


def _graph(comp: Computation, module: Module) -> Graph:
    graph = Graph([], (comp.name,))
    env: dict[str, Node] = {}
    for inst in comp.instructions:
        shape = inst.shape
        dtype = "tuple" if shape.is_tuple else _DTYPES.get(shape.element_type,
                                                            shape.element_type)
        dims = tuple(shape.dims)
        first = env.get(inst.operands[0]) if inst.operands else None
        if inst.opcode == "get-tuple-element" and first is not None and first.op == "tuple":
            # An inlined call returning a tuple: read the element itself.
            env[inst.name] = first.inputs[int(inst.attributes["index"])]
            continue
        if inst.opcode == "constant":
            node = Node("constant", (), dims, dtype,
                        {"value": _literal(inst.literal, dims, dtype)}, ref=inst.name)
        else:
            op, params, operands = _normalize(inst, module)
            inputs = tuple(env[o] for o in operands if o in env)
            if len(inputs) != len(operands):
                op = inst.opcode  # an operand from elsewhere: keep the node opaque
            elif op in _IDENTITY:
                init = uniform_value(env[inst.operands[1]]) if inst.operands[1] in env else None
                if init is None or not _IDENTITY[op](init):
                    op = inst.opcode
            node = Node(op, inputs, dims, dtype, params, functools.partial(_source, inst),
                        inst.name)
            product = as_product(node, inst.name) if op == "dot_general" else None
            if product:
                graph.nodes.extend(product[:-1])
                node = product[-1]
        env[inst.name] = node
        graph.nodes.append(node)
    return graph


def find_matches(module: Module, function: str = "") -> list[Match]:
    """Every attention site in every computation of `module`, with its graph description."""
    return [m for m, _ in _per_region(module, function) if m is not None]


def _per_region(module: Module, function: str) -> list[tuple[Match | None, Graph]]:
    module = module.inline_calls()
    out = []
    for comp in module.computations.values():
        if any(i.opcode == "dot" for i in comp.instructions):
            graph = _graph(comp, module)
            found = find(graph, function)
            out.extend((m, graph) for m in found)
            if not found:
                out.append((None, graph))
    return out


def near_misses_hlo(module: Module | str, function: str = "") -> list[NearMiss]:
    """Almost-attention in `module` that is not a site, each with the first rule it breaks."""
    module = as_module(module)
    by_graph: dict[int, tuple[Graph, list[Match]]] = {}
    for m, graph in _per_region(module, function or module.name):
        entry = by_graph.setdefault(id(graph), (graph, []))
        if m is not None:
            entry[1].append(m)
    return [miss for graph, found in by_graph.values()
            for miss in near_misses(graph, found, function or module.name)]


def detect_hlo(module: Module | str, function: str = "") -> list[AttentionSite]:
    """The attention sites of pre-optimization HLO (a parsed `Module` or its text)."""
    module = as_module(module, "detect_hlo", source="hlo")
    return [m.site for m in find_matches(module, function or module.name)]


class _Captured(Protocol):
    name: str

    def hlo(self, debug_info: bool = True) -> str: ...


def detect_captured(functions: Iterable[_Captured]) -> list[AttentionSite]:
    """Sites of every captured function, from its pre-optimization HLO with debug info."""
    sites: list[AttentionSite] = []
    for f in functions:
        sites.extend(detect_hlo(f.hlo(debug_info=True), f.name))
    return sites


def near_misses_captured(functions: Iterable[_Captured]) -> list[NearMiss]:
    """Near misses of every captured function, from its pre-optimization HLO."""
    return [miss for f in functions for miss in near_misses_hlo(f.hlo(debug_info=True), f.name)]
