"""Every command reads one decision per site and target (`hlotool.cost.decision.choose`):
`rewrite` (flash_jit's report, which `explain`, `diff` and `profile` print), `cost` and the
cost plot name the same kernel, or native, for the same reason, on each bundled example, a
flax nnx causal LM with a causal & key-padding mask, short and long."""

import json
import pathlib

import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.hardware import get_hardware
from hlotool.report.cost_plot import series
from hlotool.site import AttentionSite

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = ("cpu", "tpu-v5e", "h100")

CASES = [
    pytest.param("examples/causal_decoder.py", ("--seq-len", "1024", "--d-model", "32",
                                                "--layers", "1", "--steps", "1"),
                 id="causal_decoder L=1024 (train step and forward)"),
    pytest.param("examples/causal_decoder.py", ("--seq-len", "64", "--d-model", "32",
                                                "--layers", "1", "--steps", "1"),
                 id="causal_decoder L=64 (short: native)"),
    pytest.param("examples/padded_encoder.py", ("--seq-len", "1024", "--layers", "1"),
                 id="padded_encoder L=1024"),
    pytest.param("examples/flax_model.py", ("--seq-len", "1024", "--layers", "1"),
                 id="flax_model L=1024"),
    pytest.param("tests/models/nnx_causal_lm.py", ("1024",), id="nnx causal & padding L=1024"),
]


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("script, script_args", CASES)
def test_rewrite_cost_and_plot_agree_per_site_and_target(script, script_args):
    path = str(ROOT / script)
    rewritten = run_json("rewrite", path, "--json", "--", *script_args)
    targets = [arg for t in TARGETS for arg in ("--target", t)]
    priced = run_json("cost", path, "--json", *targets, "--", *script_args)
    by_function: dict[str, list[dict]] = {}
    for entry in priced["sites"]:
        by_function.setdefault(entry["site"]["function"], []).append(entry)
    compared = 0
    for function in rewritten["functions"]:
        sites = function.get("sites", [])
        costed = by_function.get(function["function"], [])
        assert len(costed) == len(sites), function["function"]
        for site, entry in zip(sites, costed):
            assert entry["site"]["q_len"] == site["site"]["q_len"]
            for target in TARGETS:
                platform = get_hardware(target).platform
                choice = site["choices"][platform]
                verdict = entry["targets"][target]["verdict"]
                assert entry["targets"][target]["backward"] == site["trained"]
                said = verdict["kernel_name"] if verdict["pays"] else None
                assert (said, verdict["reason"]) == (choice["kernel"], choice["reason"]), (
                    function["function"], target)
                swept = series(AttentionSite.from_json(entry["site"]), target,
                               [entry["site"]["kv_len"]], backward=site["trained"])
                assert swept.pays == (verdict["pays"],), (function["function"], target)
                compared += 1
    assert compared >= len(TARGETS)
