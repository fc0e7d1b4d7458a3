"""parse → print → parse keeps every computation, instruction, shape, operand and attribute,
on every committed fixture (CPU/TPU, before/after optimization, dump files)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hlotool.hlo.parser as parser
from hlotool.hlo import graphs_equal, parse_module, print_module, to_graph

FIXTURES = Path(__file__).parent / "data" / "hlo"
FILES = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".hlo", ".txt"))


def test_fixture_set_covers_cpu_tpu_pre_post_and_dumps():
    names = {p.name for p in FILES}
    for program in ("attention", "mlp_scan", "cond", "while", "transformer"):
        for stage in ("cpu_pre", "cpu_post", "tpu_post"):
            assert f"{program}.{stage}.hlo" in names
    assert {"dump_attention_before.txt", "dump_attention_after.txt"} <= names
    assert sum(p.stat().st_size for p in FIXTURES.iterdir()) < 2_000_000


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_round_trip(path: Path):
    original = parse_module(path.read_text(), str(path))
    printed = print_module(original)
    again = parse_module(printed, "<printed>")

    assert list(again.computations) == list(original.computations)
    assert again.entry.name == original.entry.name
    assert again.attributes == original.attributes
    assert again.stack_table == original.stack_table
    assert graphs_equal(to_graph(original), to_graph(again))
    for comp in original.computations.values():
        other = again.computations[comp.name]
        assert [i.name for i in other.instructions] == [i.name for i in comp.instructions]
        assert [i.source for i in other.instructions] == [i.source for i in comp.instructions]
    # Printing is a fixed point after one round.
    assert print_module(again) == printed


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_precise_scanner_agrees_with_fast_path(path: Path, monkeypatch: pytest.MonkeyPatch):
    text = path.read_text()
    fast = parse_module(text)
    monkeypatch.setattr(parser, "_INSTRUCTION_RE", re.compile(r"(?!)"))  # never matches
    slow = parse_module(text)
    assert graphs_equal(to_graph(fast), to_graph(slow))


def test_graphs_equal_sees_a_changed_attribute_shape_and_edge():
    text = (FIXTURES / "attention.cpu_pre.hlo").read_text()
    base = to_graph(parse_module(text))
    assert not graphs_equal(
        base, to_graph(parse_module(text.replace("dimensions={3}", "dimensions={2}", 1)))
    )
    assert not graphs_equal(
        base,
        to_graph(
            parse_module(
                text.replace("f32[1,2,16]{2,1,0} reduce(", "f32[1,2,16]{0,1,2} reduce(", 1)
            )
        ),
    )
    swapped = text.replace("subtract(jit__where_.1, sub.6)", "subtract(sub.6, jit__where_.1)")
    assert swapped != text
    assert not graphs_equal(base, to_graph(parse_module(swapped)))
