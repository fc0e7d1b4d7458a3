"""Hugging Face Flax models (transformers 4.x, the last line with Flax): every attention layer
found, rewritten on CPU with outputs and gradients equal to `jax.jit`'s, and the kernel each
platform would run named. Small configs, random weights, no downloads.

What these models write: an additive `finfo.min` bias built from the padding mask (and, in
decoders, the causal mask), BERT's all-ones head mask multiplying the probabilities, Llama's
grouped K/V heads repeated before the dot, BLOOM's ALiBi bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool

transformers = pytest.importorskip("transformers")

B, L, VOCAB = 2, 64, 128
SMALL = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)


def _models():
    t = transformers
    return {
        "bert": lambda: t.FlaxBertModel(t.BertConfig(
            **SMALL, hidden_size=64, intermediate_size=128, max_position_embeddings=L)),
        "gpt2": lambda: t.FlaxGPT2Model(t.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=L)),
        "llama": lambda: t.FlaxLlamaModel(t.LlamaConfig(
            **SMALL, hidden_size=64, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=L)),
        "bloom": lambda: t.FlaxBloomModel(t.BloomConfig(
            vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
        "gpt_neo": lambda: t.FlaxGPTNeoModel(t.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], max_position_embeddings=L,
            window_size=16)),
    }


# model: (sites, q heads / kv heads, scale, mask kind, the axes its bias varies along, head
# mask). Padding reaches the kernel at its own size ([B, 1, 1, Lk] for BERT; decoders fold the
# causal mask into it: [B, 1, Lq, Lk]); only BLOOM's ALiBi bias varies per head. GPT-Neo does
# not scale its scores: it multiplies q by √d before flax divides by it.
EXPECTED = {
    "bert": (2, (4, 4), 0.25, "additive", "BK", True),
    "gpt2": (2, (4, 4), 0.25, "additive", "BQK", False),
    "llama": (2, (4, 2), 0.25, "additive", "BQK", False),
    "bloom": (2, (4, 4), 0.25, "additive", "BHQK", False),
    "gpt_neo": (2, (4, 4), 1.0, "additive", "BQK", False),
}


def _inputs():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, L)))
    attention_mask = jnp.ones((B, L), jnp.int32).at[1, 40:].set(0)  # the second one padded
    return ids, attention_mask


@pytest.mark.parametrize("name", list(EXPECTED))
def test_hugging_face_flax_model_is_rewritten_with_outputs_and_gradients_equal(name):
    model = _models()[name]()
    ids, attention_mask = _inputs()

    def hidden(params, ids, attention_mask):
        return model(ids, attention_mask=attention_mask, params=params).last_hidden_state

    def loss(params, ids, attention_mask, fn):
        return jnp.sum(fn(params, ids, attention_mask) ** 2)

    count, heads, scale, kind, axes, head_mask = EXPECTED[name]
    report = hlotool.explain(hidden, model.params, ids, attention_mask, kernel="chunked")
    assert (len(report.sites), report.rewritten) == (count, count), str(report)
    for s in report.sites:
        assert (s.site.num_q_heads, s.site.num_kv_heads) == heads
        assert s.site.scale == pytest.approx(scale)
        assert (s.site.mask, s.site.mask_axes) == (kind, axes)
        assert ("head mask" in s.site.variants) == head_mask
    fast = hlotool.flash_jit(hidden, kernel="chunked")
    want = jax.jit(hidden)(model.params, ids, attention_mask)
    got = fast(model.params, ids, attention_mask)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-5
    # Every parameter's gradient, judged against the gradient's overall size (a key bias has
    # gradient 0 in exact arithmetic: softmax ignores a shift; both sides hold rounding noise).
    grads = [np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])
             for g in (jax.grad(loss)(model.params, ids, attention_mask, jax.jit(hidden)),
                       jax.grad(loss)(model.params, ids, attention_mask, fast))]
    assert np.max(np.abs(grads[1] - grads[0])) / np.max(np.abs(grads[0])) < 1e-5


def test_the_tpu_kernel_each_model_would_run_at_long_sequences():
    """At L=2048 the kernel pays on TPU: Pallas flash takes the models' additive biases (splash
    takes none), and says why splash was passed over."""
    t = transformers
    model = t.FlaxGPT2Model(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4,
                                          n_positions=2048))
    ids = jax.ShapeDtypeStruct((1, 2048), jnp.int32)

    def hidden(params, ids, attention_mask):
        return model(ids, attention_mask=attention_mask, params=params).last_hidden_state

    (site,) = hlotool.explain(hidden, model.params, ids, ids).sites
    assert site.kernels["tpu"] == "pallas_tpu"
    assert "splash_tpu skipped: additive bias unsupported" in site.reason
