"""HLO IR: parse XLA's HLO text, print it back, and view it as a networkx graph.

Typical use::

    module = parse_module(jax.jit(f).lower(x).compile().as_text())
    for inst in module.entry.instructions:
        print(inst.name, inst.opcode, inst.shape, inst.source)
    graph = to_graph(module.inline_calls())  # nodes "computation/instruction"
"""

from hlotool.hlo.graph import graphs_equal, node_id, to_graph
from hlotool.hlo.ir import Computation, Frame, Instruction, Module, StackFrameTable
from hlotool.hlo.parser import parse_module
from hlotool.hlo.printer import print_module
from hlotool.hlo.shape import Shape, parse_shape

__all__ = [
    "Computation",
    "Frame",
    "Instruction",
    "Module",
    "Shape",
    "StackFrameTable",
    "graphs_equal",
    "node_id",
    "parse_module",
    "parse_shape",
    "print_module",
    "to_graph",
]
