"""`hlotool rewrite`: per-site decisions, rewritten programs written like `dump`, errors."""

from __future__ import annotations

import json
import os
import textwrap

from click.testing import CliRunner

from hlotool.cli import cli

SCRIPT = """\
import sys
import jax, jax.numpy as jnp

@jax.jit
def attention(q, k, v):
    s = jnp.einsum("qd,kd->qk", q, k) / 4.0
    return jax.nn.softmax(s, axis=-1) @ v

@jax.jit
def probs_too(q, k, v):
    p = jax.nn.softmax(q @ k.T / 4.0, axis=-1)
    return p @ v, p

n = int(sys.argv[1])
x = jnp.ones((n, 16))
attention(x, x, x)
probs_too(x, x, x)
"""


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def write_script(tmp_path) -> str:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return str(path)


def test_rewrite_prints_each_site_decision(tmp_path):
    result = run("rewrite", write_script(tmp_path), "--", "512")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "attention: 1 site(s), 1 rewritten" in out
    assert "cpu: chunked, tpu: pallas_tpu, cuda: pallas_gpu" in out
    assert "probs_too: 1 site(s), 0 rewritten" in out and "used outside it" in out
    assert "model.py:6" in out  # the user's line of the first site


def test_rewrite_json_short_keys_stay_native(tmp_path):
    result = run("rewrite", write_script(tmp_path) + ":attention", "--json", "--", "64")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (function,) = doc["functions"]
    (site,) = function["sites"]
    assert (doc["version"], function["function"], site["rewritten"]) == (1, "attention", False)
    assert site["kernels"] == {"cpu": None, "tpu": None, "cuda": None}
    assert site["reason"].startswith("cpu: keep native (short sequence: Lq=64, Lk=64;")
    assert site["site"]["kv_len"] == 64


def test_rewrite_writes_programs_for_tpu(tmp_path):
    out = tmp_path / "out"
    result = run("rewrite", write_script(tmp_path) + ":attention", "--stage", "stablehlo",
                 "--target", "tpu-v5e", "-o", str(out), "--", "512")
    assert result.exit_code == 0, result.output
    assert os.listdir(out) == ["001_jit_attention.flash.tpu-v5e.stablehlo.mlir"]
    text = (out / "001_jit_attention.flash.tpu-v5e.stablehlo.mlir").read_text()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1


def test_rewrite_bad_options(tmp_path):
    result = run("rewrite", write_script(tmp_path), "--stage", "hlo", "--", "512")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "hlotool: error: --stage and -o go together: name both to write rewritten programs")
    result = run("rewrite", write_script(tmp_path), "--kernel", "flash9", "--", "512")
    assert result.exit_code != 0 and "no kernel named 'flash9'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
