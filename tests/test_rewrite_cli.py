"""`hlotool rewrite`: per-site decisions, rewritten programs written like `dump`, errors."""

from __future__ import annotations

import json
import os
import textwrap

from click.testing import CliRunner

from hlotool import kernels
from hlotool.cli import cli
from hlotool.cost.model import analytic
from hlotool.errors import MANIFEST
from hlotool.site import AttentionSite

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
    lines = out.splitlines()
    assert lines[0] == "attention: 1 site, 1 rewritten"
    assert lines[1].startswith("  [0] ") and lines[1].endswith(
        "model.py:6 (top level) q[512, 16] k[512, 16] float32 mask=none")  # the user's line
    # float32 on CUDA: cuDNN refuses it; jax's Triton kernel takes it where jax ships it.
    gpu = "pallas_gpu" if kernels.registered("pallas_gpu").unavailable_reason is None else "chunked"
    assert [line.split(" — ")[0] for line in lines[2:5]] == [
        "      cpu: chunked", "      tpu (tpu-v5e): splash_tpu", f"      cuda (h100): {gpu}"]
    # The figures are the cpu row's model of this site ([1, 512, 1, 16] f32, scale 1/4).
    site = AttentionSite(batch=1, q_len=512, kv_len=512, num_q_heads=1, num_kv_heads=1,
                         head_dim=16, v_head_dim=16, dtype="float32", scale=0.25)
    native, kernel = (analytic(site, "cpu", side) for side in ("native", "kernel"))
    assert lines[2].endswith(
        f" — kernel pays (×{native.hbm_bytes / kernel.hbm_bytes:.1f} less HBM traffic, "
        f"roofline ×{native.seconds / kernel.seconds:.1f} faster)")
    assert lines[5] == "probs_too: 1 site, 0 rewritten"
    assert lines[7].startswith("      cpu, tpu, cuda: native — intermediate values of the "
                               "attention (f32[512,512]) are used outside it")


def test_rewrite_json_short_keys_stay_native(tmp_path):
    result = run("rewrite", write_script(tmp_path) + ":attention", "--json", "--", "64")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (function,) = doc["functions"]
    (site,) = function["sites"]
    assert (doc["version"], function["function"], site["rewritten"]) == (1, "attention", False)
    assert site["kernels"] == {"cpu": None, "tpu": None, "cuda": None}
    assert site["reason"].startswith("cpu: keep native (short sequence: Lq=64, Lk=64;")
    # CUDA prices the kernel that would run there, saying which it passed over and why.
    assert ("cuda (h100): keep native (short sequence: Lq=64, Lk=64;" in site["reason"]
            and "passed over cudnn: dtype float32 unsupported" in site["reason"])
    assert site["site"]["kv_len"] == 64


def test_rewrite_writes_programs_for_tpu(tmp_path):
    out = tmp_path / "out"
    result = run("rewrite", write_script(tmp_path) + ":attention", "--stage", "stablehlo",
                 "--target", "tpu-v5e", "-o", str(out), "--", "512")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(out)) == [MANIFEST, "001_jit_attention.flash.tpu-v5e.stablehlo.mlir"]
    text = (out / "001_jit_attention.flash.tpu-v5e.stablehlo.mlir").read_text()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1


def test_rewrite_bad_options(tmp_path):
    result = run("rewrite", write_script(tmp_path), "--stage", "hlo", "--", "512")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1] == (
        "hlotool: error: --stage and -o go together: name both to write rewritten programs")
    # An unknown kernel is refused before the script runs (it would print "ran").
    path = write_script(tmp_path)
    with open(path, "a") as f:
        f.write("print('ran')\n")
    result = run("rewrite", path, "--kernel", "flash9", "--", "512")
    assert result.exit_code == 2 and "ran" not in result.output
    from hlotool.kernels import names

    assert result.stderr.splitlines() == [
        "hlotool: error: Invalid value for '--kernel': no kernel named 'flash9'; known: auto, "
        f"{', '.join(names())} (see `hlotool rewrite --help`)"]


DEAD_ATTENTION = """\
import jax, jax.numpy as jnp

@jax.jit
def init(q, k, v):
    # flax's model.init: the model runs for its shapes, its output is thrown away.
    jax.nn.softmax(q @ k.T / 4.0, axis=-1) @ v
    return {"w": q.sum()}

x = jnp.ones((256, 16))
init(x, x, x)
"""


def test_dead_attention_is_no_site_for_either_front_end(tmp_path):
    # jit never compiles an attention whose result is unused: the jaxpr front end (rewrite)
    # and the HLO front end (inspect, diff) both say there is none.
    path = tmp_path / "model.py"
    path.write_text(DEAD_ATTENTION)
    rewritten = run("rewrite", str(path))
    assert rewritten.exit_code == 0, rewritten.output
    assert rewritten.stdout == "init: no attention site\n"
    diffed = run("diff", str(path))
    assert diffed.stdout.splitlines()[1:] == ["  init: no attention site"]
    inspected = run("inspect", str(path), "--json")
    assert json.loads(inspected.stdout)["sites"] == []


def test_rewrite_says_a_shared_reason_once_and_prices_memory_where_auto_keeps_native(tmp_path):
    script = write_script(tmp_path) + ":attention"
    result = run("rewrite", script, "--fail-on-memory-growth", "--", "64")
    assert result.exit_code == 0, result.output  # no rewrite was made: nothing grew
    lines = result.stdout.splitlines()
    # Each platform's reason once (cuda's names the kernels it passed over, cpu's none).
    (cpu,) = [line for line in lines if line.startswith("      cpu")]
    assert cpu.startswith("      cpu: keep native (short sequence: Lq=64, Lk=64;")
    assert result.stdout.count("short sequence") == 3
    # The memory table compares native with the kernel the CPU would run if it paid.
    assert "Memory, native → rewritten (XLA memory_analysis; cpu)" in result.stdout
    (row,) = [line for line in lines if line.startswith("attention ")]
    assert row.split()[1] == "cpu*"
    assert any(line.startswith("* auto keeps these functions native") for line in lines)
    doc = json.loads(run("rewrite", script, "--json", "--", "64").stdout)
    (memory,) = doc["memory"]
    assert (memory["target"], memory["kernel_if_paid"]) == ("cpu", "chunked")
