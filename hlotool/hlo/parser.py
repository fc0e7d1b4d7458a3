"""HLO text → `Module`.

Reads what XLA prints: `lower().as_text(dialect="hlo")` (with or without `debug_info=True`),
`compile().as_text()` for CPU and TPU, and `--xla_dump_hlo_as_text` dump files.

Speed comes from matching a whole instruction line with one compiled regex (nesting of
`{}`, `()`, `[]` and quoted strings unrolled to a fixed depth); a line it does not match —
deeper nesting, a literal spread over several lines, or malformed text — goes to a precise
bracket-by-bracket scanner that either parses it or says where it breaks.
"""

from __future__ import annotations

import gc
import re
from typing import NamedTuple

from hlotool.errors import HloParseError
from hlotool.hlo.ir import (
    CALLED_COMPUTATION_ATTRS,
    Computation,
    Instruction,
    Module,
    StackFrameTable,
    parse_key_values,
    split_names,
    unquote,
)
from hlotool.hlo.shape import Shape, ShapeError, parse_shape

_STRING = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_NAME = r"[\w.\-]+"
_OPEN = "{(["
_CLOSE = "})]"
_MATCHING = {"{": "}", "(": ")", "[": "]"}


def _nested(depth: int) -> str:
    """Regex for text whose brackets balance (and match in kind) up to `depth` levels."""
    inner = r'(?:[^{}()\[\]"]++|' + _STRING + r")*+"
    for _ in range(depth):
        inner = (
            r'(?:[^{}()\[\]"]++|'
            + _STRING
            + r"|\{"
            + inner
            + r"\}|\("
            + inner
            + r"\)|\["
            + inner
            + r"\])*+"
        )
    return inner


# Depth 3 covers tuple shapes with tiled layouts, (f32[8]{0:T(8)}, ...); attribute values
# get one level more (metadata, sharding, most backend configs); deeper text takes the
# precise scanner.
_NEST = _nested(3)
_SHAPE = r"(?:\(" + _NEST + r"\)|[a-z][a-z0-9]*\[[^\]]*\](?:\{[^{}]*\})?)"
# The last group is the attribute text after the operands, checked separately.
_INSTRUCTION_RE = re.compile(
    r"\s*(ROOT\s+)?%?(" + _NAME + r")\s*=\s*(" + _SHAPE + r")\s*([a-z][\w\-]*)\(([^()]*)\)(.*)",
    re.ASCII,
)
# A value is a run of words, quoted strings and bracketed groups; a blank may only lead
# into a group (`replica_groups=mesh['axis_0'=4] {'axis_0'}`).
_VALUE = (
    r"(?:[^,{}()\[\]\"\s]++|"
    + _STRING
    + r"|\{"
    + _nested(4)
    + r"\}|\("
    + _NEST
    + r"\)|\["
    + _NEST
    + r"\]|\s++(?=[{(\[\"]))++"
)
# An attribute, or any other visible character, which yields ("", "") and rejects the line.
_ATTRIBUTES_RE = re.compile(r"\s*,\s*(" + _NAME + r")=(" + _VALUE + r")|\S", re.ASCII)
_SHAPES: dict[str, Shape] = {}
_CALL_KEYS = frozenset(CALLED_COMPUTATION_ATTRS)
_OPERAND_RE = re.compile(r"\s*(?:(" + _SHAPE + r")\s+)?%?(" + _NAME + r")\s*(?:,|$)", re.ASCII)
_COMPUTATION_RE = re.compile(
    r"\s*(ENTRY\s+)?%?(" + _NAME + r")\s*(\(.*\)\s*->(?:.*\S)?)?\s*\{\s*$", re.ASCII
)
_HEADER_RE = re.compile(r"\s*HloModule\s+(" + _NAME + r")", re.ASCII)
_TABLE_ROW_RE = re.compile(r"\s*(\d+)\s+(.*?)\s*$", re.ASCII)
_TOKEN_RE = re.compile(_STRING + r'|"|[{}()\[\]]', re.ASCII)
_STRING_RE = re.compile(_STRING, re.ASCII)
_ARRAY_SHAPE_RE = re.compile(r"[a-z][a-z0-9]*\[[^\]\n]*\]", re.ASCII)
_OPCODE_RE = re.compile(r"[a-z][\w\-]*", re.ASCII)
_NAME_RE = re.compile(_NAME, re.ASCII)
_COMMENT_RE = re.compile(_STRING + r"|/\*.*?\*/", re.DOTALL | re.ASCII)
_WORD_RE = re.compile(r"\s*(" + _NAME + r")", re.ASCII)
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


class _Parsed(NamedTuple):
    is_root: bool
    name: str
    shape: str
    opcode: str
    operands: str
    operands_at: int  # offset of the operand text in the instruction text
    attributes: list[tuple[str, str, int]]  # (key, raw value, offset of the value)


class _Source:
    """The text being parsed, with (line, column) for any offset into a joined statement."""

    def __init__(self, text: str, source_name: str):
        self.lines = text.split("\n")
        self.name = source_name

    def error(self, message: str, line: int, column: int) -> HloParseError:
        return HloParseError(message, line, column, self.name)

    def error_at(self, message: str, start_line: int, text: str, offset: int) -> HloParseError:
        """An error at `offset` into `text`, which begins at column 1 of `start_line`."""
        offset = min(max(offset, 0), len(text))
        before = text[:offset]
        newlines = before.count("\n")
        column = offset - (before.rfind("\n") + 1) + 1
        return self.error(message, start_line + newlines, column)


def parse_module(text: str, source_name: str = "<hlo>") -> Module:
    """Parses HLO text into a `Module`; raises `HloParseError` naming line and column."""
    # A large module allocates ~10 objects per instruction, none cyclic: collector passes
    # during the parse would cost ~10% of its time for nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _ModuleParser(_Source(text, source_name)).parse()
    finally:
        if was_enabled:
            gc.enable()


class _ModuleParser:
    def __init__(self, source: _Source):
        self.src = source
        self.lines = source.lines
        self.pos = 0  # index of the next line to read
        self.called: list[str] = []  # computations named by `calls=`, `to_apply=`, ...
        self.table_line = 0  # where the first debug table starts, for table errors
        # Attribute text after `opcode(...)` → `_tail_attributes` of it. Lines repeat their
        # tails a lot (the same metadata, dims and layouts in every layer; most post-opt
        # lines have none), so each distinct tail is scanned once per module.
        self.tails: dict[str, tuple[dict[str, str] | None, list[str]]] = {}

    def parse(self) -> Module:
        name, attributes = self._header()
        table = StackFrameTable()
        computations: dict[str, Computation] = {}
        lines = self.lines
        while self.pos < len(lines):
            line = lines[self.pos]
            stripped = line.strip()
            if not stripped or stripped.startswith("//"):
                self.pos += 1
            elif stripped in _TABLES:
                self._table(stripped, table)
            else:
                comp = self._computation(table)
                if comp.name in computations:
                    raise self.src.error(f"duplicate computation name {comp.name!r}", comp.line, 1)
                computations[comp.name] = comp
        if not computations:
            raise self.src.error("module has no computations", len(lines), 1)
        entries = [c for c in computations.values() if c.is_entry]
        if not entries:
            last = list(computations.values())[-1]
            raise self.src.error(
                "module has no ENTRY computation (one header must start with 'ENTRY')", last.line, 1
            )
        if len(entries) > 1:
            raise self.src.error(
                f"second ENTRY computation {entries[1].name!r} (first is {entries[0].name!r})",
                entries[1].line,
                1,
            )
        problem = table.validate()
        if problem:
            raise self.src.error(f"inconsistent debug tables: {problem}", self.table_line or 1, 1)
        module = Module(name, computations, attributes, table, self.src.name)
        if not computations.keys() >= set(self.called):
            _check_calls(module, self.src)
        return module

    # -- module header and debug tables ---------------------------------------------------

    def _header(self) -> tuple[str, dict[str, str]]:
        lines = self.lines
        while self.pos < len(lines) and not lines[self.pos].strip():
            self.pos += 1
        if self.pos == len(lines):
            raise self.src.error("empty HLO text (expected 'HloModule <name>')", 1, 1)
        line_no = self.pos + 1
        text = self._statement()
        m = _HEADER_RE.match(text)
        if not m:
            raise self.src.error_at(
                "expected 'HloModule <name>' header", line_no, text, len(text) - len(text.lstrip())
            )
        attrs = _attributes(text, m.end(), self.src, line_no)
        return m.group(1), {k: v for k, v, _ in attrs}

    def _table(self, kind: str, table: StackFrameTable) -> None:
        self.table_line = self.table_line or self.pos + 1
        self.pos += 1
        target = {
            "FileNames": table.file_names,
            "FunctionNames": table.function_names,
            "FileLocations": table.file_locations,
            "StackFrames": table.stack_frames,
        }[kind]
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            if not line.strip():
                return
            m = _TABLE_ROW_RE.match(line)
            if not m:
                raise self.src.error(
                    f"expected '<id> <value>' row in {kind} table", self.pos + 1, 1
                )
            value = m.group(2)
            if kind in ("FileNames", "FunctionNames"):
                if not (value.startswith('"') and value.endswith('"') and len(value) >= 2):
                    raise self.src.error(
                        f"expected a quoted string in {kind} table", self.pos + 1, m.start(2) + 1
                    )
                target[int(m.group(1))] = unquote(value)
            else:
                if not (value.startswith("{") and value.endswith("}")):
                    raise self.src.error(
                        f"expected '{{key=value ...}}' in {kind} table",
                        self.pos + 1,
                        m.start(2) + 1,
                    )
                try:
                    target[int(m.group(1))] = {
                        k: int(v) for k, v in parse_key_values(value).items()
                    }
                except ValueError:
                    raise self.src.error(
                        f"non-integer value in {kind} table", self.pos + 1, m.start(2) + 1
                    ) from None
            self.pos += 1

    # -- computations ---------------------------------------------------------------------

    def _computation(self, table: StackFrameTable) -> Computation:
        line_no = self.pos + 1
        line = self.lines[self.pos]
        header = _COMPUTATION_RE.match(line)
        if not header:
            col = len(line) - len(line.lstrip()) + 1
            if "=" in line and not line.strip().endswith("{"):
                raise self.src.error(
                    "instruction outside a computation (missing '{' header?)", line_no, col
                )
            raise self.src.error(
                "expected a computation header like 'ENTRY %main (p: f32[2]) -> f32[2] {'",
                line_no,
                col,
            )
        self.pos += 1
        comp_name = header.group(2)
        instructions: list[Instruction] = []
        append = instructions.append
        # Checked once the computation is complete: operand names, ROOTs, parameter numbers.
        used: list[str] = []
        use = used.extend
        roots: list[Instruction] = []
        params: list[int] = []
        call = self.called.extend
        match_instruction = _INSTRUCTION_RE.match
        shapes = _SHAPES
        tails = self.tails
        lines = self.lines
        n_lines = len(lines)
        pos = self.pos
        while True:
            if pos >= n_lines:
                raise self.src.error(
                    f"computation {comp_name!r} is not closed (missing '}}')", line_no, len(line)
                )
            text = lines[pos]
            pos += 1
            if "/*" in text:
                text = _blank_comments(text)
            # The fast path: a well-formed one-line instruction in a few C-level calls. It is
            # the parser's hot loop, hence written out here rather than in a helper.
            m = match_instruction(text)
            if m is not None:
                root, name, shape_text, opcode, inside, tail = m.groups()
                known = tails.get(tail)
                if known is None:
                    known = tails[tail] = _tail_attributes(tail)
                template, callees = known
                shape = shapes.get(shape_text) or _new_shape(shape_text)
                # A bad shape or malformed attributes (None template) → precise path.
                if shape is not None and template is not None:
                    literal = parameter_number = None
                    operands: list[str] = []
                    ok = True
                    if opcode == "constant":
                        literal = inside
                        ok = inside.count("{") == inside.count("}")
                    elif opcode == "parameter":
                        ok = inside.isdigit()
                        parameter_number = int(inside) if ok else None
                        if ok:
                            params.append(parameter_number)
                    elif inside:
                        # Operands with inline shapes take the precise path; bare names are
                        # checked when the computation is complete (all must be defined).
                        ok = "[" not in inside
                        if ok:
                            operands = inside.replace("%", "").replace(" ", "").split(",")
                    if ok:
                        inst = Instruction(
                            name,
                            opcode,
                            shape,
                            operands,
                            template.copy(),
                            (),
                            literal,
                            parameter_number,
                            root is not None,
                            pos,
                            table,
                        )
                        append(inst)
                        use(operands)
                        if root is not None:
                            roots.append(inst)
                        if callees:
                            call(callees)
                        continue
            stripped = text.strip()
            if stripped == "}":
                break
            if not stripped or stripped.startswith("//"):
                continue
            if _COMPUTATION_RE.match(text):
                raise self.src.error(
                    f"expected '}}' closing computation {comp_name!r} before the next header",
                    pos,
                    1,
                )
            self.pos = pos - 1
            text = self._statement()
            inst = _build(_parse_slow(text, self.src, pos), text, self.src, pos, table)
            pos = self.pos
            append(inst)
            use(inst.operands)
            if inst.is_root:
                roots.append(inst)
            if inst.parameter_number is not None:
                params.append(inst.parameter_number)
            call(inst.called_computations)
        self.pos = pos
        if not instructions:
            raise self.src.error(f"computation {comp_name!r} has no instructions", line_no, 1)
        by_name = {i.name: i for i in instructions}
        comp = Computation(
            comp_name,
            instructions,
            header.group(1) is not None,
            header.group(3) or "",
            line_no,
            by_name,
        )
        # The common, clean case in a few C-level calls; the helper finds what is wrong.
        if (
            len(by_name) != len(instructions)
            or not by_name.keys() >= set(used)
            or len(roots) > 1
            or (params and sorted(params) != list(range(len(params))))
        ):
            _check_computation(comp, self.src, used, roots, params)
        return comp

    def _statement(self) -> str:
        """The statement at the current line (see `_join_statement`); advances past it."""
        text, self.pos = _join_statement(self.lines, self.pos)
        return text


def _join_statement(lines: list[str], start: int) -> tuple[str, int]:
    """The statement starting at `lines[start]`, joined with following lines while its
    brackets are open (multi-line literals), and the index of the line after it."""
    text = lines[start]
    pos = start + 1
    while _open_depth(text) > 0 and pos < len(lines):
        nxt = lines[pos]
        if nxt.strip() == "}" or _COMPUTATION_RE.match(nxt):
            break
        text += "\n" + nxt
        pos += 1
    return text, pos


def _open_depth(text: str) -> int:
    """How many brackets are left open at the end of `text` (strings and comments skipped)."""
    depth = 0
    for tok in _TOKEN_RE.findall(text):
        if tok in _OPEN:
            depth += 1
        elif tok in _CLOSE:
            depth -= 1
        elif tok == '"':  # an unterminated string swallows the rest of the statement
            return depth + 1
    return depth


def _new_shape(text: str) -> Shape | None:
    try:
        shape = _SHAPES[text] = parse_shape(text)
    except ShapeError:
        return None
    return shape


def _tail_attributes(tail: str) -> tuple[dict[str, str] | None, list[str]]:
    """The attributes in the text after an instruction's operands, and the computations
    they name (as `Instruction.called_computations`); (None, []) when the text is not a
    clean `, key=value` list (a stray character yields a "" key; a key given twice) and
    the line needs the precise scanner. The dict is a template: each instruction gets a
    copy."""
    found = _ATTRIBUTES_RE.findall(tail)
    attributes = dict(found)
    if len(attributes) != len(found) or "" in attributes:
        return None, []
    return attributes, [
        n for key, value in attributes.items() if key in _CALL_KEYS for n in split_names(value)
    ]


def _blank_comments(text: str) -> str:
    """`/*index=5*/` comments replaced by blanks of the same length (columns stay right)."""
    return _COMMENT_RE.sub(
        lambda m: m.group(0) if m.group(0)[0] == '"' else " " * len(m.group(0)), text
    )


# -- the precise scanner -------------------------------------------------------------------


def _close(text: str, pos: int, src: _Source, line: int) -> int:
    """Index just past the bracket that closes the one at `pos`."""
    stack: list[tuple[str, int]] = []
    for m in _TOKEN_RE.finditer(text, pos):
        tok = m.group(0)
        if tok in _OPEN:
            stack.append((tok, m.start()))
        elif tok in _CLOSE:
            if not stack:
                raise src.error_at(f"unbalanced {tok!r}", line, text, m.start())
            opener, at = stack.pop()
            if _MATCHING[opener] != tok:
                raise src.error_at(
                    f"{tok!r} does not match {opener!r} opened at column "
                    f"{at - text.rfind(chr(10), 0, at)}",
                    line,
                    text,
                    m.start(),
                )
            if not stack:
                return m.end()
        elif tok == '"':
            raise src.error_at("unterminated string", line, text, m.start())
    opener, at = stack[0]
    raise src.error_at(f"unbalanced {opener!r}: no matching {_MATCHING[opener]!r}", line, text, at)


def _value_end(text: str, pos: int, src: _Source, line: int) -> int:
    """End of an attribute value starting at `pos`: the next comma outside brackets."""
    n = len(text)
    while pos < n:
        c = text[pos]
        if c == ",":
            return pos
        if c.isspace():
            after = _skip_ws(text, pos)
            if after >= n or text[after] not in '{(["':
                return pos
            pos = after
            continue
        if c in _OPEN:
            pos = _close(text, pos, src, line)
        elif c in _CLOSE:
            raise src.error_at(f"unbalanced {c!r}", line, text, pos)
        elif c == '"':
            m = _STRING_RE.match(text, pos)
            if m is None:
                raise src.error_at("unterminated string", line, text, pos)
            pos = m.end()
        else:
            pos += 1
    return pos


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _found(text: str, pos: int) -> str:
    return repr(text[pos : pos + 10]) if pos < len(text) else "end of line"


def _attributes(text: str, pos: int, src: _Source, line: int) -> list[tuple[str, str, int]]:
    attrs: list[tuple[str, str, int]] = []
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text):
            return attrs
        if text[pos] != ",":
            raise src.error_at(
                f"expected ',' before the next attribute, found {_found(text, pos)}",
                line,
                text,
                pos,
            )
        pos = _skip_ws(text, pos + 1)
        m = _WORD_RE.match(text, pos)
        if not m or not text.startswith("=", m.end()):
            raise src.error_at(
                f"expected 'name=value' attribute, found {_found(text, pos)}", line, text, pos
            )
        start = m.end() + 1
        end = _value_end(text, start, src, line)
        if end == start:
            raise src.error_at(f"attribute {m.group(1)!r} has no value", line, text, start)
        attrs.append((m.group(1), text[start:end].rstrip(), start))
        pos = end


def _parse_slow(text: str, src: _Source, line: int) -> _Parsed:
    if "/*" in text:
        text = _blank_comments(text)
    pos = _skip_ws(text, 0)
    is_root = text.startswith("ROOT", pos) and text[pos + 4 : pos + 5].isspace()
    if is_root:
        pos = _skip_ws(text, pos + 4)
    if text.startswith("%", pos):
        pos += 1
    m = _WORD_RE.match(text, pos)
    if not m:
        raise src.error_at(
            f"expected an instruction name, found {_found(text, pos)}", line, text, pos
        )
    name = m.group(1)
    pos = _skip_ws(text, m.end())
    if not text.startswith("=", pos):
        raise src.error_at(
            f"expected '=' after instruction name {name!r}, found {_found(text, pos)}",
            line,
            text,
            pos,
        )
    pos = _skip_ws(text, pos + 1)
    shape_start = pos
    if text.startswith("(", pos):
        pos = _close(text, pos, src, line)
    else:
        sm = _ARRAY_SHAPE_RE.match(text, pos)
        if not sm:
            raise src.error_at(
                f"expected a shape like f32[2,3]{{1,0}}, found {_found(text, pos)}", line, text, pos
            )
        pos = sm.end()
        if text.startswith("{", pos):
            pos = _close(text, pos, src, line)
    shape = text[shape_start:pos]
    pos = _skip_ws(text, pos)
    om = _OPCODE_RE.match(text, pos)
    if not om:
        raise src.error_at(
            f"expected an opcode after the shape, found {_found(text, pos)}", line, text, pos
        )
    opcode = om.group(0)
    pos = om.end()
    if not text.startswith("(", pos):
        raise src.error_at(
            f"expected '(' after opcode {opcode!r}, found {_found(text, pos)}", line, text, pos
        )
    end = _close(text, pos, src, line)
    operands, operands_at = text[pos + 1 : end - 1], pos + 1
    return _Parsed(
        is_root, name, shape, opcode, operands, operands_at, _attributes(text, end, src, line)
    )


def _split_operands(
    text: str, at: int, full: str, src: _Source, line: int
) -> list[tuple[str | None, str, int]]:
    """`f32[2]{0} %a, %b` → [(shape text | None, name, offset of name)]."""
    if not text.strip():
        return []
    if "[" not in text and "(" not in text and "/" not in text:
        out = []
        pos = 0
        for part in text.split(","):
            name = part.strip().lstrip("%")
            if not _NAME_RE.fullmatch(name):
                off = at + pos + len(part) - len(part.lstrip())
                raise src.error_at(
                    f"expected an operand name, found {part.strip()!r}", line, full, off
                )
            out.append((None, name, at + pos + part.find(name)))
            pos += len(part) + 1
        return out
    if "/*" in text:
        text = _blank_comments(text)
    out = []
    pos = 0
    while pos < len(text):
        m = _OPERAND_RE.match(text, pos)
        if not m:
            raise src.error_at(
                f"expected an operand, found {_found(text, _skip_ws(text, pos))}",
                line,
                full,
                at + _skip_ws(text, pos),
            )
        out.append((m.group(1), m.group(2), at + m.start(2)))
        pos = m.end()
    if text.rstrip().endswith(","):
        raise src.error_at("expected an operand after ','", line, full, at + len(text.rstrip()))
    return out


def _shape(text: str, src: _Source, line: int, full: str, at: int) -> Shape:
    try:
        return parse_shape(text)
    except ShapeError as e:
        raise src.error_at(str(e), line, full, at + e.offset) from None


def _build(p: _Parsed, text: str, src: _Source, line: int, table: StackFrameTable) -> Instruction:
    shape = _shape(p.shape, src, line, text, text.find(p.shape))
    literal = None
    parameter_number = None
    operands: list[str] = []
    operand_shapes: list[Shape | None] = []
    if p.opcode == "constant":
        literal = p.operands
    else:
        if p.opcode == "parameter":
            try:
                parameter_number = int(p.operands)
            except ValueError:
                raise src.error_at(
                    f"parameter number must be an integer, found {p.operands!r}",
                    line,
                    text,
                    p.operands_at,
                ) from None
        else:
            for shape_text, name, offset in _split_operands(
                p.operands, p.operands_at, text, src, line
            ):
                operands.append(name)
                operand_shapes.append(
                    None if shape_text is None else _shape(shape_text, src, line, text, offset)
                )
    attributes = {}
    for key, value, offset in p.attributes:
        if key in attributes:
            raise src.error_at(f"attribute {key!r} given twice", line, text, offset)
        attributes[key] = value
    return Instruction(
        p.name,
        p.opcode,
        shape,
        operands,
        attributes,
        tuple(operand_shapes) if any(s is not None for s in operand_shapes) else (),
        literal,
        parameter_number,
        p.is_root,
        line,
        table,
    )


# -- whole-computation checks ----------------------------------------------------------------


def _check_computation(
    comp: Computation, src: _Source, used: list[str], roots: list[Instruction], params: list[int]
) -> None:
    """Unique names, defined operands (`used`), one ROOT, parameters numbered 0..n-1."""
    insts = comp.instructions
    names = comp._by_name
    if len(names) != len(insts):
        seen: set[str] = set()
        for inst in insts:
            if inst.name in seen:
                col = src.lines[inst.line - 1].find(inst.name) + 1
                raise src.error(
                    f"duplicate instruction name {inst.name!r} in computation {comp.name!r}",
                    inst.line,
                    max(col, 1),
                )
            seen.add(inst.name)
    if not names.keys() >= set(used):
        for inst in insts:
            if all(operand in names for operand in inst.operands):
                continue
            # The fast path splits operand lists without validating names: rescan the line
            # precisely, which either names what is malformed or gives the real operands.
            text = _join_statement(src.lines, inst.line - 1)[0]
            parsed = _parse_slow(text, src, inst.line)
            names_found = [
                n
                for _, n, _ in _split_operands(
                    parsed.operands, parsed.operands_at, text, src, inst.line
                )
            ]
            for operand in names_found:
                if operand not in names:
                    raise src.error_at(
                        f"operand {operand!r} of {inst.name!r} is not defined in "
                        f"computation {comp.name!r}",
                        inst.line,
                        text,
                        text.find(operand, parsed.operands_at),
                    )
            inst.operands = names_found
    if len(roots) > 1:
        raise src.error(f"computation {comp.name!r} has two ROOT instructions", roots[1].line, 1)
    if params and sorted(params) != list(range(len(params))):
        for expected, number in enumerate(sorted(params)):
            if number < expected:
                twice = [i for i in insts if i.parameter_number == number][1]
                raise src.error(
                    f"parameter({number}) appears twice in computation {comp.name!r}", twice.line, 1
                )
            if number > expected:
                raise src.error(
                    f"computation {comp.name!r} has no parameter({expected})", comp.line, 1
                )


def _check_calls(module: Module, src: _Source) -> None:
    """Names the first instruction whose `calls=`, `to_apply=`, ... names no computation."""
    for inst in module.instructions():
        for key in inst.attributes.keys() & _CALL_KEYS:
            for callee in split_names(inst.attributes[key]):
                if callee not in module.computations:
                    text = src.lines[inst.line - 1]
                    col = text.find(f"{key}=") + 1
                    raise src.error(
                        f"{key}={callee} of {inst.name!r} names no computation in the module",
                        inst.line,
                        max(col, 1),
                    )
