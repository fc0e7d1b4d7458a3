"""Every command reads one decision per site and target (`hlotool.cost.decision.choose`):
`rewrite` (flash_jit's report, which `explain`, `diff` and `profile` print), `cost` and the
cost plot name the same kernel, or native, for the same reason, on each bundled example, a
flax nnx causal LM with a causal & key-padding mask, short and long; and on the attention of
the libraries the tests use (flax linen and nnx, haiku, equinox, jax.nn), the site flash_jit
decides on and the site `cost` prices get the same decision on every platform."""

import json
import pathlib

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx
from models.frontends import detect

import hlotool
from hlotool.cli import cli
from hlotool.cost.decision import choose
from hlotool.hardware import get_hardware
from hlotool.report.cost_plot import series
from hlotool.site import AttentionSite

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = ("cpu", "tpu-v5e", "h100")

# The nnx causal & padding model first: the README's suite runs it, CI all five (`sweep`).
CASES = [
    pytest.param("tests/models/nnx_causal_lm.py", ("1024",), id="nnx causal & padding L=1024"),
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
]


def run_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("script, script_args", CASES)
@pytest.mark.sweep(keep=1)
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


# ----------------------------------------------------------------------------------------
# Library models: the site flash_jit decides on (the jaxpr, with the kernel call's own
# features) and the site `cost` prices (the pre-optimization HLO) get the same decision per
# platform, at a length where the verdict is not "short sequence".

LIB_B, LIB_L, LIB_H, LIB_D = 2, 1024, 4, 16


def _x(dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(5).standard_normal((LIB_B, LIB_L, LIB_H * LIB_D)),
                       dtype)


def _linen_causal():
    model = nn.MultiHeadDotProductAttention(num_heads=LIB_H)
    x = _x()
    params = model.init(jax.random.key(0), x, mask=nn.make_causal_mask(x[..., 0]))
    return (lambda p, x: model.apply(p, x, mask=nn.make_causal_mask(x[..., 0]))), (params, x)


def _linen_bf16_fp32_softmax():
    model = nn.MultiHeadDotProductAttention(num_heads=LIB_H, dtype=jnp.bfloat16,
                                           force_fp32_for_softmax=True)
    x = _x(jnp.bfloat16)
    return model.apply, (model.init(jax.random.key(0), x), x)


def _nnx_causal_and_padding():
    layer = nnx.MultiHeadAttention(num_heads=LIB_H, in_features=LIB_H * LIB_D, decode=False,
                                   rngs=nnx.Rngs(0))

    def forward(x, lengths):
        padding = (jnp.arange(LIB_L)[None, :] < lengths[:, None])[:, None, None, :]
        return layer(x, mask=nnx.combine_masks(nnx.make_causal_mask(x[..., 0]), padding))

    return forward, (_x(), jnp.array([LIB_L, LIB_L // 3]))


def _haiku_causal():
    def layer(x):
        mha = hk.MultiHeadAttention(num_heads=LIB_H, key_size=LIB_D,
                                    w_init=hk.initializers.VarianceScaling())
        return mha(x, x, x, mask=jnp.tril(jnp.ones((1, 1, LIB_L, LIB_L))))

    f = hk.transform(layer)
    x = _x()
    return (lambda p, x: f.apply(p, None, x)), (f.init(jax.random.key(0), x), x)


def _equinox_vmap():
    mha = eqx.nn.MultiheadAttention(num_heads=LIB_H, query_size=LIB_H * LIB_D,
                                    key=jax.random.key(0))
    return (lambda x: jax.vmap(lambda a: mha(a, a, a))(x)), (_x(),)


def _dot_product_attention(hkv: int, with_padding: bool):
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((LIB_B, LIB_L, LIB_H, LIB_D)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((LIB_B, LIB_L, hkv, LIB_D)), jnp.bfloat16)
    if not with_padding:
        return (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla")), (q, kv, kv)
    mask = jnp.asarray(np.arange(LIB_L)[None, None, None] < np.array([LIB_L, 200])[:, None,
                                                                                   None, None])
    return (lambda q, k, v, m: jax.nn.dot_product_attention(
        q, k, v, mask=m, implementation="xla")), (q, kv, kv, mask)


# name → (the model's attention, the mask its site reports)
LIBRARY_MODELS = {
    "flax linen causal": (_linen_causal, "causal"),
    "flax linen bf16, fp32 softmax": (_linen_bf16_fp32_softmax, "none"),
    "flax nnx causal & key padding": (_nnx_causal_and_padding, "causal & key padding"),
    "haiku causal": (_haiku_causal, "causal"),
    "equinox under vmap": (_equinox_vmap, "none"),
    "jax.nn.dot_product_attention bf16 GQA causal": (lambda: _dot_product_attention(2, False),
                                                     "causal"),
    # The mask is ANDed into ones and broadcast over the query heads of each group.
    "jax.nn.dot_product_attention bf16 GQA key padding": (
        lambda: _dot_product_attention(2, True), "key padding"),
}


def _decided(choice) -> tuple:
    return choice.kernel, choice.reason, tuple((r.kernel, r.reason) for r in choice.refusals)


@pytest.mark.parametrize("name", LIBRARY_MODELS)
def test_library_models_get_one_decision_per_platform_from_both_front_ends(name):
    build, mask = LIBRARY_MODELS[name]
    fn, args = build()
    report = hlotool.explain(fn, *args)
    priced = detect(fn, args, "hlo")
    assert len(report.sites) == len(priced) >= 1, str(report)
    for decided, site in zip(report.sites, priced):
        assert decided.site.mask_text == mask, str(report)
        for field in ("batch", "q_len", "kv_len", "num_q_heads", "num_kv_heads", "head_dim",
                      "dtype", "mask", "causal", "mask_axes", "window", "scale"):
            assert getattr(decided.site, field) == getattr(site, field), (name, field)
        for platform, choice in decided.choices.items():
            assert _decided(choose(site, platform)) == _decided(choice), (name, platform)
        assert decided.kernels["cpu"] == "chunked", decided.reason
