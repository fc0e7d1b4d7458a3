"""Inlining of `call` instructions, so patterns split across `jit`-nested helpers (a mask
applied through `call(..., to_apply=_where)`) become one flat graph."""

from __future__ import annotations

import dataclasses

from hlotool.hlo.ir import Computation, Instruction, Module, split_names


class _Inliner:
    def __init__(self, module: Module, used: set[str]):
        self.module = module
        self.used = used

    def _fresh(self, name: str) -> str:
        if name not in self.used:
            self.used.add(name)
            return name
        k = 1
        while f"{name}.{k}" in self.used:
            k += 1
        self.used.add(f"{name}.{k}")
        return f"{name}.{k}"

    def expand(self, comp: Computation, args: dict[str, str] | None, out: list[Instruction]) -> str:
        """Appends `comp`'s instructions to `out` with every call inlined; returns the name
        of the value `comp` computes. `args` maps its parameter names to caller values;
        None keeps `comp` itself (its parameters and names) as the top level."""
        local: dict[str, str] = dict(args or {})
        emitted: list[Instruction] = []
        for inst in comp.instructions:
            if inst.opcode == "parameter" and args is not None:
                continue
            if inst.opcode == "call":
                callee = self.module.computations[split_names(inst.attributes["to_apply"])[0]]
                # Operands may still name calls earlier in the text; resolve them first.
                sub_args = {
                    p.name: local.get(
                        inst.operands[p.parameter_number], inst.operands[p.parameter_number]
                    )
                    for p in callee.parameters
                }
                local[inst.name] = self.expand(callee, sub_args, out)
                continue
            name = inst.name if args is None else self._fresh(inst.name)
            local[inst.name] = name
            clone = dataclasses.replace(
                inst, name=name, attributes=dict(inst.attributes), is_root=False, _metadata=None
            )
            emitted.append(clone)
            out.append(clone)
        for clone in emitted:
            clone.operands = [local[op] for op in clone.operands]
        return local[comp.root.name]


def inline_calls(module: Module) -> Module:
    """A new module in which every `call` is replaced by the body of the computation it
    calls (recursively), operands wired to the call's arguments and users to the body's
    result. Computations only reachable through calls are dropped; fusions, while loops
    and conditionals are left as they are. Inlined names get a `.N` suffix on a clash."""
    call_targets: set[str] = set()
    other_targets: set[str] = set()
    for inst in module.instructions():
        for callee in inst.called_computations:
            (call_targets if inst.opcode == "call" else other_targets).add(callee)
    kept = [
        c
        for c in module.computations.values()
        if c.is_entry or c.name not in call_targets or c.name in other_targets
    ]
    used = {i.name for c in kept for i in c.instructions}
    inliner = _Inliner(module, used)
    computations: dict[str, Computation] = {}
    for comp in kept:
        out: list[Instruction] = []
        result = inliner.expand(comp, None, out)
        by_name = {i.name: i for i in out}
        by_name[result].is_root = True
        computations[comp.name] = Computation(
            comp.name, out, comp.is_entry, comp.signature, comp.line
        )
    return Module(
        module.name, computations, dict(module.attributes), module.stack_table, module.source_name
    )
