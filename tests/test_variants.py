"""Softmax variants real models use: detected as declared steps of the one pattern, reported per
site, rewritten with outputs and gradients equal to `jax.jit`'s, and exported to TPU in splash
attention without a dense [B, H, L, L] operand or repeated K/V heads.

The models are hand-written equivalents of their libraries' exact code (keras-hub pulls
TensorFlow, too heavy for CI): Gemma 2's soft-capped, GQA attention (google-deepmind `gemma`),
Keras' masked softmax (`layers.Softmax(mask)`: `where(mask, s, -1e9)`, softmax, then
`where(mask, p, 0)`, as KerasHub Gemma calls it), Keras' dropout after it in training
(`where(keep, p / keep_prob, 0)`) and KerasHub GPT-OSS (a sliding window, sink
logits concatenated as a column, the row-max shift, a float32 softmax, the sink column sliced
off).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool
from hlotool.kernels import get, select
from hlotool.kernels.splash_tpu import SplashTpu
from hlotool.passes.from_hlo import detect_hlo
from hlotool.passes.from_jaxpr import detect_jaxpr

B, L, H, KV, D = 2, 256, 4, 2, 32
K_MASK = -2.3819763e38  # gemma's
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def gemma2(q, k, v, attn_mask, sinks):
    """gemma `Attention` (Gemma 2): q [B, T, N, H], k, v [B, S, K, H] with N = K·G."""
    q = q * D ** -0.5
    q = q.reshape(q.shape[0], q.shape[1], KV, H // KV, D)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k)
    logits = logits.reshape(q.shape[0], q.shape[1], H, -1)
    logits = jnp.tanh(logits / 50.0)
    logits = logits * 50.0
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(k.dtype)
    probs = probs.reshape(q.shape[0], q.shape[1], KV, H // KV, -1)
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)
    return encoded.reshape(q.shape[0], q.shape[1], H, D)


def keras_masked_softmax(q, k, v, attn_mask, sinks, fill=-1e9):
    """keras `Softmax()(scores, mask)` inside a KerasHub attention layer (keras hides keys
    at -1e9; other fills for the tests of that reading)."""
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q * D ** -0.5, k)
    mask = attn_mask[:, None, :, :]
    scores = jnp.where(mask, scores, fill)
    outputs = jax.nn.softmax(scores, axis=-1)
    outputs = jnp.where(mask, outputs, 0.0)
    return jnp.einsum("bnts,bsnh->btnh", outputs.astype(v.dtype), v)


def keras_dropout(q, k, v, attn_mask, sinks, rate=0.1):
    """keras `Softmax()(scores, mask)` then keras' `Dropout(rate)` in training, as keras'
    MultiHeadAttention applies it to the probabilities: `where(keep, p / keep_prob, 0)`."""
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q * D ** -0.5, k)
    mask = attn_mask[:, None, :, :]
    outputs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    outputs = jnp.where(mask, outputs, 0.0)
    keep_prob = 1.0 - rate
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), p=keep_prob, shape=outputs.shape)
    outputs = jax.lax.select(keep, outputs / keep_prob, jnp.zeros_like(outputs))
    return jnp.einsum("bnts,bsnh->btnh", outputs.astype(v.dtype), v)


def gpt_oss(q, k, v, attn_mask, sinks, window=64):
    """KerasHub `GptOssAttention._compute_attention` (a bidirectional sliding window)."""
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    attn_scores = jnp.einsum("bquh,bkuh->buqk", q, k) * D ** -0.5
    q_pos = jnp.arange(attn_scores.shape[2]).astype(jnp.int32)
    kv_pos = jnp.arange(attn_scores.shape[3]).astype(jnp.int32)
    large_neg = jnp.asarray(-1e9 if q.dtype == jnp.float32 else -1e4, q.dtype)
    if window is not None:
        sw_mask = jnp.abs(q_pos[:, None] - kv_pos[None, :]) <= window
        attn_scores = jnp.where(sw_mask[None, None, :, :], attn_scores, large_neg)
    attn_scores = jnp.where(attn_mask[:, None], attn_scores, large_neg)
    b, _, length, _ = attn_scores.shape
    sink_logits = jnp.broadcast_to(sinks.reshape(1, H, 1, 1), (b, H, length, 1))
    combined = jnp.concatenate([attn_scores, sink_logits.astype(q.dtype)], axis=-1)
    combined = combined - jax.lax.stop_gradient(jnp.max(combined, axis=-1, keepdims=True))
    probs = jax.nn.softmax(combined.astype(jnp.float32), axis=-1)
    attn_weights = probs[..., :-1].astype(q.dtype)
    return jnp.einsum("buqk,bkuh->bquh", attn_weights, v)


# (model, softcap, post_mask, sinks, mask kind)
MODELS = [
    (gemma2, 50.0, False, False, "boolean"),
    # Keras' where(mask, p, 0) repeats the logits' mask: no post-softmax mask of its own.
    (keras_masked_softmax, None, False, False, "boolean"),
    (keras_dropout, None, False, False, "boolean"),
    (gpt_oss, None, False, True, "boolean"),
]
IDS = [m[0].__name__ for m in MODELS]


def inputs(dtype=jnp.float32, *, empty_row: bool = False):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, H, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, L, KV, D)), dtype) for _ in range(2))
    lengths = np.array([L, 150])
    mask = np.arange(L)[None, None, :] < lengths[:, None, None]
    mask = mask & np.tril(np.ones((L, L), bool))
    if empty_row:
        mask = mask.copy()
        mask[1, 7] = False  # one query that sees no key
    sinks = jnp.asarray(rng.standard_normal(H), dtype)
    return q, k, v, jnp.asarray(mask), sinks


@pytest.mark.parametrize("model, softcap, post_mask, sinks, kind", MODELS, ids=IDS)
def test_each_variant_is_one_site_with_its_features_in_both_front_ends(
        model, softcap, post_mask, sinks, kind):
    args = inputs()
    (site,) = detect_jaxpr(jax.make_jaxpr(model)(*args))
    (from_hlo,) = detect_hlo(jax.jit(model).lower(*args).as_text(dialect="hlo",
                                                                 debug_info=True))
    for s in (site.site, from_hlo):
        assert (s.softcap, s.post_mask, s.sinks, s.mask) == (softcap, post_mask, sinks, kind)
        # Keras' dropout is a where-mask drawn from random bits: dropout, besides its masked
        # softmax's where-mask.
        assert s.dropout == (model is keras_dropout)
        assert ("dropout" in s.variants) == (model is keras_dropout)
        assert (s.q_len, s.kv_len, s.num_q_heads, s.num_kv_heads) == (L, L, H, KV)
        # Keras' dropout divides the probabilities by keep_prob: the output takes the factor.
        assert s.out_scale == (pytest.approx(1 / 0.9) if model is keras_dropout else None)
    assert site.site.to_json()["softcap"] == softcap


def _value_and_grads(fn):
    def loss(q, k, v, mask, sinks):
        out = fn(q, k, v, mask, sinks)
        weights = jax.random.normal(jax.random.PRNGKey(1), out.shape, jnp.float32)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4), has_aux=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model, softcap, post_mask, sinks, kind", MODELS, ids=IDS)
@pytest.mark.sweep(keep=2)
def test_each_variant_is_rewritten_with_outputs_and_gradients_equal(
        model, softcap, post_mask, sinks, kind, dtype):
    """Against the same program in float32 (on the same rounded inputs): the rewrite is within
    the dtype's tolerance of it, or no further than twice the naive program's own rounding in
    that dtype (a bf16 softmax and its gradient are that coarse)."""
    args = inputs(jnp.dtype(dtype), empty_row=True)
    report = hlotool.explain(model, *args, kernel="chunked")
    assert report.rewritten == 1, str(report)

    def arrays(result):
        grads, out = result
        return [np.asarray(x, np.float64) for x in (out, *grads)]

    want = arrays(_value_and_grads(model)(*args))
    got = arrays(_value_and_grads(hlotool.flash_jit(model, kernel="chunked"))(*args))
    exact = arrays(_value_and_grads(model)(*(x.astype(jnp.float32) if x.dtype != jnp.bool_
                                             else x for x in args)))
    for name, w, g, e in zip(["out", "dq", "dk", "dv", "dsinks"], want, got, exact):
        assert np.isfinite(g).all() == np.isfinite(w).all(), name
        if name == "dsinks" and not sinks:
            assert np.all(g == 0) and np.all(w == 0)
            continue
        scale = max(np.max(np.abs(e)), 1e-30)
        naive_error = np.max(np.abs(w - e)) / scale
        assert np.max(np.abs(g - e)) / scale <= max(TOLERANCE[dtype], 2 * naive_error), name


# Exports are traced only: long enough that the kernel pays on TPU (the policy keeps short
# sequences native).
LONG = 2048


def _tpu_export(fn, *args) -> str:
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def _long_args():
    return [jax.ShapeDtypeStruct((B, LONG, H, D), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((B, LONG, KV, D), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((B, LONG, LONG), jnp.bool_),
            jax.ShapeDtypeStruct((H,), jnp.bfloat16)]


def _kernel_operands(text: str) -> list[list[str]]:
    """The operand types of each TPU kernel call in an exported module."""
    return [re.findall(r"tensor<[^>]*>", line.rsplit(" : (", 1)[1].split(") ->")[0])
            for line in text.splitlines() if "stablehlo.custom_call @tpu_custom_call" in line]


def _dense(types: list[str]) -> list[str]:
    """Those of `types` ending in [L, L]: a dense mask or bias."""
    return [t for t in types if re.search(rf"{LONG}x{LONG}x\w+>$", t)]


def causal_padded(model, lengths):
    """`model` with its mask built in the graph: causal and key padding from `lengths`."""
    def fn(q, k, v, attn_mask, sinks):
        length = q.shape[1]
        keep = jnp.tril(jnp.ones((length, length), bool))[None] & (
            jnp.arange(length)[None, None, :] < lengths[:, None, None])
        return model(q, k, v, keep, sinks)

    return fn


@pytest.mark.parametrize("model", [gemma2, gpt_oss, functools.partial(gpt_oss, window=None)],
                         ids=["gemma2", "gpt_oss", "gpt_oss without a window"])
def test_softcap_and_sinks_export_to_tpu_in_splash_without_dense_masks(model):
    fn = causal_padded(model, jnp.array([LONG, 1500]))
    args = _long_args()
    fast = hlotool.flash_jit(fn)
    report = hlotool.explain(fn, *args)
    (site,) = report.sites
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    text = _tpu_export(fast, *args)
    (operands,) = _kernel_operands(text)
    assert "splash_mha_fwd" in text
    assert not _dense(operands), operands
    # The causal and padding factors of the mask reach splash as a mask object and segment
    # ids: [B, Lq] and [B, Lk] int32 (padded to lanes), no [L, L] operand.
    assert "tensor<2x2048x128xi32>" in operands and "tensor<2x8x2048xi32>" in operands
    grad = _tpu_export(jax.grad(lambda *a: fast(*a).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)), *args)
    assert grad.count("tpu_custom_call") == 3


def test_gqa_exports_to_tpu_with_its_own_kv_heads():
    def causal(q, k, v, attn_mask, sinks):
        length = q.shape[1]
        return gemma2(q, k, v, jnp.tril(jnp.ones((length, length), bool))[None], sinks)

    text = _tpu_export(hlotool.flash_jit(causal), *_long_args())
    (operands,) = _kernel_operands(text)
    assert not _dense(operands), operands
    # Batched by vmap: q [B, H, L, D] and K, V with their own KV heads, not repeated to H.
    assert operands.count(f"tensor<{B}x{KV}x{LONG}x{D}xbf16>") == 2
    assert f"tensor<{B}x{H}x{LONG}x{D}xbf16>" in operands


def test_a_dense_mask_argument_keeps_gpt_oss_off_splash_and_says_so():
    """Its window is read from the iotas; the [B, L, L] mask passed in is data."""
    report = hlotool.explain(gpt_oss, *_long_args())
    (site,) = report.sites
    assert site.site.sinks and site.site.mask_axes == "BQK"
    assert site.site.window == (64, 64)
    assert site.kernels["tpu"] == "chunked"
    assert "passed over splash_tpu: a boolean mask varying along BQK" in site.reason


def post_mask_only(q, k, v, attn_mask, sinks):
    """A mask applied after the softmax alone: it zeroes keys the softmax weighed."""
    k, v = jnp.repeat(k, H // KV, axis=2), jnp.repeat(v, H // KV, axis=2)
    probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q * D ** -0.5, k), axis=-1)
    probs = jnp.where(attn_mask[:, None, :, :], probs, 0.0)
    return jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)


def test_a_post_softmax_mask_runs_in_the_dropout_kernel_on_tpu_saying_why():
    """where(mask, p, 0) is p times a 0/1 multiplier: hlotool's dropout kernel reads it per
    tile; splash and flash take none."""
    report = hlotool.explain(post_mask_only, *_long_args())
    (site,) = report.sites
    assert site.site.post_mask
    assert site.kernels["tpu"] == "dropout_tpu"
    assert ("passed over splash_tpu: a mask applied after the softmax unsupported (splash_tpu has "
            "none)") in site.reason
    assert "; pallas_tpu: a mask applied after the softmax unsupported" in site.reason


def test_keras_masked_softmax_exports_to_splash_its_repeated_mask_left_out():
    """KerasHub's Gemma: keras' Softmax(mask) hides keys with where(mask, s, -1e9) and zeroes
    them again after the softmax. The second where is left out (hidden keys at -inf where the
    call shows that changes nothing), so the causal and padding mask reaches splash."""
    fn = causal_padded(keras_masked_softmax, jnp.array([LONG, 1500]))
    args = _long_args()
    (site,) = hlotool.explain(fn, *args).sites
    assert not site.site.post_mask and site.kernels["tpu"] == "splash_tpu", site.reason
    assert "after the softmax repeats the logits' mask: left out" in site.reason
    text = _tpu_export(hlotool.flash_jit(fn), *args)
    (operands,) = _kernel_operands(text)
    assert "splash_mha_fwd" in text and not _dense(operands), operands


@pytest.mark.parametrize("fill, empty_row", [(-1e9, False), (-1e9, True), (-1.0, False)])
@pytest.mark.sweep(keep=1)
def test_a_repeated_post_softmax_mask_is_left_out_only_where_that_is_exact(fill, empty_row):
    """Left out where every row sees a key and keys at the fill weigh nothing; a row with no
    visible key (the program gives it zeros) or a soft fill (hidden keys still weigh in the
    normalizer) sends the call to the site as it is. Outputs and gradients within 1e-5."""
    fn, args = functools.partial(keras_masked_softmax, fill=fill), inputs(empty_row=empty_row)
    (site,) = hlotool.explain(fn, *args, kernel="chunked").sites
    assert site.rewritten and "repeats the logits' mask" in site.reason
    got = _value_and_grads(hlotool.flash_jit(fn, kernel="chunked"))(*args)
    want = _value_and_grads(fn)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * max(float(jnp.max(jnp.abs(w))), 1e-30)
    if fill == -1.0:  # reading the fill as -inf there would be far off
        far = _value_and_grads(functools.partial(keras_masked_softmax, fill=-jnp.inf))(*args)[1]
        assert float(jnp.max(jnp.abs(far - want[1]))) > 1e-2


def test_tpu_kernels_take_what_their_supports_says():
    site = detect_jaxpr(jax.make_jaxpr(gemma2)(*inputs()))[0].site
    assert not get("pallas_tpu").supports(site)
    assert get("pallas_tpu").supports(site).reason == (
        "logit soft-capping unsupported (pallas_tpu has none)")
    assert select(site, "tpu").name in ("splash_tpu", "tokamax_tpu", "chunked")
    padded = dict(mask_axes="BK")
    per_query = dict(mask_axes="BQK")
    import dataclasses

    assert SplashTpu().supports(dataclasses.replace(site, softcap=None, **padded))
    why = SplashTpu().supports(dataclasses.replace(site, softcap=None, **per_query)).reason
    assert why == ("a boolean mask varying along BQK (splash takes causal masks, key and "
                   "query padding; pallas_tpu takes any mask)")


# Splash in Pallas' interpret mode against the reference kernel (the semantics).
SPLASH_CALLS = {
    "causal": dict(causal=True),
    "key padding, soft-cap": dict(mask="keys", softcap=5.0),
    "causal, lengths, sinks, finite fill": dict(causal=True, kv_lengths=[130, 0],
                                                sinks=True, fill=-1e9),
}


@pytest.mark.parametrize("options", SPLASH_CALLS.values(), ids=SPLASH_CALLS.keys())
@pytest.mark.slow
def test_splash_matches_the_reference_with_gqa_and_unaligned_lengths(options):
    rng = np.random.default_rng(1)
    lq, lk = 136, 200  # padded to 256 inside the adapter
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, lk, 2, 64)), jnp.float32) for _ in range(2))
    sinks = jnp.asarray(rng.standard_normal((1, 4, 1, 1)), jnp.float32)
    opts = dict(options)
    if opts.get("mask") == "keys":
        opts["mask"] = jnp.asarray(rng.random((2, 1, 1, lk)) > 0.3)
    if "kv_lengths" in opts:
        opts["kv_lengths"] = jnp.asarray(opts["kv_lengths"])

    def loss(kernel, q, k, v, sinks):
        call = dict(opts, sinks=sinks) if opts.get("sinks") else opts
        out = kernel(q, k, v, scale=0.125, **call)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    grad = lambda kernel: jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3),  # noqa: E731
                                   has_aux=True)(q, k, v, sinks)
    (g_splash, o_splash), (g_ref, o_ref) = grad(SplashTpu(interpret=True)), grad(get("reference"))
    for got, want in zip((o_splash, *g_splash), (o_ref, *g_ref)):
        scale = max(float(jnp.max(jnp.abs(want))), 1e-30)
        assert float(jnp.max(jnp.abs(got - want))) / scale < 1e-5


@pytest.mark.parametrize("d", [80, 192])
@pytest.mark.sweep(keep=1)
def test_splash_compiles_deviceless_for_tpu_at_head_dims_flash_would_pad(d):
    """Splash takes the head dim as it is (flash pads 80 to 128 and 192 to 256)."""
    from hlotool.targets import get_target

    sharding = get_target("tpu-v5e").sharding()
    spec = jax.ShapeDtypeStruct((1, LONG, 8, d), jnp.bfloat16, sharding=sharding)

    def causal(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((LONG, LONG), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    fast = hlotool.flash_jit(causal, in_shardings=sharding, out_shardings=sharding)
    text = fast.trace(spec, spec, spec).lower().compile().as_text()
    (call,) = [ln for ln in text.splitlines()
               if 'custom_call_target="tpu_custom_call"' in ln]
    # Its output, q, k and v all keep [H, L, D] with D unpadded.
    assert len(re.findall(rf"bf16\[8,{LONG},{d}\]", call)) >= 4, call[:300]


def test_splash_called_directly_refuses_a_mask_over_queries_by_its_shape():
    q = jnp.ones((1, 128, 2, 64))
    per_query = jnp.tril(jnp.ones((128, 128), bool))[None, None]
    with pytest.raises(hlotool.kernels.KernelError,
                       match="kernel splash_tpu: a boolean mask varying along QK"):
        SplashTpu(interpret=True)(q, q, q, scale=0.125, mask=per_query)
    keys = jnp.arange(128)[None, None, None, :] < 100
    out = SplashTpu(interpret=True)(q, q, q, scale=0.125, mask=keys)
    want = get("reference")(q, q, q, scale=0.125, mask=keys)
    assert float(jnp.max(jnp.abs(out - want))) < 1e-5
