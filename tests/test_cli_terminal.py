"""What the terminal gets: output fitted to its width, colour only on a terminal (never with
NO_COLOR), a progress line for slow compiles, and exit codes a CI gate can tell apart."""

from __future__ import annotations

import collections
import io
import re
import time

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.report import console
from hlotool.report.console import Term, printable, progress
from hlotool.report.table import format_table

ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Long paths, long reasons, two functions: what overflowed 100 columns before.
MODEL = """\
import jax, jax.numpy as jnp

@jax.jit
def attention_with_a_rather_long_descriptive_name(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

x = jnp.ones((2, 64, 4, 16))
attention_with_a_rather_long_descriptive_name(x, x, x)
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "a_directory_with_a_long_name" / "model.py"
    path.parent.mkdir()
    path.write_text(MODEL)
    return str(path)


def run(*args: str, **env: str):
    return CliRunner(env={"COLUMNS": None, "NO_COLOR": None, "FORCE_COLOR": None, **env}
                     ).invoke(cli, list(args))


@pytest.mark.parametrize("command", [["rewrite"], ["diff"]])
def test_output_fits_100_columns(model, command):
    wide = run(command[0], model, *command[1:])
    narrow = run(command[0], model, *command[1:], COLUMNS="100")
    assert wide.exit_code == 0 and narrow.exit_code == 0, narrow.output
    assert max(map(len, wide.stdout.splitlines())) > 100  # piped: lines as long as they come
    assert max(map(len, narrow.stdout.splitlines())) <= 100
    # Fitting wraps lines and cells; it drops nothing (only a table's rule gets shorter).
    assert _letters(narrow.stdout) == _letters(wide.stdout)


def test_inspect_fits_100_columns(model):
    args = ["inspect", model, "--target", "cpu", "--target", "tpu-v5e"]
    wide, narrow = run(*args), run(*args, COLUMNS="100")
    assert wide.exit_code == 0 and narrow.exit_code == 0, narrow.output
    assert max(map(len, wide.stdout.splitlines())) > 100
    assert max(map(len, narrow.stdout.splitlines())) <= 100
    # The sites table leaves out its layout column first and says so; shapes, dtype and
    # score bytes stay whole.
    assert "(left out to fit 100 columns: layout" in narrow.stdout
    assert "[2,64,4,16]" in narrow.stdout and "float32" in narrow.stdout
    assert "128.0 KiB" in narrow.stdout
    assert "What XLA does natively (cpu, tpu-v5e):" in narrow.stdout


def test_cost_leaves_out_columns_it_cannot_fit_and_says_so(model):
    args = ["cost", model, "--target", "cpu", "--target", "tpu-v5e", "--target", "h100"]
    wide, narrow = run(*args), run(*args, COLUMNS="100")
    assert wide.exit_code == 0 and narrow.exit_code == 0, narrow.output
    assert "XLA flops native / kernel" in wide.stdout.splitlines()[1]
    assert max(map(len, narrow.stdout.splitlines())) <= 100
    assert narrow.stdout.splitlines()[-1] == (
        "(left out to fit 100 columns: XLA flops native / kernel; --json has every field)")
    # Every verdict is there in full, wrapped in its column.
    verdict = " ".join(line[line.index("keep native"):] for line in wide.stdout.splitlines()
                       if "keep native" in line)
    lines = narrow.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("site "))
    column = lines[header].index("verdict")
    wrapped = " ".join(line[column:] for line in lines[header + 2:-1])
    assert wrapped.split() == verdict.split()


def _letters(text: str) -> collections.Counter:
    # Digits aside: compile times differ from run to run.
    return collections.Counter(c for c in text if not c.isspace() and c != "─"
                               and not c.isdigit())


def test_colour_on_a_terminal_only(model):
    plain = run("cost", model, "--no-xla", COLUMNS="90")
    assert not ANSI.search(plain.stdout)
    coloured = run("cost", model, "--no-xla", FORCE_COLOR="1", COLUMNS="90")
    assert "\x1b[1msite" in coloured.stdout  # bold table header
    assert ANSI.sub("", coloured.stdout) == plain.stdout
    assert not ANSI.search(run("cost", model, "--no-xla", FORCE_COLOR="1", NO_COLOR="1").stdout)
    failed = run("inspect", model + ":nothing", FORCE_COLOR="1")
    assert failed.stderr.startswith("\x1b[1;31mhlotool:\x1b[0m error: no captured function")


def test_table_wraps_prose_columns_and_keeps_numbers_whole():
    rows = [["1", "12345", "a reason that is much too long to fit in the narrow column"]]
    text = format_table(["#", "bytes", "verdict"], rows, right_aligned={0, 1}, wrap={2},
                        term=Term(width=30))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 30 and len(lines) > 3
    assert "12345" in lines[2] and all("1234" not in line for line in lines[3:])


def test_printable_escapes_control_characters():
    assert printable("f\x1b[2J\n\tx") == "f\\x1b[2J\\n\\tx"
    assert printable("attention ×2 → ok") == "attention ×2 → ok"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_only_for_slow_steps_on_a_terminal(monkeypatch):
    monkeypatch.setattr(console, "PROGRESS_AFTER_S", 0.2)
    quick, slow, piped = _Tty(), _Tty(), io.StringIO()
    with progress("compiling fast for cpu", quick):
        pass
    with progress("compiling train_step for tpu-v5e", slow):
        time.sleep(0.8)
    with progress("compiling train_step for tpu-v5e", piped):
        time.sleep(0.4)
    assert quick.getvalue() == "" and piped.getvalue() == ""
    assert "compiling train_step for tpu-v5e" in slow.getvalue()
    assert re.search(r"\(\d+ s\)", slow.getvalue())


# ----------------------------------------------------------------------------- exit codes


def test_exit_codes_tell_findings_bad_input_and_bugs_apart(model, monkeypatch):
    assert run("inspect", model).exit_code == 0
    found = run("inspect", model, "--fail-on-sites")
    assert found.exit_code == 1
    assert found.stderr.splitlines()[-1] == "hlotool: 1 attention site found (--fail-on-sites)"
    assert run("inspect", model, "--target", "tpu-v9").exit_code == 2
    assert run("inspect", model + ":nothing").exit_code == 2

    import hlotool.passes.from_hlo as from_hlo

    def broken(module, function=""):
        raise RuntimeError("detector bug")

    monkeypatch.setattr(from_hlo, "detect_hlo", broken)
    bug = run("inspect", model, "--fail-on-sites")
    assert bug.exit_code == 3
    assert bug.stderr.splitlines()[-1] == (
        "hlotool: internal error: RuntimeError: detector bug (rerun with --debug for the "
        "traceback)")


def test_interrupt_exits_130(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("raise KeyboardInterrupt\n")
    result = run("inspect", str(path))
    assert result.exit_code == 130 and result.stderr == "hlotool: interrupted\n"


def test_exit_codes_are_documented():
    text = " ".join(run("--help").stdout.split())
    for line in ("0 success", "1 findings: `inspect --fail-on-sites` found naive attention",
                 "2 bad input", "3 internal error", "130 interrupted"):
        assert line in text


def test_script_options_without_dashes_get_a_hint(model):
    result = run("inspect", model, "--seq-len", "128")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "hlotool: error: No such option '--seq-len'; options for the script go after `--`: "
        "hlotool inspect SCRIPT -- --seq-len … (see `hlotool inspect --help`)"]
    assert result.stdout == ""
