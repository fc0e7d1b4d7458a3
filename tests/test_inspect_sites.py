"""`hlotool inspect` as the attention report: sites per example, JSON, --fail-on-sites, and
what XLA does natively per target (`passes/native.py`)."""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from click.testing import CliRunner

from hlotool.capture import capture_function
from hlotool.cli import cli
from hlotool.errors import HlotoolError
from hlotool.hlo import parse_module
from hlotool.passes.native import map_sites, native_fate

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"
# XLA:CPU from jaxlib 0.10 on runs a naive attention site in YNNPACK `__ynn_fusion`s that
# keep two [B, H, L, L] buffers (QKᵀ's output, the probabilities); before, it writes four.
YNN = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) >= (0, 10)
SCORE_BUFFERS = 2 if YNN else 4
REQUIRED = {"function", "source", "q_shape", "k_shape", "v_shape", "dtype", "scale", "mask",
            "score_bytes", "native"}


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def attention(spec_scores: str, spec_out: str):
    def attend(q, k, v):  # softmax(q·kᵀ/√d)·v in the layout the specs name
        s = jnp.einsum(spec_scores, q, k) / math.sqrt(q.shape[-1])
        return jnp.einsum(spec_out, jax.nn.softmax(s, axis=-1), v)

    return attend


BLHD = attention("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd")
BHLD = attention("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd")


def causal_blhd(q, k, v):
    """BLHD, causal. Unmasked, a small site is fused whole (scores and all) into one YNNPACK
    fusion by XLA:CPU at some shapes (jaxlib 0.12.1: [2, 64, 4, 16]), leaving no score buffer
    to see; masked, its scores stay buffers on every jaxlib."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    length = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


# (example, script args, per site: function, source line, canonical (B, Lq, Hq, D), mask,
#  mask shape, scale, score bytes)
EXAMPLE_SITES = [
    ("causal_decoder", ("--seq-len", "32", "--d-model", "32", "--layers", "1", "--steps", "1"),
     [("train_step", 56, (2, 32, 4, 8), "causal", None, 8 ** -0.5, 2 * 4 * 32 * 32 * 4),
      ("forward", 56, (2, 32, 4, 8), "causal", None, 8 ** -0.5, 2 * 4 * 32 * 32 * 4)]),
    ("padded_encoder", ("--seq-len", "48", "--batch", "3", "--layers", "1"),
     [("encode", 47, (3, 48, 4, 16), "boolean", [3, 1, 1, 48], 0.25, 3 * 4 * 48 * 48 * 4)]),
    ("flax_model", ("--seq-len", "16", "--layers", "1"),
     [("train_step", 36, (2, 16, 4, 16), "causal", None, 0.25, 2 * 4 * 16 * 16 * 4),
      ("predict", 36, (2, 16, 4, 16), "causal", None, 0.25, 2 * 4 * 16 * 16 * 4)]),
]


@pytest.mark.parametrize(("name", "script_args", "expected"), EXAMPLE_SITES,
                         ids=[e[0] for e in EXAMPLE_SITES])
@pytest.mark.sweep(keep=1)
def test_example_sites_json_and_fail_on_sites(name, script_args, expected):
    script = str(EXAMPLES / f"{name}.py")
    result = run("inspect", script, "--json", "--fail-on-sites", "--", *script_args)
    assert result.exit_code == 1, result.output
    assert result.stderr.splitlines()[-1] == (
        f"hlotool: {len(expected)} attention site{'s' * (len(expected) != 1)} found "
        "(--fail-on-sites)")
    doc = json.loads(result.stdout)  # one document, nothing else on stdout
    assert doc["version"] == 1 and doc["targets"] == ["cpu"]
    assert {f["name"] for f in doc["functions"]} >= {e[0] for e in expected}
    assert len(doc["sites"]) == len(expected)
    for site, (function, line, (b, lq, hq, d), mask, mask_shape, scale, score_bytes) in zip(
            doc["sites"], expected):
        assert REQUIRED <= set(site)
        assert site["function"] == function
        assert site["source"] == f"{script}:{line}"
        assert (site["batch"], site["q_len"], site["num_q_heads"], site["head_dim"]) == (
            b, lq, hq, d)
        for key in ("q_shape", "k_shape", "v_shape"):  # the program's layout of [B, L, H, D]
            assert sorted(site[key]) == sorted([b, lq, hq, d])
        assert (site["dtype"], site["mask"], site["mask_shape"]) == ("float32", mask, mask_shape)
        assert site["scale"] == pytest.approx(scale, rel=1e-6)
        assert site["score_bytes"] == score_bytes
        native = site["native"]["cpu"]
        assert native["target"] == "cpu" and native["placements"]
        assert native["score_buffers"] == sum(p["score_sized"] for p in native["placements"])
        assert native["score_buffers"] >= 1  # XLA:CPU writes the scores out at least once


@pytest.mark.slow
def test_table_shows_sites_and_native_fate_per_target():
    script = str(EXAMPLES / "causal_decoder.py")
    result = run("inspect", f"{script}:forward", "--target", "cpu", "--target", "tpu-v5e",
                 "--", "--seq-len", "32", "--d-model", "32", "--layers", "2", "--steps", "1")
    assert result.exit_code == 0, result.output
    sections = result.stdout.split("\n\n")
    assert [row.split()[1] for row in sections[0].splitlines()[3:]] == ["forward"]
    sites = sections[1].splitlines()
    assert sites[0] == "2 attention sites"
    assert sites[1].split()[:4] == ["#", "function", "source", "layout"]
    for row in sites[3:]:
        cells = row.split()
        assert cells[1:4] == ["forward", f"{script}:56", "BLHD"] and "causal" in cells
    native = sections[2].splitlines()
    assert native[0] == "What XLA does natively (cpu, tpu-v5e):"
    rows = [r.split() for r in native[3:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("1", "cpu"), ("1", "tpu-v5e"), ("2", "cpu"), ("2", "tpu-v5e")]
    assert all(("__ynn_fusion" in " ".join(r)) == YNN for r in rows if r[1] == "cpu")


def test_no_sites_exits_zero(tmp_path):
    script = tmp_path / "mlp.py"
    script.write_text("import jax, jax.numpy as jnp\n"
                      "jax.jit(lambda w, x: jnp.tanh(x @ w))(jnp.ones((8, 8)), jnp.ones((4, 8)))\n")
    result = run("inspect", str(script), "--fail-on-sites")
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith("0 attention sites")
    assert "natively" not in result.stdout
    doc = json.loads(run("inspect", str(script), "--json", "--fail-on-sites").stdout)
    assert doc["sites"] == [] and len(doc["functions"]) == 1


def test_native_fate_on_cpu_names_fusions_and_score_buffers():
    x = jnp.zeros((2, 64, 4, 16), jnp.float32)  # [B, L, H, D]
    [f] = capture_function(jax.jit(causal_blhd), x, x, x)
    [fate] = native_fate(f, "cpu")
    assert (fate.site.q_len, fate.site.num_q_heads, fate.target) == (64, 4, "cpu")
    whats = [p.what for p in fate.placements]
    assert ("fusion kCustom __ynn_fusion" in whats) == YNN and not fate.online_softmax
    # At least the QKᵀ contraction's output and the normalized probabilities stay [B, H, L, L]
    # (two with YNNPACK's fusions from jaxlib 0.12.1, four before).
    scores = [p.shape for p in fate.placements if p.score_sized]
    assert set(scores) == {"f32[2,4,64,64]"} and len(scores) >= 2
    assert fate.score_buffers == len(scores)


def test_native_fate_on_tpu_shows_xla_online_softmax_by_layout():
    x = jnp.zeros((1, 2, 1024, 128), jnp.bfloat16)  # [B, H, L, D]
    [f] = capture_function(jax.jit(BHLD), x, x, x)
    [fate] = native_fate(f, "tpu-v5e")
    assert fate.online_softmax
    assert "custom-call tpu_custom_call online-softmax" in [p.what for p in fate.placements]
    # XLA's kernel starts from the QKᵀ output: one [B·H, L, L] score buffer remains, kept
    # on chip (memory space 1, VMEM), not in HBM.
    assert [(p.shape, p.memory_space) for p in fate.placements if p.score_sized] == [
        ("bf16[2,1024,1024]", 1)]
    assert fate.score_buffers_on_chip == 1
    # The same attention in [B, L, H, D] stays ordinary fusions on v5e.
    y = jnp.zeros((1, 1024, 2, 128), jnp.bfloat16)
    [g] = capture_function(jax.jit(BLHD), y, y, y)
    [fate] = native_fate(g, "tpu-v5e")
    assert not fate.online_softmax and fate.score_buffers == 1
    assert fate.to_json()["score_buffers_on_chip"] == 0  # its scores go through HBM


def two_layers(q, k, v):
    for _ in range(2):
        q = jnp.tanh(causal_blhd(q, k, v))  # both sites share every op_name and source line
    return q


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "train"])
def test_layers_from_one_line_get_separate_regions(grad):
    fn = jax.grad(lambda q, k, v: two_layers(q, k, v).sum()) if grad else two_layers
    x = jnp.zeros((2, 32, 2, 8), jnp.float32)
    [f] = capture_function(jax.jit(fn), x, x, x)
    first, second = native_fate(f, "cpu")
    names = [{p.name for p in fate.placements} for fate in (first, second)]
    assert names[0] and names[1] and not names[0] & names[1]
    assert first.score_buffers >= 1 and second.score_buffers >= 1
    if not grad:  # every score matrix the forward program computes from q, k, v is one
        entry = parse_module(f.optimized("cpu")).entry  # site's (not the scale broadcast)
        constants = {i.name for i in entry if i.opcode == "constant"}
        scores = {i.name for i in entry if i.opcode not in ("bitcast", "parameter")
                  and i.shape.dims == (2, 2, 32, 32) and not set(i.operands) <= constants}
        owned = {p.name for fate in (first, second) for p in fate.placements if p.score_sized}
        assert scores == owned


def test_a_train_steps_sites_take_their_derivative_where_asked():
    """backward=True places the work jax's AD wrote for a site (its ops named under
    `transpose(...)` in the site's scope, at its stack) with the site, the derivative of a
    projection beside it stays out; without it the fate is the forward's, as inspect shows."""
    w = jnp.ones((16, 16), jnp.float32)

    def loss(x, w):
        with jax.named_scope("attn"):
            out = causal_blhd(x, x, x)
        return jnp.tanh(out @ w).sum()  # the projection: its derivative is not the site's

    x = jnp.ones((2, 64, 4, 16), jnp.float32)
    [f] = capture_function(jax.jit(jax.grad(loss, argnums=(0, 1))), x, w)
    [forward] = native_fate(f, "cpu")
    [trained] = native_fate(f, "cpu", backward=True)
    entry = parse_module(f.optimized("cpu"))
    names = {i.name: i.metadata.get("op_name", "") for i in entry.instructions()}
    placed = {p.name for p in trained.placements}
    added = placed - {p.name for p in forward.placements}
    # Both directions of the dots and the softmax's derivative: "jit(loss)/transpose(jvp(attn))
    # /bqhd,bkhd->bhqk/dot_general", ".../reduce_sum", ... (and, before jaxlib 0.10, a
    # reduce-window without metadata between them).
    assert len(added) >= 4 and all("/transpose(jvp(attn))/" in names[n]
                                   for n in added if names[n]), added
    assert {names[n].rpartition("/")[2] for n in added} >= {"dot_general", "reduce_sum"}
    assert not any("/transpose(jvp())/" in names[n] for n in placed)  # the projection's
    assert trained.score_buffers > forward.score_buffers  # dP and dS are [B, H, L, L] too


@pytest.mark.slow
def test_layers_sharing_a_constant_still_get_one_region_each():
    # At L=512 XLA:CPU's CSE gives both causal layers one constant broadcast (the softmax's
    # initial denominator): it must not join the two layers into one piece for site 1.
    script = str(EXAMPLES / "causal_decoder.py") + ":forward"
    result = run("inspect", script, "--json", "--", "--seq-len", "512", "--d-model", "32",
                 "--steps", "1")
    assert result.exit_code == 0, result.output
    fates = [s["native"]["cpu"] for s in json.loads(result.stdout)["sites"]]
    assert [f["score_buffers"] for f in fates] == [SCORE_BUFFERS] * 2
    names = [{p["name"] for p in f["placements"]} for f in fates]
    assert not names[0] & names[1]


def test_a_constant_no_layer_reads_is_not_dealt_out_as_a_layer():
    # The padded encoder at L = 1024: XLA:CPU leaves a scale constant and the mean pooling's
    # divide carrying the sites' metadata but read by neither layer's work. As pieces of
    # their own they were dealt out like layers: site 1 got them, site 2 both layers.
    script = str(EXAMPLES / "padded_encoder.py")
    result = run("inspect", script, "--json", "--", "--seq-len", "1024")
    assert result.exit_code == 0, result.output
    fates = [s["native"]["cpu"] for s in json.loads(result.stdout)["sites"]]
    first, second = (f["score_buffers"] for f in fates)
    assert first == second >= 1
    names = [{p["name"] for p in f["placements"]} for f in fates]
    assert not names[0] & names[1]


def test_bad_input_is_one_line_error():
    with pytest.raises(HlotoolError, match="pre-optimization HLO needs an HLO Module or "
                                           "its text, got int"):
        map_sites(42, "", "cpu")
    with pytest.raises(HlotoolError, match=r"^<optimized HLO>:1:\d+: "):
        map_sites(jax.jit(BLHD).lower(*[jnp.zeros((1, 8, 1, 4))] * 3).as_text(
            dialect="hlo", debug_info=True), "not HLO", "cpu")
    result = run("inspect", str(EXAMPLES / "causal_decoder.py"), "--target", "tpu-v9")
    assert result.exit_code == 2 and "unknown target 'tpu-v9'" in result.stderr
