"""HLO as a networkx graph: one node per instruction, one edge per operand use."""

from __future__ import annotations

import networkx as nx

from hlotool.hlo.ir import Computation, Module


def node_id(computation: str, instruction: str) -> str:
    return f"{computation}/{instruction}"


def _reachable(comp: Computation, module: Module | None) -> list[Computation]:
    if module is None:
        return [comp]
    order: list[Computation] = []
    seen: set[str] = set()
    stack = [comp.name]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        current = module.computations[name]
        order.append(current)
        stack.extend(c for i in current.instructions for c in i.called_computations)
    return order


def to_graph(obj: Module | Computation, *, include_called: bool = True) -> nx.MultiDiGraph:
    """Builds a `MultiDiGraph` with nodes `"computation/instruction"`.

    Node attributes: `opcode`, `shape` (a `Shape`), `instruction`, `computation`, `is_root`.
    Edges run operand → user with `kind="operand"` and `index` = operand position (an
    instruction using one value twice gets two edges). With `include_called`, every
    computation the given one(s) run (fusion bodies, reducers, loop bodies, ...) is added
    too, plus a `kind="called"` edge (`index=None`, `computation=<callee>`) from each
    callee's root to the instruction that calls it.
    """
    if isinstance(obj, Module):
        module: Module | None = obj
        comps = list(obj.computations.values()) if include_called else [obj.entry]
    else:
        module = obj.module
        comps = _reachable(obj, module) if include_called else [obj]
    graph = nx.MultiDiGraph()
    included = {c.name for c in comps}
    for comp in comps:
        root = comp.root
        for inst in comp.instructions:
            graph.add_node(
                node_id(comp.name, inst.name),
                opcode=inst.opcode,
                shape=inst.shape,
                instruction=inst,
                computation=comp.name,
                is_root=inst is root,
            )
    for comp in comps:
        for inst in comp.instructions:
            user = node_id(comp.name, inst.name)
            for index, operand in enumerate(inst.operands):
                graph.add_edge(node_id(comp.name, operand), user, kind="operand", index=index)
            if include_called and module is not None:
                for callee in inst.called_computations:
                    if callee in included:
                        callee_root = module.computations[callee].root.name
                        graph.add_edge(
                            node_id(callee, callee_root),
                            user,
                            kind="called",
                            index=None,
                            computation=callee,
                        )
    return graph


def _node_key(data: dict) -> tuple:
    inst = data["instruction"]
    return (
        data["opcode"],
        str(data["shape"]),
        data["is_root"],
        inst.literal,
        inst.parameter_number,
        tuple(sorted(inst.attributes.items())),
        tuple(str(s) for s in inst.operand_shapes),
    )


def graphs_equal(a: nx.MultiDiGraph, b: nx.MultiDiGraph) -> bool:
    """Same nodes (opcode, shape, root flag, literal, attributes) and same edges (with kind
    and operand index). Used to check that print → parse round trips lose nothing."""
    if set(a.nodes) != set(b.nodes):
        return False
    if any(_node_key(a.nodes[n]) != _node_key(b.nodes[n]) for n in a.nodes):
        return False

    def edges(g: nx.MultiDiGraph) -> list[tuple]:
        return sorted(
            (
                (u, v, d["kind"], -1 if d["index"] is None else d["index"])
                for u, v, d in g.edges(data=True)
            )
        )

    return edges(a) == edges(b)
