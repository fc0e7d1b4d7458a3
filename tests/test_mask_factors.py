"""Masks read as an AND of factors (#42): KerasHub builds Gemma 2's mask from int32 casts of
its padding and causal masks merged by `minimum`, then ANDs a sliding window made of
`triu * tril` sliced at the cache index. Each factor reaches the kernels as structure — the
band as a window, the padding as key padding — so splash takes every layer, and no dense
[L, L] mask reaches it.

The model code is KerasHub's (`compute_causal_mask`, `merge_padding_and_attention_mask`,
`GemmaAttention._mask_sliding_window`, keras' masked `Softmax`) in keras ops on the JAX backend:
keras-hub itself pulls TensorFlow, too heavy for the test extras. flax nnx's
`make_attention_mask(pad, pad)` adds a factor of its own, query padding, which splash takes as
segment ids and the chunked kernel per tile."""

from __future__ import annotations

import os
import re

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from keras import ops  # noqa: E402

import hlotool  # noqa: E402

B, H, KV, D, WINDOW = 2, 4, 2, 16, 64
SOFTMAX = keras.layers.Softmax(axis=-1, dtype="float32")


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    """keras_hub.src.layers.modeling.transformer_layer_utils.compute_causal_mask."""
    i = ops.arange(output_length, dtype="float32")
    i = i + ops.cast(cache_index, "float32")
    i = ops.expand_dims(i, axis=1)
    j = ops.arange(input_length, dtype="float32")
    mask = ops.expand_dims(i >= j, axis=0)
    return ops.broadcast_to(mask, (batch_size, output_length, input_length))


def merge_padding_and_attention_mask(padding_mask, attention_mask):
    """keras_hub's merge_padding_and_attention_mask (no keras mask on the inputs)."""
    mask = ops.cast(ops.expand_dims(padding_mask, axis=1), "int32")
    attention_mask = ops.cast(attention_mask, "int32")
    return ops.minimum(mask, attention_mask)


def mask_sliding_window(attention_mask, cache_update_index=0):
    """GemmaAttention._mask_sliding_window on the JAX backend."""
    _, query_len, key_len = ops.shape(attention_mask)
    all_ones = ops.ones((key_len, key_len), "bool")
    sliding_mask = ops.triu(all_ones, -1 * WINDOW + 1) * ops.tril(all_ones, WINDOW - 1)
    sliding_mask = ops.slice(sliding_mask, (cache_update_index, 0), (query_len, key_len))
    sliding_mask = ops.expand_dims(sliding_mask, 0)
    return ops.logical_and(attention_mask, ops.cast(sliding_mask, "bool"))


def gemma2_layer(q, k, v, padding_mask, sliding: bool, softcap: bool = True):
    """Gemma 2's attention as KerasHub computes it: q [B, L, H, D], k, v [B, L, KV, D],
    padding_mask [B, L]; soft-capped logits, keras' masked float32 softmax."""
    b, length = padding_mask.shape
    mask = merge_padding_and_attention_mask(
        padding_mask, compute_causal_mask(b, length, length))
    if sliding:
        mask = mask_sliding_window(mask)
    q = ops.reshape(q * ops.cast(D ** -0.5, q.dtype), (b, length, KV, H // KV, D))
    logits = ops.einsum("btkgh,bskh->bkgts", q, k)
    if softcap:  # Gemma 3 has none
        logits = ops.tanh(logits / 50.0) * 50.0
    probs = SOFTMAX(logits, mask=mask[:, None, None, :, :])
    out = ops.einsum("bkgts,bskh->btkgh", ops.cast(probs, v.dtype), v)
    return ops.reshape(out, (b, length, H, D))


def _args(length: int, dtype, padding_dtype=jnp.bool_):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, length, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, length, KV, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, length, KV, D)), dtype)
    padding = jnp.asarray(np.arange(length)[None] < np.array([[length], [length * 2 // 3]]))
    return q, k, v, padding.astype(padding_dtype)


@pytest.mark.parametrize("sliding", [False, True], ids=["causal & padding", "window & padding"])
def test_the_factors_of_a_keras_hub_mask(sliding):
    report = hlotool.explain(lambda *a: gemma2_layer(*a, sliding), *_args(1024, jnp.float32))
    (site,) = report.sites
    assert site.site.mask_axes == "BK", str(report)  # the padding: per batch row and key
    assert site.site.window == ((WINDOW - 1, 0) if sliding else None)
    assert site.kernels["tpu"] == "splash_tpu", site.reason


@pytest.mark.parametrize("sliding", [False, True], ids=["causal & padding", "window & padding"])
@pytest.mark.slow
def test_a_keras_hub_mask_rewrites_with_outputs_and_gradients_equal(sliding):
    _equal_to_jit(lambda *a: gemma2_layer(*a, sliding), _args(256, jnp.float32))


def _equal_to_jit(layer, args) -> None:
    """`flash_jit(layer, kernel="chunked")` rewrites its site, with its output within 1e-5 of
    `jax.jit`'s and its gradients with respect to q, k, v within 1e-5 of the largest."""
    fast = hlotool.flash_jit(layer, kernel="chunked")
    want, got = jax.jit(layer)(*args), fast(*args)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5
    assert hlotool.explain(layer, *args, kernel="chunked").rewritten == 1

    def loss(fn):
        return lambda q, k, v, pad: jnp.sum(jnp.sin(fn(q, k, v, pad)))

    want = jax.grad(loss(layer), argnums=(0, 1, 2))(*args)
    got = jax.grad(loss(fast), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) < 1e-5


def test_a_keras_hub_window_and_padding_exports_to_splash_without_a_dense_mask():
    _one_splash_call(lambda *a: gemma2_layer(*a, True), _args(2048, jnp.bfloat16))


def _one_splash_call(layer, real) -> None:
    """The TPU export of `flash_jit(layer)` at `real`'s shapes holds one splash call, whose
    operands include no [L, L] array."""
    length = real[0].shape[1]
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in real]
    text = jax.export.export(jax.jit(hlotool.flash_jit(layer)), platforms=["tpu"])(
        *args).mlir_module()
    calls = [line for line in text.splitlines()
             if "stablehlo.custom_call @tpu_custom_call" in line]
    assert len(calls) == 1 and "splash_mha_fwd" in text
    assert f"{length}x{length}x" not in calls[0].rsplit(" : (", 1)[1]


CUDNN = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def test_a_window_and_padding_lowers_to_cudnn_for_cuda():
    """Without the soft-cap cuDNN has no term for (Gemma 3's layer), a window & key padding
    site goes to cuDNN on CUDA as a window and key lengths: its forward and backward calls are
    in the CUDA export of the layer and of its gradient."""
    real = _args(1024, jnp.bfloat16)

    def layer(*a):
        return gemma2_layer(*a, True, softcap=False)

    (site,) = hlotool.explain(layer, *real).sites
    assert site.site.mask_text == "causal & key padding" and site.site.window == (WINDOW - 1, 0)
    assert site.kernels["cuda"] == "cudnn", site.reason
    fast = hlotool.flash_jit(layer)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fast(*a).astype(jnp.float32))), 1))
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in real]
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in CUDNN]
    counts = [[text.count(f"@{c}(") for c in CUDNN] for text in (
        jax.export.export(f, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        for f in (fast, grad))]
    assert counts == [[1, 0], [1, 1]]


def test_an_int32_padding_mask_stays_a_dense_remainder_and_says_so():
    """min(padding, causal) of an int32 padding is an AND only where the padding is 0 or 1:
    min(-1, 0) keeps a key the AND would hide. Not provable from the program, so the mask is
    read whole."""
    report = hlotool.explain(lambda *a: gemma2_layer(*a, True),
                             *_args(1024, jnp.float32, jnp.int32))
    (site,) = report.sites
    assert site.site.mask_axes == "BQK"
    assert "passed over splash_tpu: a boolean mask varying along BQK" in site.reason


def flax_layer(q, k, v, padding):
    """A flax nnx decoder's attention on a padded batch: `make_attention_mask(pad, pad)` (the
    outer AND of query and key padding) combined with the causal mask, then
    `nnx.dot_product_attention`."""
    from flax import nnx

    mask = nnx.combine_masks(nnx.make_attention_mask(padding, padding),
                             nnx.make_causal_mask(padding))
    return nnx.dot_product_attention(q, k, v, mask=mask)


def _flax_args(length: int, dtype):
    """q, k, v [B, L, H, D] (nnx's attention repeats no K/V heads) and padding [B, L]."""
    q, _, _, padding = _args(length, dtype)
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.standard_normal(q.shape), dtype) for _ in range(2))
    return q, k, v, padding


def test_query_padding_is_a_factor_of_its_own_and_takes_splash():
    """flax's [B, 1, L, L] mask is causal ∧ query padding ∧ key padding: reported as those
    three factors, splash takes it on TPU (queries as segment ids no key has), and cuDNN's
    refusal names the factor it has no term for."""
    report = hlotool.explain(flax_layer, *_flax_args(1024, jnp.bfloat16))
    (site,) = report.sites
    assert site.site.mask_text == "causal & query padding & key padding", str(report)
    assert site.site.mask_axes == "BK"
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    assert "cudnn: query padding unsupported (cudnn has none)" in site.reason
    assert site.to_json()["site"]["query_padding"] is True


@pytest.mark.slow
def test_flax_query_and_key_padding_rewrites_with_outputs_and_gradients_equal():
    _equal_to_jit(flax_layer, _flax_args(256, jnp.float32))


def test_flax_query_and_key_padding_exports_to_splash_without_a_dense_mask():
    _one_splash_call(flax_layer, _flax_args(2048, jnp.bfloat16))


def _two_gemma2_layers(q, k, v, pad):
    """A local (sliding window) layer, then a global one, both with KerasHub's mask."""
    return gemma2_layer(gemma2_layer(q, k, v, pad, True), k, v, pad, False)


def _two_flax_layers(q, k, v, pad):
    return flax_layer(flax_layer(q, k, v, pad), k, v, pad)


TRAIN_STEPS = {"KerasHub Gemma 2, local then global": (_two_gemma2_layers, _args),
               "flax nnx, query and key padding": (_two_flax_layers, _flax_args)}


@pytest.mark.parametrize("model, inputs", TRAIN_STEPS.values(), ids=TRAIN_STEPS.keys())
@pytest.mark.slow
def test_every_layer_of_a_padded_train_step_exports_to_splash_forward_and_backward(
        model, inputs):
    """Two layers, a padded batch of 2, the gradient with respect to q, k and v taken inside
    `flash_jit`: the TPU export holds splash's forward for each layer and its dK/dV and dQ
    kernels for each, and nothing else that is a TPU kernel."""
    def step(q, k, v, pad):
        return jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.square(model(q, k, v, pad).astype(jnp.float32))),
            argnums=(0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs(1024, jnp.bfloat16)]
    text = jax.export.export(jax.jit(hlotool.flash_jit(step)), platforms=["tpu"])(
        *args).mlir_module()
    names = sorted(re.findall(r'kernel_name = "(\w+?)_segmented', line)[0]
                   for line in text.splitlines()
                   if "stablehlo.custom_call @tpu_custom_call" in line)
    assert names == ["splash_mha_dkv"] * 2 + ["splash_mha_dq"] * 2 + ["splash_mha_fwd"] * 2


QUERY_MASKS = {
    "query padding alone": dict(),
    "with key padding and causal": dict(keys=True, causal=True),
    "with key padding, finite fill": dict(keys=True, fill=-1e9),
    "with a window, finfo.min fill": dict(window=(20, 0), fill=float(jnp.finfo(jnp.float32).min)),
}


@pytest.mark.parametrize("case", QUERY_MASKS.values(), ids=QUERY_MASKS.keys())
@pytest.mark.slow
def test_kernels_taking_query_padding_match_the_mask_it_stands_for(case):
    """A call's `query_mask` [B, Lq] means the mask [B, 1, Lq, 1] ANDed in: splash (interpret
    mode) and chunked match the reference kernel given that dense mask, output and dq, dk, dv
    within 1e-5 of the largest; row 0 of the batch hides a third of its queries, row 1 every
    query past 100 (lengths not multiples of 128: the adapters pad)."""
    from hlotool.kernels import get
    from hlotool.kernels.splash_tpu import SplashTpu

    opts = dict(case)
    rng = np.random.default_rng(3)
    lq, lk = 136, 200
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, lk, 2, 64)), jnp.float32) for _ in range(2))
    rows = jnp.asarray(np.stack([np.arange(lq) % 3 != 0, np.arange(lq) < 100]))
    if opts.pop("keys", False):
        opts["mask"] = jnp.asarray(np.stack([np.arange(lk) < 150, np.arange(lk) % 5 != 1]))[
            :, None, None, :]
    dense = dict(opts, mask=rows[:, None, :, None] & opts.get("mask", True))

    def grads(kernel, options):
        def loss(q, k, v):
            out = kernel(q, k, v, scale=0.125, **options)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    g_ref, o_ref = grads(get("reference"), dense)
    for kernel in (SplashTpu(interpret=True), get("chunked")):
        g, o = grads(kernel, dict(opts, query_mask=rows))
        for got, want in zip((o, *g), (o_ref, *g_ref)):
            scale = float(jnp.max(jnp.abs(want)))
            assert float(jnp.max(jnp.abs(got - want))) / scale < 1e-5, kernel.name
