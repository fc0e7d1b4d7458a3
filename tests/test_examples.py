"""The example models: their attention is correct, and `hlotool inspect` sees their functions."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from hlotool.cli import cli

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qkv(shape: tuple[int, ...]) -> list[jax.Array]:
    return list(jax.random.normal(jax.random.key(1), (3, *shape)))


def test_causal_decoder_attention_matches_jax():
    q, k, v = qkv((2, 16, 4, 8))  # [B, L, H, D]
    got = jax.jit(load("causal_decoder").causal_attention)(q, k, v)
    want = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")(
        q, k, v, is_causal=True)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_padded_encoder_attention_ignores_padding():
    q, k, v = qkv((2, 4, 16, 8))  # [B, H, L, D]
    lengths = jnp.array([16, 5])
    got = jax.jit(load("padded_encoder").padded_attention)(q, k, v, lengths)

    @jax.jit
    def reference(q, k, v):  # [1, H, L, D] with only the real keys; jax takes [B, L, H, D]
        t = lambda x: jnp.swapaxes(x, 1, 2)
        return t(jax.nn.dot_product_attention(t(q), t(k), t(v)))

    for b, n in enumerate(lengths.tolist()):
        want = reference(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        np.testing.assert_allclose(got[b : b + 1], want, atol=1e-5)


def inspect_example(name: str, *script_args: str) -> list[list[str]]:
    result = CliRunner().invoke(cli, ["inspect", str(EXAMPLES / f"{name}.py"), "-v", "--",
                                      *script_args])
    assert result.exit_code == 0, result.output
    return [line.split() for line in result.stdout.splitlines()]


@pytest.mark.parametrize(
    ("name", "script_args", "functions", "arg_lines"),
    [
        ("causal_decoder", ("--seq-len", "32", "--d-model", "32", "--layers", "1", "--steps", "1"),
         ["train_step", "forward"], [["f32[256,32]", "params['embed']"],
                                     ["i32[2,32]", "tokens"]]),
        ("padded_encoder", ("--seq-len", "48", "--batch", "3", "--dtype", "bfloat16"),
         ["encode"], [["bf16[3,48,64]", "x"], ["i32[3]", "lengths"]]),
        ("flax_model", ("--seq-len", "16", "--layers", "1"),
         ["init", "train_step", "predict"],
         [["f32[64,4,16]", "params['params']['Block_0']['MultiHeadDotProductAttention_0']"
           "['query']['kernel']"], ["i32[2,16]", "tokens"]]),
    ],
)
@pytest.mark.sweep(keep=1)
def test_inspect_lists_example_functions(name, script_args, functions, arg_lines):
    lines = inspect_example(name, *script_args)
    table = lines[3 : 3 + len(functions)]
    assert [row[1] for row in table] == functions
    assert lines[3 + len(functions)] == []  # the table ends where -v's listing starts
    for arg_line in arg_lines:
        assert arg_line in lines


def test_examples_run_as_plain_scripts():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "padded_encoder.py"), "--seq-len", "16", "--layers", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "lengths [16, 12] pooled (2, 64) float32"


@pytest.mark.parametrize("name", ["causal_decoder", "flax_model", "padded_encoder"])
@pytest.mark.slow
def test_readme_diff_command_writes_a_report_for_each_example(name, tmp_path, monkeypatch):
    # README: `hlotool diff model.py -o report.html`, word for word, at the examples' own
    # sizes, where auto keeps XLA's attention: the report shows the kernel under that verdict.
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["diff", str(EXAMPLES / f"{name}.py"), "-o",
                                      "report.html"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "report.html\n"
    page = (tmp_path / "report.html").read_text()
    assert page.count("<h3>native") >= 1 and page.count("<h3>rewritten") >= 1
    assert '<p class="verdict">' in page and "auto keeps native here (short sequence" in page
    assert "Shown: chunked, the kernel cpu would run if it paid (--kernel chunked)." in page
