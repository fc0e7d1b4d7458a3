"""The HLO module as plain Python objects: `Module` → `Computation` → `Instruction`.

Attributes keep their raw text (what XLA printed), so nothing is lost between parsing and
printing; convenience accessors decode the ones passes need.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, NamedTuple

from hlotool.errors import HloParseError, HlotoolError
from hlotool.hlo.shape import Shape
from hlotool.source import user_source

# Attributes whose value names computations the instruction runs.
CALLED_COMPUTATION_ATTRS: tuple[str, ...] = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "select",
    "scatter",
    "called_computations",
)

_CALL_KEYS = frozenset(CALLED_COMPUTATION_ATTRS)
_STRING = r'"(?:[^"\\]|\\.)*"'
_METADATA_ITEM_RE = re.compile(r"([\w.]+)=(" + _STRING + r'|[^\s"]+)')
_ESCAPE_RE = re.compile(rb"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,3}|.)", re.DOTALL)
_SIMPLE_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b'"': b'"', b"'": b"'", b"\\": b"\\"}


def unquote(text: str) -> str:
    """The value of a C-escaped, double-quoted HLO string literal (`"a\\"b"` → `a"b`)."""
    body = text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    if "\\" not in body:
        return body

    def one(m: re.Match[bytes]) -> bytes:
        esc = m.group(1)
        if esc[:1] == b"x":
            return bytes([int(esc[1:], 16)])
        if esc[:1].isdigit():
            return bytes([int(esc, 8) & 0xFF])
        return _SIMPLE_ESCAPES.get(esc, b"\\" + esc)

    return _ESCAPE_RE.sub(one, body.encode("utf-8")).decode("utf-8", "replace")


def split_names(value: str) -> list[str]:
    """`{%a, %b}` or `%a` → `["a", "b"]`."""
    if "," not in value and "{" not in value:
        return [value.strip().lstrip("%")]
    value = value.strip()
    if value.startswith("{") and value.endswith("}"):
        value = value[1:-1]
    return [v.strip().lstrip("%") for v in value.split(",") if v.strip()]


def parse_key_values(text: str) -> dict[str, str]:
    """`{op_name="a b" stack_frame_id=3}` → `{"op_name": "a b", "stack_frame_id": "3"}`."""
    text = text.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    return {k: unquote(v) if v.startswith('"') else v for k, v in _METADATA_ITEM_RE.findall(text)}


class Frame(NamedTuple):
    """One Python stack frame recorded in the module's debug tables."""

    file: str
    line: int
    function: str


@dataclasses.dataclass
class StackFrameTable:
    """The `FileNames / FunctionNames / FileLocations / StackFrames` tables of a module.

    Values are kept as printed so the printer can reproduce them. This jaxlib prints each
    frame's `parent_frame_id` one above the parent's id (the root prints 1, meaning "none");
    a table where some frame prints 0 uses plain ids instead.
    """

    file_names: dict[int, str] = dataclasses.field(default_factory=dict)
    function_names: dict[int, str] = dataclasses.field(default_factory=dict)
    file_locations: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)
    stack_frames: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.stack_frames or self.file_locations)

    @functools.cached_property
    def _parent_offset(self) -> int:
        # Cached: source lookups resolve every instruction's stack through here.
        return 0 if any(f.get("parent_frame_id") == 0 for f in self.stack_frames.values()) else 1

    def frame(self, frame_id: int) -> Frame:
        loc = self.file_locations[self.stack_frames[frame_id]["file_location_id"]]
        return Frame(
            self.file_names[loc["file_name_id"]],
            loc["line"],
            self.function_names.get(loc.get("function_name_id", 0), ""),
        )

    def parent(self, frame_id: int) -> int | None:
        parent = self.stack_frames[frame_id].get("parent_frame_id", 0) - self._parent_offset
        return parent if parent > 0 else None

    def resolve(self, frame_id: int) -> list[Frame]:
        """Frames from `frame_id` outwards: innermost (the op's own line) first."""
        frames: list[Frame] = []
        seen: set[int] = set()
        current: int | None = frame_id
        while current is not None and current not in seen:
            seen.add(current)
            frames.append(self.frame(current))
            current = self.parent(current)
        return frames

    def validate(self) -> str | None:
        """The first dangling reference in the tables, described; None when consistent."""
        for i, loc in self.file_locations.items():
            if loc.get("file_name_id") not in self.file_names:
                name_id = loc.get("file_name_id")
                return f"file location {i} names file {name_id}, which is not in FileNames"
            if "line" not in loc:
                return f"file location {i} has no line"
        for i, f in self.stack_frames.items():
            if f.get("file_location_id") not in self.file_locations:
                loc_id = f.get("file_location_id")
                return (
                    f"stack frame {i} names file location {loc_id}, which is not in FileLocations"
                )
            parent = self.parent(i)
            if parent is not None and parent not in self.stack_frames:
                return f"stack frame {i} names parent frame {parent}, which is not in StackFrames"
        return None


@dataclasses.dataclass(eq=False, slots=True)
class Instruction:
    """One HLO instruction: `name = shape opcode(operands), attr=value, ...`.

    `operands` are instruction names in operand order; `operand_shapes[i]` is the shape XLA
    printed inline before operand i (None when it printed the bare name; the tuple is empty
    when it printed none). `literal` is the
    text inside `constant(...)`. `line` is the 1-based line it was parsed from (0 if built).
    """

    name: str
    opcode: str
    shape: Shape
    operands: list[str]
    attributes: dict[str, str]
    operand_shapes: tuple[Shape | None, ...] = ()
    literal: str | None = None
    parameter_number: int | None = None
    is_root: bool = False
    line: int = 0
    stack_table: StackFrameTable | None = None
    _metadata: dict[str, str] | None = None

    @property
    def called_computations(self) -> list[str]:
        """Names of computations run by this instruction, in the order the text names them."""
        return [
            n
            for key, value in self.attributes.items()
            if key in _CALL_KEYS
            for n in split_names(value)
        ]

    @property
    def metadata(self) -> dict[str, str]:
        """`metadata={...}` decoded: op_type, op_name, source_file, source_line, stack_frame_id."""
        if self._metadata is None:
            raw = self.attributes.get("metadata")
            self._metadata = parse_key_values(raw) if raw else {}
        return self._metadata

    @property
    def stack(self) -> list[Frame]:
        """Python frames that created this op, innermost first ([] without debug info)."""
        meta = self.metadata
        frame_id = meta.get("stack_frame_id")
        if frame_id is not None:
            try:
                return (self.stack_table or StackFrameTable()).resolve(int(frame_id))
            except (KeyError, ValueError):
                raise HloParseError(
                    f"instruction {self.name!r} has stack_frame_id={frame_id}, "
                    "which is not in StackFrames",
                    self.line,
                    1,
                ) from None
        if "source_file" in meta and "source_line" in meta:
            return [Frame(meta["source_file"], int(meta["source_line"]), "")]
        return []

    @property
    def source(self) -> str | None:
        """`"file:line"` of the innermost frame (the user's line of code), if recorded."""
        stack = self.stack
        return f"{stack[0].file}:{stack[0].line}" if stack else None

    @property
    def user_source(self) -> str | None:
        """`"file:line"` of the innermost frame outside installed packages (site-packages,
        dist-packages): the user's line even when a library such as flax made the op."""
        return user_source((f.file, f.line) for f in self.stack) or None

    @property
    def custom_call_target(self) -> str | None:
        raw = self.attributes.get("custom_call_target")
        return None if raw is None else unquote(raw)

    @property
    def backend_config(self) -> dict[str, Any] | str | None:
        """The backend config: a dict when it is JSON (bare or quoted), else the raw string."""
        raw = self.attributes.get("backend_config")
        if raw is None:
            return None
        text = unquote(raw) if raw.startswith('"') else raw
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError:
                return text
            if isinstance(value, dict):
                return value
        return text

    def dims(self, attr: str) -> tuple[int, ...]:
        """An integer-list attribute such as `dimensions={0,1}` as `(0, 1)`."""
        raw = self.attributes.get(attr)
        if raw is None:
            raise HlotoolError(
                f"instruction {self.name!r} ({self.opcode}) has no {attr!r} attribute"
            )
        body = raw.strip()
        if body.startswith("{") and body.endswith("}"):
            body = body[1:-1]
        try:
            return tuple(int(d) for d in body.split(",") if d.strip())
        except ValueError:
            raise HlotoolError(
                f"attribute {attr}={raw} of instruction {self.name!r} is not a list of integers"
            ) from None


@dataclasses.dataclass(eq=False)
class Computation:
    """A named list of instructions in text order; `root` is the one marked ROOT."""

    name: str
    instructions: list[Instruction]
    is_entry: bool = False
    signature: str = ""  # raw `(p: f32[2]) -> f32[2]` text after the name, if printed
    line: int = 0
    _by_name: dict[str, Instruction] = dataclasses.field(default_factory=dict, repr=False)
    module: Module | None = dataclasses.field(default=None, repr=False)  # set by `Module`

    def __post_init__(self) -> None:
        if not self._by_name:
            self._by_name = {i.name: i for i in self.instructions}

    @property
    def root(self) -> Instruction:
        for inst in reversed(self.instructions):
            if inst.is_root:
                return inst
        return self.instructions[-1]

    @property
    def parameters(self) -> list[Instruction]:
        """Parameter instructions ordered by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number or 0)

    def get(self, name: str) -> Instruction:
        try:
            return self._by_name[name.lstrip("%")]
        except KeyError:
            raise HlotoolError(f"computation {self.name!r} has no instruction {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)


@dataclasses.dataclass(eq=False)
class Module:
    """A parsed HLO module. `computations` keeps text order; `attributes` are the raw
    `HloModule name, key=value, ...` header attributes."""

    name: str
    computations: dict[str, Computation]
    attributes: dict[str, str] = dataclasses.field(default_factory=dict)
    stack_table: StackFrameTable = dataclasses.field(default_factory=StackFrameTable)
    source_name: str = "<hlo>"

    def __post_init__(self) -> None:
        for comp in self.computations.values():
            comp.module = self

    @property
    def partitions(self) -> int:
        """The devices XLA's SPMD partitioner split this program over (the header's
        `num_partitions`; 1 for a program not split)."""
        return int(self.attributes.get("num_partitions", "1") or 1)

    @property
    def entry(self) -> Computation:
        for comp in self.computations.values():
            if comp.is_entry:
                return comp
        raise HlotoolError(f"module {self.name!r} has no ENTRY computation")

    def instructions(self):
        """Every instruction of every computation, in text order."""
        for comp in self.computations.values():
            yield from comp.instructions

    def callers(self) -> dict[str, list[tuple[str, Instruction]]]:
        """Computation name → (computation, instruction) of every instruction calling it."""
        out: dict[str, list[tuple[str, Instruction]]] = {}
        for comp in self.computations.values():
            for inst in comp:
                for callee in inst.called_computations:
                    out.setdefault(callee, []).append((comp.name, inst))
        return out

    def inline_calls(self) -> Module:
        """This module with every `call` inlined (itself when it has none)."""
        if not any(i.opcode == "call" for i in self.instructions()):
            return self
        from hlotool.hlo.inline import inline_calls

        return inline_calls(self)
