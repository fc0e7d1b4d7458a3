"""`hlotool diff --format model-explorer`: native and rewritten graphs as Model Explorer graph
JSON with change, FLOPs and bytes overlays. The files are read back through the package's own
builders (`model_explorer.graph_builder`, `node_data_builder`; strict: a key they do not have
fails) where `ai-edge-model-explorer` is installed — it is no test dependency (its adapter
wheel is ~480 MB): `pip install "hlotool[explorer]"`."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.errors import EXIT_BAD_INPUT, MANIFEST

MODEL = """\
import math, jax, jax.numpy as jnp

@jax.jit
def attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

q = jnp.ones((1, 1024, 2, 64), jnp.float32)
attend(q, q, q)
"""
FILES = ["native.json", "native.change.json", "native.flops.json", "native.bytes.json",
         "rewritten.json", "rewritten.change.json", "rewritten.flops.json",
         "rewritten.bytes.json"]
GRAPH = {"native": "native: attend (hlo, cpu)", "rewritten": "rewritten: attend (hlo, cpu)"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("me")
    (tmp / "model.py").write_text(textwrap.dedent(MODEL))
    out = tmp / "graphs"
    result = CliRunner().invoke(cli, ["diff", str(tmp / "model.py"), "--format",
                                      "model-explorer", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out, result


def load(out, name):
    with open(out / name, encoding="utf-8") as f:
        return json.load(f)


def test_it_writes_both_graphs_and_their_overlays(written):
    out, result = written
    assert result.stdout.splitlines()[:8] == [str(out / n) for n in FILES]
    assert sorted(os.listdir(out)) == sorted([MANIFEST, *FILES])
    assert "open both: model-explorer " in result.stderr
    for side in ("native", "rewritten"):
        doc = load(out, f"{side}.json")
        assert doc["label"] == side
        (graph,) = doc["graphs"]
        assert graph["id"] == GRAPH[side]  # the viewer renames an id another model has
        ids = {n["id"] for n in graph["nodes"]}
        for node in graph["nodes"]:
            for edge in node["incomingEdges"]:
                assert edge["sourceNodeId"] in ids, (node["id"], edge)
        for overlay in ("change", "flops", "bytes"):
            data = load(out, f"{side}.{overlay}.json")[GRAPH[side]]
            assert set(data["results"]) == ids


def test_the_site_is_one_namespace_removed_on_the_left_added_on_the_right(written):
    out, _ = written
    site = "site1 model.py:5"
    for side, status, colour in (("native", "removed", "#f4b6b6"),
                                 ("rewritten", "added", "#b9e4b0")):
        (graph,) = load(out, f"{side}.json")["graphs"]
        change = load(out, f"{side}.change.json")[GRAPH[side]]["results"]
        # The site's own level; bodies nested in it are matched instruction by instruction.
        in_site = [n for n in graph["nodes"] if n["namespace"] == site]
        assert in_site
        statuses = {dict((a["key"], a["value"]) for a in n["attrs"])["change"] for n in in_site}
        assert statuses == {status}
        assert {change[n["id"]]["value"] for n in in_site} == {-1 if status == "removed" else 1}
        assert {change[n["id"]]["bgColor"] for n in in_site} == {colour}
        assert site in graph["groupNodeAttributes"]
        assert "L×L buffers" in graph["groupNodeAttributes"][site]["change"]
    # The native site's two matmuls are its FLOPs: 2·L·L·D each, per head.
    (native,) = load(out, "native.json")["graphs"]
    flops = load(out, "native.flops.json")[GRAPH["native"]]["results"]
    dots = [n["id"] for n in native["nodes"] if n["label"] == "dot"]
    assert sorted(flops[d]["value"] for d in dots) == [2 * 2 * 1024 * 1024 * 64] * 2
    # The kernel's loop body is a namespace inside the site's.
    (rewritten,) = load(out, "rewritten.json")["graphs"]
    assert any(n["namespace"].startswith(site + "/while") for n in rewritten["nodes"])


def test_the_json_is_model_explorers_own_format(written):
    dacite = pytest.importorskip("dacite", reason="ai-edge-model-explorer (and its dacite) "
                                 "not installed: pip install 'hlotool[explorer]'")
    me = pytest.importorskip("model_explorer", reason="ai-edge-model-explorer not installed: "
                             "pip install 'hlotool[explorer]'")
    from model_explorer import graph_builder, node_data_builder
    from model_explorer.utils import remove_none

    out, _ = written
    strict = dacite.Config(strict=True)
    for side in ("native", "rewritten"):
        doc = load(out, f"{side}.json")
        collection = dacite.from_dict(graph_builder.GraphCollection, doc, config=strict)
        # Written back by the package's own serializer, the document is what hlotool wrote
        # (plus the package's defaults).
        back = remove_none(dataclasses.asdict(collection))
        assert back["graphs"][0]["nodes"][0]["id"] == doc["graphs"][0]["nodes"][0]["id"]
        assert len(back["graphs"][0]["nodes"]) == len(doc["graphs"][0]["nodes"])
        for overlay in ("change", "flops", "bytes"):
            data = load(out, f"{side}.{overlay}.json")
            model = node_data_builder.ModelNodeData(graphsData={
                gid: dacite.from_dict(node_data_builder.GraphNodeData, g, config=strict)
                for gid, g in data.items()})
            assert json.loads(model.to_json_string()).keys() == data.keys()
    assert hasattr(me, "visualize_from_config")  # what --open calls


def test_open_without_model_explorer_format_is_bad_input(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "model.py"), "--open"])
    assert result.exit_code == EXIT_BAD_INPUT
    assert result.stderr.strip() == ("hlotool: error: --open starts Model Explorer: use it "
                                     "with --format model-explorer")


def test_open_without_the_package_says_how_to_install_it(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "model_explorer" else real(name, *a))
    (tmp_path / "model.py").write_text("print('never run')\n")
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "model.py"), "--format",
                                      "model-explorer", "-o", str(tmp_path / "g"), "--open"])
    assert result.exit_code == EXIT_BAD_INPUT
    assert result.stderr.strip() == ('hlotool: error: --open needs Model Explorer: pip install '
                                     '"hlotool[explorer]" (or ai-edge-model-explorer)')
    assert "never run" not in result.output  # refused before the script ran


def test_open_serves_both_graphs_on_localhost(tmp_path, monkeypatch, written):
    pytest.importorskip("model_explorer", reason="ai-edge-model-explorer not installed")
    import model_explorer

    seen = {}

    def fake_visualize(config, host, port):
        seen.update(host=host, port=port, models=[m["url"] for m in config.model_sources],
                    data=list(config.node_data_sources),
                    targets=list(config.node_data_target_models))
        raise KeyboardInterrupt  # the user's Ctrl-C

    monkeypatch.setattr(model_explorer, "visualize_from_config", fake_visualize)
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL))
    out = tmp_path / "g"
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "model.py"), "--format",
                                      "model-explorer", "-o", str(out), "--open", "--port",
                                      "8123"])
    assert result.exit_code == 0, result.output
    assert (seen["host"], seen["port"]) == ("localhost", 8123)
    assert seen["models"] == [str(out / "native.json"), str(out / "rewritten.json")]
    assert len(seen["data"]) == 6
    # Each side's overlays go to that side's collection (the viewer matches its label).
    assert seen["targets"] == ["native"] * 3 + ["rewritten"] * 3
    assert all(os.path.basename(d).startswith(t + ".") for d, t in zip(seen["data"],
                                                                        seen["targets"]))
    assert result.stderr.strip().splitlines()[-1] == "Model Explorer stopped"
