"""HLO IR: parse XLA's HLO text, print it back, and view it as a networkx graph.

Typical use::

    module = parse_module(jax.jit(f).lower(x).compile().as_text())
    for inst in module.entry.instructions:
        print(inst.name, inst.opcode, inst.shape, inst.source)
    graph = to_graph(module.inline_calls())  # nodes "computation/instruction"
"""

from hlotool.errors import HlotoolError
from hlotool.hlo.graph import graphs_equal, node_id, to_graph
from hlotool.hlo.ir import Computation, Frame, Instruction, Module, StackFrameTable
from hlotool.hlo.parser import parse_module
from hlotool.hlo.printer import print_module
from hlotool.hlo.shape import Shape, parse_shape



def as_module(hlo: Module | str, what: str = "hlo", *, source: str | None = None,
              inline: bool = True) -> Module:
    """HLO text or a parsed Module, as a Module; with `inline`, its calls inlined (masks
    built in `call(..., to_apply=_where)` are then seen where they are used). Parse errors
    name the text `<source>` (default: `what`)."""
    if isinstance(hlo, str):
        hlo = parse_module(hlo, source_name=f"<{source or what}>")
    if not isinstance(hlo, Module):
        raise HlotoolError(f"{what} needs an HLO Module or its text, got {type(hlo).__name__}")
    return hlo.inline_calls() if inline else hlo


__all__ = [
    "Computation",
    "Frame",
    "Instruction",
    "Module",
    "Shape",
    "StackFrameTable",
    "as_module",
    "graphs_equal",
    "node_id",
    "parse_module",
    "parse_shape",
    "print_module",
    "to_graph",
]
