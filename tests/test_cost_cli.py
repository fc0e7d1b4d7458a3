"""`hlotool cost`: table, JSON document, SVG plot, one-line errors; XLA's numbers and caveats."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from hlotool.cost import xla
from hlotool.cli import cli
from hlotool.kernels import get
from hlotool.site import AttentionSite

MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    @jax.jit
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jnp.ones((1, 1024, 2, 64))
    attention(x, x, x)
    """)
SITE = AttentionSite(batch=1, q_len=256, kv_len=256, num_q_heads=2, num_kv_heads=2,
                     head_dim=64, v_head_dim=64, dtype="float32", scale=0.125)




@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return str(path)


def test_json_document(model):
    result = CliRunner().invoke(cli, ["cost", model, "--target", "cpu", "--target", "h100",
                                        "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["version"] == 1 and set(doc["hardware"]) == {"cpu", "h100"}
    (entry,) = doc["sites"]
    assert entry["site"]["q_len"] == 1024 and entry["site"]["num_q_heads"] == 2
    cpu, h100 = entry["targets"]["cpu"], entry["targets"]["h100"]
    assert cpu["verdict"]["pays"] and cpu["verdict"]["kernel_name"] == "chunked"
    assert cpu["verdict"]["native"]["flops"] == 4 * 2 * 1024 * 1024 * 64 + 5 * 2 * 1024 * 1024
    assert cpu["xla"]["native"]["flops"] > 0
    assert any("while loop" in c for c in cpu["xla"]["kernel"]["caveats"])
    assert "analytic only" in h100["xla"]["error"]


def test_table_and_plot(model, tmp_path):
    svg = tmp_path / "cost.svg"
    result = CliRunner().invoke(cli, ["cost", model, "--no-xla", "--target", "cpu",
                                        "--target", "h200", "--plot", str(svg)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("1 attention site in") and \
        "priced for inference (forward pass only)" in lines[0]
    # Two targets, two reasons (their figures differ): each row refers to its own note.
    assert [line.split()[-3:] for line in lines if "kernel pays [" in line] == [
        ["kernel", "pays", "[1]"], ["kernel", "pays", "[2]"]]
    assert [line.split()[0] for line in lines if line.startswith("[")] == ["[1]", "[2]"]
    assert sum("less HBM traffic, roofline" in line for line in lines) == 2
    assert result.stderr == f"wrote {svg}\n"
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 2 * 2 * 2  # 2 panels x 2 chips x 2 sides
    texts = [t.text for t in root.iter(f"{ns}text")]
    # The legend is the verdict's: short sequences stay native, the kernel pays from 512.
    assert [t.text for t in root.iter(f"{ns}text") if t.get("class") == "crossover"] == [
        "L=512"] * 2
    assert "cpu: native (solid), kernel (dashed); the kernel pays from L=512" in texts
    assert [t.text for t in root.iter(f"{ns}text") if t.get("class") == "own-length"] == [
        "this script: L=1024"] * 2
    # Tick labels in the units the tables use.
    assert "1.0 GiB" in texts and "10 ms" in texts


def test_plot_marks_a_crossover_only_where_the_verdict_turns():
    from hlotool.report.cost_plot import Series

    lengths, ones = (128, 256, 512), (1, 1, 1)
    crossing = Series("x", lengths, ones, ones, ones, ones, (False, True, True))
    assert crossing.crossover == 256 and crossing.outcome == "the kernel pays from L=256"
    ahead = Series("x", lengths, ones, ones, ones, ones, (True, True, True))
    assert ahead.crossover is None and ahead.outcome == "the kernel pays at every L ≥ 128"
    behind = Series("x", lengths, ones, ones, ones, ones, (False, False, False))
    assert behind.crossover is None and behind.outcome == "keep native at every L ≤ 512"


TWO_SHAPES = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    @jax.jit
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jnp.ones((1, 512, 2, 64))
    attention(x, x, x)
    y = jnp.ones((1, 256, 4, 32))
    attention(y, y, y)
    attention(y[:, :128], y[:, :128], y[:, :128])
    """)


def test_plot_has_a_row_per_site_shape(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(TWO_SHAPES)
    svg = tmp_path / "cost.svg"
    result = CliRunner().invoke(cli, ["cost", str(path), "--no-xla", "--plot", str(svg)])
    assert result.exit_code == 0, result.output
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(f"{ns}text") if t.get("font-weight") == "bold"]
    # Three sites, two shapes once the length is swept: H=4, D=32 holds two sites.
    assert titles == ["attention (1 site): B=1 H=2 D=64 float32 mask none; Lq = Lk swept",
                      "attention (2 sites): B=1 H=4 D=32 float32 mask none; Lq = Lk swept"]
    own = [t.text for t in root.iter(f"{ns}text") if t.get("class") == "own-length"]
    assert own == ["this script: L=512"] * 2 + ["this script: L=128", "this script: L=256"] * 2
    help_text = CliRunner().invoke(cli, ["cost", "--help"]).stdout
    assert "for each distinct site shape" in " ".join(help_text.split())


def test_unknown_target_is_one_line(model):
    result = CliRunner().invoke(cli, ["cost", model, "--target", "tpu-v9"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "hlotool: error: unknown target 'tpu-v9'; valid targets: "
        "cpu, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, a100, h100, h200"]


def test_pallas_cost_estimate_from_tpu_custom_call():
    site = AttentionSite(batch=1, q_len=512, kv_len=512, num_q_heads=2, num_kv_heads=2,
                         head_dim=128, v_head_dim=128, dtype="bfloat16", scale=None)
    figs = xla.site_figures(site, "tpu-v5e", get("pallas_tpu"))
    (estimate,) = figs["kernel"].kernel_estimates
    assert estimate["flops"] >= 4 * 2 * 512 * 512 * 128
    assert estimate["bytes_accessed"] == 4 * 2 * 512 * 2 * 128  # Q, K, V, O once each
    assert figs["kernel"].custom_calls["tpu_custom_call"] == 1
    assert any("cost_estimate" in c for c in figs["kernel"].caveats)


def test_xla_numbers_for_naive_probe_on_cpu():
    figs = xla.figures(xla.compile_for(*xla.naive_program(SITE), "cpu"), "cpu")
    assert figs.flops >= 4 * 2 * 256 * 256 * 64
    assert figs.argument_bytes == 3 * 256 * 2 * 64 * 4


BHLD_MODEL = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    @jax.jit
    def attention(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * 0.088
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)

    x = jnp.ones((1, 8, 1024, 128), jnp.bfloat16)
    attention(x, x, x)
    """)


@pytest.mark.parametrize("text, fused", [(BHLD_MODEL, True), (MODEL, False)])
@pytest.mark.slow
def test_tpu_fusion_is_read_from_the_scripts_own_program(tmp_path, text, fused):
    path = tmp_path / "model.py"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["cost", str(path), "--target", "tpu-v5e",
                                      "--target", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["sites"]
    tpu, cpu = entry["targets"]["tpu-v5e"], entry["targets"]["cpu"]
    # The verdict prices the single-site probe every command asks; the script's own
    # program, compiled for the target, says the same here.
    assert tpu["native_fused_from"] == "a single-site probe"
    assert tpu["verdict"]["native_fused"] is fused and tpu["native_fused_in_program"] is fused
    assert ("XLA:TPU's own online-softmax fusion" in tpu["verdict"]["reason"]) is fused
    # XLA:CPU never fuses attention: known without compiling anything.
    assert cpu["verdict"]["native_fused"] is False
    assert cpu["native_fused_from"] == "XLA:CPU has no attention fusion"


# 8 TiB of f32 scores: the shapes flash attention exists for; XLA:TPU refuses to compile the
# naive program into a v5e's 16 GiB HBM.
HUGE = textwrap.dedent("""\
    import jax, jax.numpy as jnp

    @jax.jit
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jax.ShapeDtypeStruct((1, 524288, 8, 64), jnp.float32)
    attention.lower(x, x, x)
    """)
DOES_NOT_FIT = ("native does not fit in tpu-v5e's 16.0 GiB HBM: needs 8.0 TiB of temporaries "
                "(XLA:TPU sees 15.8 GiB free)")


# Slow (prices every target at a long L): the README's test command leaves it to CI.
@pytest.mark.slow
def test_native_too_big_for_hbm_is_a_finding_and_other_targets_go_on(tmp_path):
    path = tmp_path / "huge.py"
    path.write_text(HUGE)
    result = CliRunner().invoke(cli, ["cost", str(path), "--target", "tpu-v5e",
                                      "--target", "h100", "--json"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["sites"]
    tpu, h100 = entry["targets"]["tpu-v5e"], entry["targets"]["h100"]
    assert tpu["does_not_fit"] == DOES_NOT_FIT and tpu["verdict"]["pays"]
    assert h100["verdict"]["pays"] and "does_not_fit" not in h100
    table = CliRunner().invoke(cli, ["cost", str(path), "--target", "tpu-v5e", "--target",
                                     "h100"])
    assert table.exit_code == 0, table.output
    assert sum(DOES_NOT_FIT in line for line in table.stdout.splitlines()) == 1
    assert any(line.lstrip().startswith("h100 ") for line in table.stdout.splitlines())


CAUSAL = MODEL.replace(
    "    return jnp.einsum(",
    "    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)\n"
    "    return jnp.einsum(")
assert CAUSAL != MODEL


@pytest.mark.slow
def test_a_band_s_skipped_score_tiles_are_counted_in_every_report(tmp_path):
    """A causal site's kernel computes only the tiles at or below the diagonal: the JSON
    counts them per head with the tile shape, the table's kernel time carries the share, and
    explain names the skipped tiles per platform. A site without a band skips none."""
    import jax.numpy as jnp

    import hlotool

    def expected(blocks, length=1024):
        bq, bk = blocks["block_q"], blocks["block_k"]
        nq, nk = -(-length // bq), -(-length // bk)
        # query block i sees key blocks up to the one holding its last query
        computed = sum(min(nk, -(-(i + 1) * bq // bk)) for i in range(nq))
        return computed, nq * nk

    docs = {}
    for name, text in (("plain", MODEL), ("causal", CAUSAL)):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        result = CliRunner().invoke(cli, ["cost", str(path), "--no-xla", "--target", "cpu",
                                            "--target", "tpu-v5e", "--json"])
        assert result.exit_code == 0, result.output
        docs[name] = json.loads(result.stdout)["sites"][0]["targets"]
        table = CliRunner().invoke(cli, ["cost", str(path), "--no-xla", "--target", "cpu"])
        assert table.exit_code == 0, table.output
        docs[name + " table"] = table.stdout
    for target in ("cpu", "tpu-v5e"):
        plain = docs["plain"][target]["verdict"]["kernel"]["score_blocks"]
        assert plain["skipped"] == 0 and plain["computed"] == plain["total"]
        causal = docs["causal"][target]["verdict"]["kernel"]["score_blocks"]
        assert (causal["computed"], causal["total"]) == expected(causal)
        assert causal["skipped"] == causal["total"] - causal["computed"] > 0
    cpu = docs["causal"]["cpu"]["verdict"]["kernel"]["score_blocks"]
    share = f"{100 * cpu['computed'] / cpu['total']:.0f}%"
    row = next(line for line in docs["causal table"].splitlines() if " cpu " in line)
    assert share in row, row
    assert "N%: the share of score tiles" in docs["causal table"]
    plain_row = next(line for line in docs["plain table"].splitlines() if " cpu " in line)
    assert "N%" not in docs["plain table"] and "%" not in plain_row, plain_row

    namespace: dict = {}
    exec(CAUSAL.replace("attention(x, x, x)", ""), namespace)
    x = jnp.ones((1, 1024, 2, 64))
    lines = str(hlotool.explain(namespace["attention"], x, x, x)).splitlines()
    cpu_line = next(line for line in lines if line.strip().startswith("cpu:"))
    assert (f"the band skips {cpu['skipped']} of {cpu['total']} score tiles "
            f"({cpu['block_q']}×{cpu['block_k']}) per head") in cpu_line
