"""What the commands write: never a file hlotool did not write (unless --force), paths fixed
before the script runs, unique piece names, escaped names, libtpu's logs cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.errors import MANIFEST, MARK

MODEL = """\
import jax, jax.numpy as jnp

@jax.jit
def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

x = jnp.ones((1, 512, 2, 16))
attention(x, x, x)
print("ran")
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_plot_never_replaces_the_users_script(model, tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("print('my work')\n")
    result = run("cost", str(model), "--no-xla", "--plot", str(mine))
    assert result.exit_code == 2
    assert result.stderr == (f"hlotool: error: {mine} exists and hlotool did not write it; "
                             "pass --force to overwrite it\n")  # and the script never ran
    assert mine.read_text() == "print('my work')\n"
    forced = run("cost", str(model), "--no-xla", "--plot", str(mine), "--force")
    assert forced.exit_code == 0, forced.output
    assert mine.read_text().startswith("<svg") and MARK in mine.read_text()


def test_report_replaces_its_own_file_but_not_the_script(model, tmp_path):
    report = tmp_path / "report.html"
    assert run("diff", str(model), "-o", str(report)).exit_code == 0
    first = report.stat().st_mtime_ns
    again = run("diff", str(model), "-o", str(report))
    assert again.exit_code == 0, again.output  # hlotool's own report: replaced
    assert report.stat().st_mtime_ns >= first and report.read_text().count(MARK) == 1
    result = run("diff", str(model), "-o", str(model))
    assert result.exit_code == 2 and "exists and hlotool did not write it" in result.stderr
    assert model.read_text() == MODEL


def test_pieces_keep_a_users_file_in_the_directory(model, tmp_path):
    out = tmp_path / "pieces"
    out.mkdir()
    (out / "attention.hlo.cpu.diff.txt").write_text("notes")  # the user's, same name
    result = run("diff", str(model), "--format", "txt", "-o", str(out))
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (
        f"hlotool: error: {out / 'attention.hlo.cpu.diff.txt'} exists and hlotool did not "
        "write it; pass --force to overwrite it")
    assert (out / "attention.hlo.cpu.diff.txt").read_text() == "notes"
    assert run("diff", str(model), "--format", "txt", "-o", str(out), "--force").exit_code == 0
    assert (out / MANIFEST).read_text() == "attention.hlo.cpu.diff.txt\n"
    # Now it is hlotool's: a rerun replaces it without --force.
    assert run("diff", str(model), "--format", "txt", "-o", str(out)).exit_code == 0


SAME_NAME = """\
import jax, jax.numpy as jnp

def make(scale):
    def step(q, k, v):
        return jax.nn.softmax(q @ k.T * scale, axis=-1) @ v
    return jax.jit(step)

x = jnp.ones((512, 16))
make(0.25)(x, x, x)
make(0.5)(x[:256], x[:256], x[:256])
"""


def test_two_functions_with_one_name_get_two_files(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SAME_NAME)
    result = run("diff", str(path), "--format", "txt", "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(tmp_path / "out" / "step.hlo.cpu.diff.txt"),
                                          str(tmp_path / "out" / "step-2.hlo.cpu.diff.txt")]
    assert "q[256×16]" in (tmp_path / "out" / "step-2.hlo.cpu.diff.txt").read_text()


CHDIR = """\
import os, jax, jax.numpy as jnp
os.makedirs("elsewhere", exist_ok=True)
os.chdir("elsewhere")
jax.jit(lambda q, k, v: jax.nn.softmax(q @ k.T, axis=-1) @ v)(*[jnp.ones((512, 16))] * 3)
"""


def test_output_paths_are_resolved_before_the_script_runs(tmp_path, monkeypatch):
    (tmp_path / "model.py").write_text(CHDIR)
    monkeypatch.chdir(tmp_path)
    result = run("diff", "model.py", "-o", "report.html")
    assert result.exit_code == 0, result.output
    assert result.stdout == "report.html\n"
    assert (tmp_path / "report.html").is_file()
    assert not (tmp_path / "elsewhere" / "report.html").exists()
    os.chdir(tmp_path)  # the script's chdir outlives it in this process
    dumped = run("dump", "model.py", "--stage", "jaxpr", "-o", "out")
    assert dumped.exit_code == 0, dumped.output
    assert sorted(os.listdir(tmp_path / "out")) == [MANIFEST, "001_jit_lambda.jaxpr.txt"]


ESCAPED = """\
import jax, jax.numpy as jnp
def f(q, k, v):
    return jax.nn.softmax(q @ k.T, axis=-1) @ v
f.__name__ = f.__qualname__ = "evil\\x1b[2J\\nname"
jax.jit(f)(*[jnp.ones((8, 4))] * 3)
"""


def test_control_characters_in_names_are_escaped(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(ESCAPED)
    for args in (["inspect", str(path)], ["rewrite", str(path)], ["diff", str(path)]):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "evil\\x1b[2J\\nname" in result.stdout, args


def test_libtpu_logs_go_to_a_directory_hlotool_removes(model, tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TPU_LOG_DIR"}
    env["TMPDIR"] = str(temp)
    done = subprocess.run([sys.executable, "-m", "hlotool", "inspect", str(model), "--target",
                           "tpu-v5e"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "online-softmax" in done.stdout or "fusion" in done.stdout
    assert os.listdir(temp) == []  # no tpu_logs/, and hlotool's own log directory is gone
