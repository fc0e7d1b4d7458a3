"""What `inspect` shows for detected sites: the versioned JSON document and the text table."""

from __future__ import annotations

import json

import jax
import pytest
from test_detect import B, K, L, Q, V, arr, causal_iota, gqa_repeat

from hlotool.capture import capture_function
from hlotool.errors import HlotoolError
from hlotool.passes.from_hlo import detect_hlo
from hlotool.passes.from_jaxpr import detect_jaxpr
from hlotool.passes.from_hlo import detect_captured
from hlotool.report.sites import render_sites, sites_document

REQUIRED = {"function", "source", "q_shape", "k_shape", "v_shape", "dtype", "scale", "mask",
            "score_bytes"}


def model(q, k, v, kv):
    return causal_iota(q, k, v) + gqa_repeat(q, kv, kv)


def test_captured_functions_report_every_site():
    kv = arr(B, L, 2, 16)
    captured = capture_function(jax.jit(model), Q, K, V, kv)
    sites = detect_captured(captured)
    assert [(s.function, s.mask, s.num_kv_heads) for s in sites] == [
        ("model", "causal", 4), ("model", "none", 2)]

    doc = json.loads(json.dumps(sites_document(sites)))
    assert doc["version"] == 1 and len(doc["sites"]) == 2
    first = doc["sites"][0]
    assert REQUIRED <= set(first)
    assert (first["q_shape"], first["mask"], first["scale"]) == ([B, L, 4, 16], "causal", 0.25)
    assert first["score_bytes"] == B * 4 * L * L * 4
    assert first["source"] == sites[0].source and first["source"].endswith(
        sites[0].source.rsplit("/", 1)[1])


def test_table_has_one_row_per_site():
    sites = detect_hlo(jax.jit(model).lower(Q, K, V, arr(B, L, 2, 16)).as_text(
        dialect="hlo", debug_info=True), "model")
    lines = render_sites(sites).splitlines()
    assert len(lines) == 2 + 2
    assert lines[0].split() == ["#", "function", "source", "layout", "q", "k", "v", "dtype",
                                "heads", "q/kv", "scale", "mask", "scores"]
    assert "causal" in lines[2] and "4/4" in lines[2] and "2.0 KiB" in lines[2]
    assert "4/2" in lines[3] and "[2,8,2,16]" in lines[3]
    assert render_sites([]) == "no attention sites found"


def test_bad_input_is_one_line_error():
    with pytest.raises(HlotoolError, match=r"^<hlo>:1:\d+: "):
        detect_hlo("this is not HLO")
    with pytest.raises(HlotoolError, match="needs an HLO Module or its text, got int"):
        detect_hlo(42)
    with pytest.raises(HlotoolError, match="needs a ClosedJaxpr, got function"):
        detect_jaxpr(model)
