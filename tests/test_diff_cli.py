"""`hlotool diff`: native vs flash_jit per captured function, as text, HTML and pieces."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.errors import MANIFEST


# At L = 512 the cost verdict picks the kernel on every platform, so the site is rewritten.
MODEL = """\
import jax, jax.numpy as jnp

@jax.jit
def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

@jax.jit
def mlp(x, w):
    return jnp.tanh(x @ w)

import sys
x = jnp.ones((1, int(sys.argv[1]) if len(sys.argv) > 1 else 512, 2, 16))
attention(x, x, x)
mlp(jnp.ones((4, 8)), jnp.ones((8, 8)))
"""

NO_SITES = """\
import jax, jax.numpy as jnp
jax.jit(lambda x, w: jnp.tanh(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 8)))
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return str(path)


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_text_summary(model):
    result = run("diff", model)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("attention (hlo, cpu): −")
    assert re.fullmatch(r"  site 1: attention q\[1×512×2×16\] float32, mask none at "
                        r".*model\.py:5: −\d+ instructions, \+\d+, "
                        r"L×L buffers \d+ → \d+", lines[1])
    assert "skipped mlp: no attention site" in result.output


def test_tpu_stage_names_the_kernel_call(model):
    result = run("diff", f"{model}:attention", "--target", "tpu-v5e")
    assert result.exit_code == 0, result.output
    assert "(1 custom-call tpu_custom_call)" in result.stdout.splitlines()[1]
    assert "L×L buffers" in result.stdout and "→ 0" in result.stdout


def test_nothing_to_diff(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(NO_SITES)
    result = run("diff", str(path))
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [f"nothing to diff in {path}:",
                                          "  <lambda>: no attention site"]


def test_site_auto_keeps_native_still_shows_the_kernel(model):
    # At L = 128 flash_jit keeps XLA's native attention on CPU: the diff shows the kernel
    # the CPU would use, under auto's verdict.
    result = run("diff", f"{model}:attention", "--", "128")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("attention (hlo, cpu): −")
    assert lines[1].startswith("  auto keeps native here (short sequence: Lq=128, Lk=128;")
    assert lines[1].endswith("Shown: chunked, the kernel cpu would run if it paid "
                             "(--kernel chunked).")
    assert lines[2].startswith("  site 1: attention q[1×128×2×16]")


def test_format_needs_a_directory(model):
    result = run("diff", model, "--format", "svg")
    assert result.exit_code == 2
    assert result.output.strip() == "hlotool: error: --format svg writes files: name a " \
                                    "directory with -o"


def test_without_graphviz_only_png_is_refused(model, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no `dot` to run
    report = tmp_path / "r.html"
    result = run("diff", f"{model}:attention", "-o", str(report))
    assert result.exit_code == 0, result.output
    assert report.read_text().count("<svg") >= 2
    png = run("diff", f"{model}:attention", "--format", "png", "-o", str(tmp_path / "png"))
    assert png.exit_code == 2
    assert png.stderr.splitlines()[-1].startswith(
        "hlotool: error: --format png needs graphviz's `dot` (apt-get install graphviz)")


def test_html_report(model, tmp_path):
    out = tmp_path / "report.html"
    result = run("diff", f"{model}:attention", "--stage", "optimized", "-o", str(out))
    assert result.exit_code == 0, result.output
    page = out.read_text()
    svgs = re.findall(r"<svg\b.*?</svg>", page, re.S)
    assert len(svgs) >= 2
    for svg in svgs:
        ET.fromstring(svg)
    assert "<script" not in page


def test_pieces(model, tmp_path):
    result = run("diff", f"{model}:attention", "--format", "dot", "--hops", "1",
                 "-o", str(tmp_path / "dots"))
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "dots").iterdir())
    # The rewritten side draws the chunked kernel as one box; its inside is a piece of its own.
    assert files == [MANIFEST, "attention.site1.kernel.dot", "attention.site1.native.dot",
                     "attention.site1.rewritten.dot"]
    rewritten = (tmp_path / "dots" / "attention.site1.rewritten.dot").read_text()
    assert rewritten.count("shape=box3d") == 1 and "label=\"chunked kernel\\n" in rewritten
