"""Masks read as an AND of factors (#42): KerasHub builds Gemma 2's mask from int32 casts of
its padding and causal masks merged by `minimum`, then ANDs a sliding window made of
`triu * tril` sliced at the cache index. Each factor reaches the kernels as structure — the
band as a window, the padding as key padding — so splash takes every layer, and no dense
[L, L] mask reaches it.

The model code is KerasHub's (`compute_causal_mask`, `merge_padding_and_attention_mask`,
`GemmaAttention._mask_sliding_window`, keras' masked `Softmax`) in keras ops on the JAX backend:
keras-hub itself pulls TensorFlow, too heavy for the test extras."""

from __future__ import annotations

import os

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
@pytest.mark.sweep(keep=1)
def test_a_keras_hub_mask_rewrites_with_outputs_and_gradients_equal(sliding):
    args = _args(256, jnp.float32)

    def loss(fn):
        return lambda q, k, v, pad: jnp.sum(jnp.sin(fn(q, k, v, pad)))

    def layer(*a):
        return gemma2_layer(*a, sliding)

    fast = hlotool.flash_jit(layer, kernel="chunked")
    want, got = jax.jit(layer)(*args), fast(*args)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5
    assert hlotool.explain(layer, *args, kernel="chunked").rewritten == 1
    want = jax.grad(loss(layer), argnums=(0, 1, 2))(*args)
    got = jax.grad(loss(fast), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want):
        assert float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) < 1e-5


def test_a_keras_hub_window_and_padding_exports_to_splash_without_a_dense_mask():
    length = 2048
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _args(length, jnp.bfloat16)]
    fast = hlotool.flash_jit(lambda *a: gemma2_layer(*a, True))
    text = jax.export.export(jax.jit(fast), platforms=["tpu"])(*args).mlir_module()
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
