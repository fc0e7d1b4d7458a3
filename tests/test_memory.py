"""Memory, native vs rewritten: `rewrite` and `diff` show XLA's memory_analysis of both
programs per function and target, and `--fail-on-memory-growth` exits 1 (findings) when a
rewrite needs more: short sequences in the chunked kernel on CPU, and a key-padding mask the
Pallas TPU kernel takes as a dense f32 bias, grow; a long causal sequence shrinks."""

from __future__ import annotations

import json
import textwrap
import types

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.errors import EXIT_FINDINGS, HlotoolError
from hlotool.report.memory import Memory, MemoryRow, growth, memory_row, render_memory

PADDED = """\
import sys, math, jax, jax.numpy as jnp

@jax.jit
def padded(q, k, v, keep):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(keep[:, None, None, :], s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

L = int(sys.argv[1])
q = jnp.ones((2, L, 4, 64), jnp.float32)
padded(q, q, q, jnp.ones((2, L), bool))
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(PADDED))
    return str(path)


def run(*args: str):
    return CliRunner(env={"COLUMNS": "200"}).invoke(cli, list(args))


def test_short_sequences_in_the_chunked_kernel_grow_memory_on_cpu(model):
    result = run("rewrite", model, "--kernel", "chunked", "--json", "--fail-on-memory-growth",
                 "--", "128")
    assert result.exit_code == EXIT_FINDINGS, result.output
    (row,) = json.loads(result.stdout)["memory"]
    assert (row["function"], row["target"], row["grows"]) == ("padded", "cpu", True)
    assert row["rewritten"]["temporaries"] > row["native"]["temporaries"]
    assert row["change_bytes"] == row["rewritten"]["needs"] - row["native"]["needs"] > 0
    # Same signature: the arguments and outputs are the same bytes on both sides.
    assert row["native"]["arguments"] == row["rewritten"]["arguments"]
    lines = result.stderr.strip().splitlines()
    assert lines[-2].startswith("hlotool: memory grows: padded on cpu: rewritten needs ")
    assert lines[-1] == ("hlotool: 1 rewritten program needs more memory than native "
                         "(--fail-on-memory-growth)")


def test_a_dense_bias_in_the_pallas_tpu_kernel_grows_memory_on_tpu_only(model):
    result = run("rewrite", model, "--kernel", "pallas_tpu", "--target", "cpu", "--target",
                 "tpu-v5e", "--json", "--fail-on-memory-growth", "--", "128")
    assert result.exit_code == EXIT_FINDINGS, result.output
    rows = {r["target"]: r for r in json.loads(result.stdout)["memory"]}
    assert rows["tpu-v5e"]["grows"] and not rows["cpu"]["grows"]  # CPU keeps its program
    assert "memory grows: padded on tpu-v5e" in result.stderr
    assert "on cpu" not in result.stderr


def test_a_long_sequence_in_the_chunked_kernel_shrinks_memory_and_passes_the_gate(model):
    result = run("rewrite", model, "--fail-on-memory-growth", "--", "1024")
    assert result.exit_code == 0, result.output
    table = result.stdout
    assert "Memory, native → rewritten (XLA memory_analysis; cpu)" in table
    (row,) = [ln for ln in table.splitlines() if ln.startswith("padded ")]
    assert row.split()[-3].startswith("−") and "(×0." in row  # less memory, ratio below one


def test_diff_shows_memory_and_gates_on_growth(model):
    result = run("diff", model, "--kernel", "chunked", "--json", "--fail-on-memory-growth",
                 "--", "128")
    assert result.exit_code == EXIT_FINDINGS, result.output
    doc = json.loads(result.stdout)
    assert [m["function"] for m in doc["memory"]] == ["padded"] and doc["memory"][0]["grows"]
    assert doc["functions"][0]["function"] == "padded"

    result = run("diff", model, "--kernel", "chunked", "--", "128")  # no gate: exit 0
    assert result.exit_code == 0, result.output
    assert "Memory, native → rewritten (XLA memory_analysis, cpu)" in result.stdout


def test_needs_is_the_larger_of_total_and_xlas_peak():
    cpu_like = Memory(arguments=6, outputs=2, aliased=0, temporaries=128, peak=8)
    tpu_like = Memory(arguments=6, outputs=2, aliased=0, temporaries=0, peak=80)
    assert (cpu_like.total, cpu_like.needs) == (136, 136)
    assert (tpu_like.total, tpu_like.needs) == (8, 80)
    donated = Memory(arguments=6, outputs=6, aliased=6, temporaries=1)
    assert donated.needs == 7  # an aliased output is no second buffer


def test_a_side_that_does_not_fit_is_a_note_not_a_growth():
    oom = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
           "memory required for HLO temporaries (8.00T) exceeds available HBM (15.75G).")

    def refuses(target):
        raise HlotoolError(f"cannot compile f for {target}: {oom}")

    stats = types.SimpleNamespace(argument_size_in_bytes=1, output_size_in_bytes=1,
                                  alias_size_in_bytes=0, temp_size_in_bytes=1)
    native = types.SimpleNamespace(name="f", compiled=refuses)
    rewritten = types.SimpleNamespace(
        name="f", compiled=lambda t: types.SimpleNamespace(memory_analysis=lambda: stats))
    row = memory_row(native, rewritten, "tpu-v5e")
    assert row.native is None and row.rewritten == Memory(1, 1, 0, 1)
    assert row.note.startswith("native does not fit in tpu-v5e's")
    assert row.change is None and growth([row]) == []
    assert "native does not fit" in render_memory([row])


def test_rows_without_growth_are_not_findings():
    same = Memory(1, 1, 0, 5)
    assert growth([MemoryRow("f", "cpu", same, same)]) == []
    assert growth([MemoryRow("f", "cpu", same, Memory(1, 1, 0, 6))])[0].change == 1
