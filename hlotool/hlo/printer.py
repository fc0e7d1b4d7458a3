"""`Module` → HLO text that `parse_module` reads back into the same module."""

from __future__ import annotations

from hlotool.hlo.ir import Computation, Instruction, Module, StackFrameTable


def quote(value: str) -> str:
    """`a"b` → `"a\\"b"`: the C-escaped literal XLA prints."""
    escaped = (
        value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    )
    return f'"{escaped}"'


def print_instruction(inst: Instruction) -> str:
    """One instruction line, without indentation."""
    if inst.opcode == "constant":
        inside = inst.literal or ""
    elif inst.opcode == "parameter":
        inside = str(inst.parameter_number)
    elif inst.operand_shapes:
        inside = ", ".join(
            f"{shape} %{name}" if shape is not None else f"%{name}"
            for shape, name in zip(inst.operand_shapes, inst.operands, strict=True)
        )
    else:
        inside = ", ".join(f"%{name}" for name in inst.operands)
    attrs = "".join(f", {key}={value}" for key, value in inst.attributes.items())
    root = "ROOT " if inst.is_root else ""
    return f"{root}%{inst.name} = {inst.shape} {inst.opcode}({inside}){attrs}"


def print_computation(comp: Computation) -> str:
    entry = "ENTRY " if comp.is_entry else ""
    signature = f" {comp.signature}" if comp.signature else ""
    root = comp.root
    lines = [f"{entry}%{comp.name}{signature} {{"]
    for inst in comp.instructions:
        # A computation without a ROOT marker has its last instruction as root.
        if inst is root and not inst.is_root:
            lines.append("  ROOT " + print_instruction(inst))
        else:
            lines.append("  " + print_instruction(inst))
    lines.append("}")
    return "\n".join(lines)


def _print_tables(table: StackFrameTable) -> list[str]:
    blocks = []
    for title, rows in (("FileNames", table.file_names), ("FunctionNames", table.function_names)):
        if rows:
            blocks.append("\n".join([title] + [f"{i} {quote(v)}" for i, v in rows.items()]))
    for title, records in (
        ("FileLocations", table.file_locations),
        ("StackFrames", table.stack_frames),
    ):
        if records:
            lines = [title]
            for i, record in records.items():
                lines.append(f"{i} {{" + " ".join(f"{k}={v}" for k, v in record.items()) + "}")
            blocks.append("\n".join(lines))
    return blocks


def print_module(module: Module) -> str:
    """The module as HLO text (names printed with `%`, attributes as parsed)."""
    header = f"HloModule {module.name}" + "".join(
        f", {key}={value}" for key, value in module.attributes.items()
    )
    blocks = [header, *_print_tables(module.stack_table)]
    blocks.extend(print_computation(c) for c in module.computations.values())
    return "\n\n".join(blocks) + "\n"
