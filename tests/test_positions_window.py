"""A sliding window built from positions, not iotas (#42): the `gemma` library's local layer
compares `positions = cumsum(input_mask) - (cumsum >= 1)` of its padded batch, keys against
queries, and ANDs that with `input_mask[:, None, :] * tril`. Read with the positions taken
as their indices it is causal ∧ key padding ∧ window(W - 1, 0): exactly so for left padding
(valid rows have positions index - pad; padded query rows see no key under causal ∧ key
padding anyway) and without padding, not for right padding (a padded query row i ≥ n has
position n - 1 and sees the last W valid keys). So the reading is checked per call against
the program's own mask, and the site runs with its dense mask where it does not hold.

The model code is written here in plain jax after the library's (`gemma/gm/nn/_modules.py`
`Attention.__call__`, `create_sliding_mask`; `gemma/gm/math/_pos_utils.py`; the causal mask
of `gemma/gm/utils/_attention_mask.py`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool

B, H, KV, D, WINDOW = 2, 4, 2, 16, 16
K_MASK = -2.3819763e38  # the library's fill
PADDINGS = ("left", "right", "none")


def positions_of(input_mask):
    """Positions 0, 1, ... of the valid tokens; a padded token repeats its neighbour's."""
    counted = jnp.cumsum(input_mask, axis=-1)
    return counted - (counted >= 1)


def gemma_layer(q, k, v, input_mask, window=WINDOW):
    """q [B, T, N, H], k, v [B, S, K, H], input_mask [B, L] (True: a token): GQA logits
    [B, T, N, S], soft-capped at 50, the causal and padding mask, for a local layer ANDed
    with the window of the positions, expanded over the heads at axis -2."""
    b, t, n, h = q.shape
    length = input_mask.shape[-1]
    positions = positions_of(input_mask)
    attn_mask = input_mask[..., None, :] * jnp.tril(jnp.ones((length, length), bool))[None]
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, KV, n // KV, h), k)
    logits = jnp.tanh(logits.reshape(b, t, n, -1) / 50.0) * 50.0
    if window is not None:
        keys, queries = positions[..., None, :], positions[..., :, None]
        sliding = keys > queries - window
        sliding = sliding * (keys < queries + window)
        attn_mask = attn_mask * sliding
    padded = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded, axis=-1).astype(k.dtype)
    out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, KV, n // KV, -1), v)
    return out.reshape(b, t, n, h)


def _args(length: int, padding: str, dtype=jnp.float32):
    """q, k, v and the input mask of a batch of 2: row 0 full, row 1 two thirds tokens,
    padded on the left, on the right, or not at all."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, length, H, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, length, KV, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, length, KV, D)), dtype)
    tokens = np.array([length, length * 2 // 3])[:, None]
    index = np.arange(length)[None]
    mask = {"left": index >= length - tokens, "right": index < tokens,
            "none": np.ones((B, length), bool)}[padding]
    return q, k, v, jnp.asarray(mask)


def _as_factors(input_mask, window=WINDOW):
    """The mask the factors read: causal ∧ key padding ∧ keys within window - 1 before."""
    length = input_mask.shape[-1]
    i, j = np.arange(length)[:, None], np.arange(length)[None]
    return np.asarray(input_mask)[:, None, :] & (j <= i) & (j > i - window)


def _program_mask(input_mask, window=WINDOW):
    positions = np.asarray(positions_of(input_mask))
    length = input_mask.shape[-1]
    keys, queries = positions[:, None, :], positions[:, :, None]
    causal = np.tril(np.ones((length, length), bool))
    return (np.asarray(input_mask)[:, None, :] & causal & (keys > queries - window)
            & (keys < queries + window))


@pytest.mark.parametrize("padding", PADDINGS)
def test_the_band_from_positions_is_the_mask_exactly_where_the_padding_allows(padding):
    """The premise, numerically: left and no padding read as the band, right padding not
    (so a rewrite that ran the band there unchecked would be wrong)."""
    mask = _args(64, padding)[3]
    same = np.array_equal(_program_mask(mask), _as_factors(mask))
    assert same == (padding != "right")


def test_the_window_from_positions_reports_its_factors_and_its_check():
    report = hlotool.explain(gemma_layer, *_args(1024, "left"))
    (site,) = report.sites
    assert site.site.mask_text == "causal & key padding", str(report)
    assert site.site.window == (WINDOW - 1, 0) and site.site.mask_axes == "BK"
    assert "band from positions, checked per call" in site.site.variants
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    assert any("checked per call against the program's own mask" in n for n in site.notes)
    doc = site.to_json()
    assert doc["site"]["band_from_positions"] is True
    assert doc["site"]["window"] == [WINDOW - 1, 0]
    # The global layer (no window) reads as before: no positions, nothing to check.
    (plain,) = hlotool.explain(lambda *a: gemma_layer(*a, window=None),
                               *_args(1024, "left")).sites
    assert not plain.site.band_from_positions and plain.site.window is None


def _equal_to_jit(layer, args) -> None:
    """Output within 1e-5 of `jax.jit`'s, and the gradients with respect to q, k, v of a
    value_and_grad train step taken inside `flash_jit` within 1e-5 of the largest (or of 1:
    with W = 1 each query sees itself alone, and dq is 0 up to the kernel's rounding)."""
    fast = hlotool.flash_jit(layer, kernel="chunked")
    want, got = jax.jit(layer)(*args), fast(*args)
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5

    def step(fn):
        return lambda q, k, v, pad: jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, pad))), argnums=(0, 1, 2))(q, k, v)

    (loss_want, grads_want) = jax.jit(step(layer))(*args)
    report = hlotool.explain(step(layer), *args, kernel="chunked")
    assert report.rewritten == 1, str(report)
    (loss_got, grads_got) = hlotool.flash_jit(step(layer), kernel="chunked")(*args)
    # A sum of sin over every output: each within 1e-5, as the output itself.
    assert abs(float(loss_got - loss_want)) < 1e-5 * want.size
    for g, w in zip(grads_got, grads_want):
        assert float(jnp.max(jnp.abs(g - w)) / max(float(jnp.max(jnp.abs(w))), 1.0)) < 1e-5


@pytest.mark.parametrize("padding", PADDINGS)
def test_a_window_from_positions_rewrites_with_outputs_and_gradients_equal(padding):
    _equal_to_jit(gemma_layer, _args(128, padding))


@pytest.mark.parametrize("window", [1, 64, 200], ids=["W=1", "W=L", "W>L"])
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.slow
def test_any_window_from_positions_rewrites_with_outputs_and_gradients_equal(window, padding):
    _equal_to_jit(lambda *a: gemma_layer(*a, window=window), _args(64, padding))


def test_the_check_takes_the_fallback_where_the_positions_are_no_indices():
    """Right padding: the band's output differs from the program's, and the rewrite returns
    the program's, so the check chose the dense mask there; left padding returns the band's.
    The rewrite runs the reading through `lax.cond`."""
    q, k, v, mask = _args(64, "right")

    def banded(q, k, v, mask):  # the reading's own mask, as a program
        b, t, n, h = q.shape
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, KV, n // KV, h), k)
        logits = jnp.tanh(logits.reshape(b, t, n, -1) / 50.0) * 50.0
        padded = jnp.where(jnp.asarray(_as_factors(mask))[:, :, None, :], logits, K_MASK)
        probs = jax.nn.softmax(padded, axis=-1)
        return jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(b, t, KV, n // KV, -1),
                          v).reshape(b, t, n, h)

    fast = hlotool.flash_jit(gemma_layer, kernel="chunked")
    assert "cond" in str(jax.make_jaxpr(fast)(q, k, v, mask))
    want, band = gemma_layer(q, k, v, mask), banded(q, k, v, mask)
    assert float(jnp.max(jnp.abs(band - want))) > 1e-2
    assert float(jnp.max(jnp.abs(fast(q, k, v, mask) - want))) < 1e-5


def _tpu_kernels(fn, real) -> tuple[list[str], str]:
    """The kernel names of the TPU custom calls in `flash_jit(fn)`'s TPU export at `real`'s
    shapes, sorted, and the export's text."""
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in real]
    text = jax.export.export(jax.jit(hlotool.flash_jit(fn)), platforms=["tpu"])(
        *args).mlir_module()
    calls = [line for line in text.splitlines()
             if "stablehlo.custom_call @tpu_custom_call" in line]
    length = real[0].shape[1]
    for call in calls:  # no dense [L, L] mask among a kernel's operands
        assert f"{length}x{length}x" not in call.rsplit(" : (", 1)[1]
    return sorted(re.findall(r'kernel_name = "(\w+?)_segmented', line)[0]
                  for line in calls), text


def test_a_window_from_positions_exports_to_splash_in_its_checked_branch():
    names, text = _tpu_kernels(gemma_layer, _args(2048, "left", jnp.bfloat16))
    assert names == ["splash_mha_fwd"]
    assert "stablehlo.case" in text or "stablehlo.if" in text


def test_a_train_step_with_a_window_from_positions_exports_to_splash_forward_and_backward():
    """A local layer then a global one, a padded batch of 2, the gradient with respect to q,
    k and v taken inside `flash_jit`: splash's forward, dK/dV and dQ kernels for each."""
    def step(q, k, v, pad):
        def model(q, k, v):
            return gemma_layer(gemma_layer(q, k, v, pad), k, v, pad, window=None)
        return jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.square(model(q, k, v).astype(jnp.float32))),
            argnums=(0, 1, 2))(q, k, v)

    names, _ = _tpu_kernels(step, _args(1024, "left", jnp.bfloat16))
    assert names == ["splash_mha_dkv"] * 2 + ["splash_mha_dq"] * 2 + ["splash_mha_fwd"] * 2
