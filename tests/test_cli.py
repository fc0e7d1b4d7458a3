"""The command line: `inspect` and `dump` output, files, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from hlotool import __version__
from hlotool.cli import cli
from hlotool.errors import MANIFEST

TWO_FUNCTIONS = """\
import sys
import jax, jax.numpy as jnp

@jax.jit
def attention(q, k, v):
    s = jnp.einsum("qd,kd->qk", q, k) / 4.0
    return jax.nn.softmax(s, axis=-1) @ v

@jax.jit
def train_step(w, x):
    return jax.grad(lambda w: (x @ w).sum())(w)

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
x = jnp.ones((n, 16))
attention(x, x, x)
train_step(jnp.ones((16, 4)), x)
print("done")
"""


@pytest.fixture
def script(tmp_path):
    def make(source: str = TWO_FUNCTIONS, name: str = "model.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return str(path)

    return make


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def assert_one_line_error(result, message: str) -> None:
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    [line] = result.stderr.strip().splitlines()[-1:]
    assert line.startswith("hlotool: error: ") and message in line, result.stderr
    assert result.stdout == ""


def test_inspect_lists_functions_with_args_and_stage_sizes(script):
    result = run("inspect", script(), "--", "32")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].endswith("2 functions compiled by " + script() + " (stage sizes for cpu; compile s: as the script ran)")
    assert lines[1].split() == [
        "#", "function", "args", "jaxpr", "stablehlo", "hlo", "opt", "(cpu)", "compile", "s"]
    first, second = lines[3].split(), lines[4].split()
    assert first[:5] == ["1", "attention", "f32[32,16],", "f32[32,16],", "f32[32,16]"]
    assert second[:4] == ["2", "train_step", "f32[16,4],", "f32[32,16]"]
    assert all(int(n) > 0 for n in first[5:9]) and float(first[9]) > 0
    # Columns line up: every row's "jaxpr" count ends where the header does.
    end = lines[1].index("jaxpr") + len("jaxpr")
    assert all(line[end - 1].isdigit() and line[end] == " " for line in lines[3:5])


def test_inspect_json(script):
    result = run("inspect", script(), "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == "done\n"  # the script's prints stay out of the JSON
    report = json.loads(result.stdout)
    assert report["version"] == 1 and report["target"] == "cpu"
    [attention, train_step] = report["functions"]
    assert attention["name"] == "attention"
    assert attention["args"] == [
        {"name": n, "shape": [8, 16], "dtype": "float32", "donated": False}
        for n in ("q", "k", "v")]
    assert set(attention["instructions"]) == {"jaxpr", "stablehlo", "hlo", "optimized"}
    assert train_step["source"] == f"train_step at {script()}:9"  # the decorator's line


@pytest.mark.parametrize(
    ("pattern", "names"),
    [("train_step", ["train_step"]), ("att", ["attention"]), ("*n", ["attention"]),
     ("*_*", ["train_step"])],
)
def test_inspect_name_filter(script, pattern, names):
    result = run("inspect", f"{script()}:{pattern}")
    assert result.exit_code == 0, result.output
    table = result.stdout.split("\n\n")[0].splitlines()  # the site report follows
    assert [ln.split()[1] for ln in table[3:]] == names


def test_inspect_verbose_lists_argument_names(script):
    result = run("inspect", script() + ":train", "-v")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-2:] == [
        "    f32[16,4]            w", "    f32[8,16]            x"]


def test_dump_each_stage(script, tmp_path):
    out = tmp_path / "out"
    expected = {
        "jaxpr": ("001_jit_attention.jaxpr.txt", "002_jit_train_step.jaxpr.txt", "dot_general"),
        "stablehlo": ("001_jit_attention.cpu.stablehlo.mlir",
                      "002_jit_train_step.cpu.stablehlo.mlir", "stablehlo.dot_general"),
        "hlo": ("001_jit_attention.cpu.hlo.txt", "002_jit_train_step.cpu.hlo.txt",
                '"' + script() + '"'),
        "optimized": ("001_jit_attention.cpu.optimized.hlo.txt",
                      "002_jit_train_step.cpu.optimized.hlo.txt", "HloModule jit_attention"),
    }
    for stage, (first, second, needle) in expected.items():
        result = run("dump", script(), "--stage", stage, "-o", str(out))
        assert result.exit_code == 0, result.output
        assert result.stdout.splitlines() == [str(out / first), str(out / second)]
        assert needle in (out / first).read_text()
    # Eight programs, and the list of files hlotool wrote (so a rerun may replace them).
    assert sorted(os.listdir(out))[0] == MANIFEST and len(os.listdir(out)) == 9
    assert sorted((out / MANIFEST).read_text().splitlines()) == sorted(os.listdir(out))[1:]
    hlo = (out / "001_jit_attention.cpu.hlo.txt").read_text()
    assert "metadata={op_name=" in hlo and "stack_frame_id=" in hlo
    # Source locations are the user's: hlotool's own and click's frames are left out.
    file_names = hlo.split("FileNames\n")[1].split("\n\n")[0]
    assert f'"{script()}"' in file_names
    assert "/hlotool/" not in file_names and "/click/" not in file_names


def test_dump_tpu_optimized(script, tmp_path):
    out = tmp_path / "out"
    result = run("dump", script() + ":attention", "--stage", "optimized", "--target", "tpu-v5e",
                 "-o", str(out), "--", "256")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == [MANIFEST, "001_jit_attention.tpu-v5e.optimized.hlo.txt"]
    text = (out / "001_jit_attention.tpu-v5e.optimized.hlo.txt").read_text()
    assert "is_scheduled=true" in text and "T(8,128)" in text


BAD_SCRIPTS = {
    "syntax": ("def f(:\n", "model.py:1: syntax error: invalid syntax"),
    "raises": ("import jax\nraise RuntimeError('no weights found')\n",
               "model.py:2: RuntimeError: no weights found"),
    "exits": ("import sys\nsys.exit(4)\n", "model.py exited with status 4"),
    "eager": ("import jax.numpy as jnp\njnp.ones(3).sum()\n", "model.py ran but compiled no jax"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCRIPTS))
def test_bad_scripts_give_one_line_and_debug_gives_traceback(script, case):
    source, message = BAD_SCRIPTS[case]
    path = script(source)
    assert_one_line_error(run("inspect", path), message)
    for debug in (run("--debug", "inspect", path), run("inspect", path, "--debug")):
        assert debug.exit_code != 0 and "Traceback" in debug.stderr and message in debug.stderr


def test_interrupt_is_one_line(script):
    result = run("inspect", script("raise KeyboardInterrupt\n"))
    assert result.exit_code == 130 and result.stderr == "hlotool: interrupted\n"


def test_bad_arguments(script, tmp_path):
    assert_one_line_error(run("inspect", str(tmp_path / "nope.py")), "no such file: ")
    assert_one_line_error(run("inspect", script(), "--target", "tpu-v9"),
                          "unknown target 'tpu-v9'; valid targets: cpu, tpu-v5e, tpu-v5p, tpu-v6e")
    assert_one_line_error(run("inspect", script() + ":eval"),
                          "no captured function matches 'eval'; captured: attention, train_step")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line_error(run("dump", script(), "--stage", "hlo", "-o", str(blocker / "out")),
                          f"cannot create output directory {blocker / 'out'}: Not a directory")


GUARDED = """\
import sys
import jax, jax.numpy as jnp

@jax.jit
def predict(x):
    return jnp.tanh(x)

def main():
    predict(jnp.ones(int(sys.argv[1])))
    sys.exit(0)

if __name__ == "__main__":
    main()
"""


def test_exit_zero_and_main_guard_scripts_work(script):
    result = run("inspect", script(GUARDED), "--", "4")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[3].split()[:3] == ["1", "predict", "f32[4]"]


def test_version_and_help():
    assert run("--version").stdout.startswith(f"hlotool {__version__} (jax ")
    top = run("--help").stdout
    assert "inspect" in top and "dump" in top
    dump_help = run("dump", "--help").stdout
    assert "deviceless" in dump_help and "tpu-v6e" in dump_help and "NNN_jit_NAME" in dump_help


def test_python_dash_m_keeps_libtpu_quiet(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run(
        [sys.executable, "-m", "hlotool", "inspect", script() + ":attention", "--target",
         "tpu-v5e"], capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[3].split()[:2] == ["1", "attention"]
    assert done.stderr == "done\n"  # the script's print, no libtpu warnings


def test_inspect_reports_a_program_too_big_for_hbm(script):
    from test_cost_cli import DOES_NOT_FIT, HUGE

    path = script(HUGE)
    result = run("inspect", path, "--target", "cpu", "--target", "tpu-v5e", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (site,) = doc["sites"]
    assert site["score_bytes"] == 8 * 2**40
    assert site["native"]["tpu-v5e"] == {"target": "tpu-v5e", "error": DOES_NOT_FIT,
                                         "does_not_fit": True}
    # XLA:CPU is not asked to compile a program whose scores alone outgrow this host.
    cpu = site["native"]["cpu"]
    assert cpu["does_not_fit"] and cpu["error"].startswith(
        "native does not fit in this host's ") and cpu["error"].endswith(
        "memory: one value alone is 8.0 TiB")
    table = run("inspect", path, "--target", "tpu-v5e")
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert "too big" in lines[3]  # no optimized program to count
    assert lines[-1].split(None, 2)[:2] == ["1", "tpu-v5e"] and DOES_NOT_FIT in lines[-1]
