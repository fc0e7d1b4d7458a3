"""Malformed HLO raises `HloParseError` with a one-line message naming line and column."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hlotool.errors import HloParseError, HlotoolError
from hlotool.hlo import graphs_equal, parse_module, print_module, to_graph

GOOD = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  %q = f32[2]{0} negate(%p), metadata={op_name="x"}
  ROOT %r = f32[2]{0} add(%p, %q), dimensions={0}
}
"""


def position(text: str, needle: str, skip: int = 0) -> tuple[int, int]:
    """1-based (line, column) of `needle` (plus `skip` characters) in `text`."""
    offset = text.index(needle) + skip
    return text.count("\n", 0, offset) + 1, offset - (text.rfind("\n", 0, offset) + 1) + 1


def parse_error(text: str) -> HloParseError:
    with pytest.raises(HloParseError) as info:
        parse_module(text, "bad.hlo")
    error = info.value
    assert "\n" not in str(error)
    assert str(error).startswith(f"bad.hlo:{error.line}:{error.column}: ")
    return error


def test_good_text_parses():
    assert len(parse_module(GOOD).entry) == 3


# (case, text, expected message fragment, needle whose position the error must name, skip)
CASES = [
    (
        "truncated instruction",
        GOOD.replace("add(%p, %q), dimensions={0}\n}\n", "add(%p, "),
        "unbalanced '(': no matching ')'",
        "add(%p, ",
        3,
    ),
    (
        "unknown token after the attributes",
        GOOD.replace("dimensions={0}", "dimensions={0} @@"),
        "expected ',' before the next attribute, found '@@'",
        "@@",
        0,
    ),
    (
        "unknown token in the operands",
        GOOD.replace("negate(%p)", "negate(%p ?)"),
        "expected an operand name, found '%p ?'",
        "%p ?",
        0,
    ),
    (
        "unclosed brace",
        GOOD.replace("dimensions={0}", "dimensions={0"),
        "unbalanced '{': no matching '}'",
        "dimensions={",
        11,
    ),
    (
        "stray closing brace",
        GOOD.replace("dimensions={0}", "dimensions={0}}"),
        "unbalanced '}'",
        "{0}}",
        3,
    ),
    (
        "mismatched bracket",
        GOOD.replace('metadata={op_name="x"}', 'metadata={op_name="x")'),
        "')' does not match '{'",
        '"x")',
        3,
    ),
    (
        "operand referencing an undefined name",
        GOOD.replace("add(%p, %q)", "add(%p, %nope)"),
        "operand 'nope' of 'r' is not defined in computation 'main'",
        "nope",
        0,
    ),
    (
        "unknown element type",
        GOOD.replace("f32[2]{0} negate", "f33[2]{0} negate"),
        "unknown element type 'f33'",
        "f33",
        0,
    ),
    (
        "missing '='",
        GOOD.replace("%q = f32", "%q f32"),
        "expected '=' after instruction name 'q'",
        "%q f32",
        3,
    ),
    (
        "opcode without parentheses",
        GOOD.replace("negate(%p)", "negate %p"),
        "expected '(' after opcode 'negate'",
        "negate %p",
        6,
    ),
    (
        "unterminated string",
        GOOD.replace('op_name="x"', 'op_name="x'),
        "unterminated string",
        '"x',
        0,
    ),
    (
        "computation not closed before the next",
        GOOD.replace("}\n\nENTRY", "\nENTRY"),
        "expected '}' closing computation 'add' before the next header",
        "ENTRY",
        0,
    ),
    (
        "call of a computation that does not exist",
        GOOD.replace("negate(%p)", "map(%p), to_apply=%nowhere"),
        "to_apply=nowhere of 'q' names no computation",
        "to_apply",
        0,
    ),
    (
        "duplicate instruction name",
        GOOD.replace("%q = f32[2]{0} negate", "%p = f32[2]{0} negate"),
        "duplicate instruction name 'p'",
        "p = f32[2]{0} negate",
        0,
    ),
    (
        "missing ENTRY",
        GOOD.replace("ENTRY ", ""),
        "module has no ENTRY computation",
        "%main",
        0,
    ),
    (
        "missing header",
        GOOD.replace("HloModule m", "HloModul m"),
        "expected 'HloModule <name>' header",
        "HloModul",
        0,
    ),
]


@pytest.mark.parametrize(
    ("case", "text", "message", "needle", "skip"), CASES, ids=[c[0] for c in CASES]
)
def test_malformed_text(case: str, text: str, message: str, needle: str, skip: int):
    assert text != GOOD, case
    error = parse_error(text)
    assert message in str(error)
    assert (error.line, error.column) == position(text, needle, skip)


def test_error_is_a_hlotool_error_with_a_source_name():
    with pytest.raises(HlotoolError, match=r"^model\.hlo:12:"):
        parse_module(GOOD.replace("dimensions={0}", "dimensions={0"), "model.hlo")


def test_multi_line_literal_errors_name_the_right_line():
    text = GOOD.replace(
        '  %q = f32[2]{0} negate(%p), metadata={op_name="x"}',
        "  %c = f32[2,2]{1,0} constant({\n    { 1, 2 },\n    { 3, 4 ]\n  })\n"
        "  %q = f32[2]{0} negate(%p)",
    )
    error = parse_error(text)
    assert "']' does not match '{'" in str(error)
    assert (error.line, error.column) == position(text, "4 ]", 2)


def test_empty_text_and_missing_parameter():
    assert "empty HLO text" in str(parse_error("\n\n"))
    error = parse_error(GOOD.replace("parameter(1)", "parameter(2)"))
    assert "computation 'add' has no parameter(1)" in str(error)
    assert (error.line, error.column) == position(GOOD, "%add (", 0)


def test_dangling_stack_frame_id_is_reported_when_resolved():
    text = GOOD.replace('op_name="x"', 'op_name="x" stack_frame_id=9')
    q = parse_module(text).entry.get("q")
    with pytest.raises(
        HloParseError, match="stack_frame_id=9, which is not in StackFrames"
    ) as info:
        _ = q.source
    assert info.value.line == position(text, "stack_frame_id=9")[0]


def test_inconsistent_debug_tables():
    tables = 'FileNames\n1 "a.py"\n\nFileLocations\n1 {file_name_id=2 line=3}\n\n'
    error = parse_error(GOOD.replace("%add (", tables + "%add (", 1))
    assert "file location 1 names file 2, which is not in FileNames" in str(error)


def test_operand_lists_the_fast_path_cannot_split_are_rescanned():
    # Tabs and inline shapes are legal but unusual: the operands must still come out right.
    text = GOOD.replace("add(%p, %q)", "add(%p,\t%q)").replace("negate(%p)", "negate(f32[2]{0} %p)")
    entry = parse_module(text).entry
    assert entry.get("r").operands == ["p", "q"]
    assert entry.get("q").operands == ["p"] and str(entry.get("q").operand_shapes[0]) == "f32[2]{0}"
    error = parse_error(text.replace("add(%p,\t%q)", "add(%p,\t%nope)"))
    assert "operand 'nope' of 'r' is not defined" in str(error)
    assert (error.line, error.column) == position(text.replace("%q)", "%nope)"), "nope)")


def test_random_damage_gives_a_module_or_a_one_line_error():
    """Truncations, deletions, insertions of syntax characters into real fixtures: each
    result parses (and then round trips) or raises `HloParseError`, never anything else."""
    fixtures = Path(__file__).parent / "data" / "hlo"
    texts = [
        (fixtures / f"{p}.{s}.hlo").read_text()
        for p in ("attention", "cond", "while")
        for s in ("cpu_pre", "cpu_post", "tpu_post")
    ]
    rng = random.Random(0)
    outcomes = {"parsed": 0, "error": 0}
    for _ in range(300):
        text = rng.choice(texts)
        at = rng.randrange(len(text))
        damaged = rng.choice(
            [
                text[:at],
                text[:at] + text[at + rng.randint(1, 5) :],
                text[:at] + rng.choice('{}()[],="%\\ \n/*x') + text[at:],
            ]
        )
        try:
            module = parse_module(damaged, "damaged.hlo")
        except HloParseError as error:
            assert "\n" not in str(error) and error.line >= 1 and error.column >= 1
            outcomes["error"] += 1
            continue
        again = parse_module(print_module(module))
        assert graphs_equal(to_graph(module), to_graph(again))
        outcomes["parsed"] += 1
    assert outcomes["parsed"] > 0 and outcomes["error"] > 0
