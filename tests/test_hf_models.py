"""Hugging Face Flax models (transformers 4.x, the last line with Flax): every attention layer
found, rewritten on CPU with outputs and gradients equal to `jax.jit`'s, and the kernel each
platform would run named. Small configs, random weights, no downloads.

What these models write: an additive `finfo.min` bias `select(mask > 0, 0, finfo.min)` built
from the padding mask (and, in decoders, the causal mask; GPT-Neo's local layers `tril ^
tril(-w)`), BERT's all-ones head mask multiplying the probabilities, Llama's grouped K/V heads
repeated before the dot, BLOOM's ALiBi bias. The finfo.min bias reads as the mask it almost is
(hidden keys get s + finfo.min, which is finfo.min for any |s| under 1e31, checked at run time),
its causal factor and window from their structure: on TPU, splash takes them with no dense
operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool
from hlotool.passes.from_hlo import detect_hlo

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


# model: (sites, q heads / kv heads, scale, mask kind, the axes its mask or bias varies along,
# head mask, windows per layer). Padding reaches the kernel at its own size [B, 1, 1, Lk], the
# decoders' causal factor (and GPT-Neo's local window) as structure; BLOOM adds its ALiBi bias
# beside the mask bias, so both stay biases (only a chain's one bias reads as a mask). GPT-Neo
# does not scale its scores: it multiplies q by √d before flax divides by it.
EXPECTED = {
    "bert": (2, (4, 4), 0.25, "boolean", "BK", True, [None, None]),
    "gpt2": (2, (4, 4), 0.25, "boolean", "BK", False, [None, None]),
    "llama": (2, (4, 2), 0.25, "boolean", "BK", False, [None, None]),
    "bloom": (2, (4, 4), 0.25, "additive", "BHQK", False, [None, None]),
    "gpt_neo": (2, (4, 4), 1.0, "boolean", "BK", False, [None, (15, 0)]),
}


def _inputs():
    ids = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (B, L)))
    attention_mask = jnp.ones((B, L), jnp.int32).at[1, 40:].set(0)  # the second one padded
    return ids, attention_mask


@pytest.mark.parametrize("name", list(EXPECTED))
@pytest.mark.slow
def test_hugging_face_flax_model_is_rewritten_with_outputs_and_gradients_equal(name):
    model = _models()[name]()
    ids, attention_mask = _inputs()

    def hidden(params, ids, attention_mask):
        return model(ids, attention_mask=attention_mask, params=params).last_hidden_state

    def loss(params, ids, attention_mask, fn):
        return jnp.sum(fn(params, ids, attention_mask) ** 2)

    count, heads, scale, kind, axes, head_mask, windows = EXPECTED[name]
    report = hlotool.explain(hidden, model.params, ids, attention_mask, kernel="chunked")
    assert (len(report.sites), report.rewritten) == (count, count), str(report)
    for s in report.sites:
        assert (s.site.num_q_heads, s.site.num_kv_heads) == heads
        assert s.site.scale == pytest.approx(scale)
        assert (s.site.mask, s.site.mask_axes) == (kind, axes)
        assert ("head mask" in s.site.variants) == head_mask
    assert [s.site.window for s in report.sites] == windows
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


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.slow
def test_at_long_sequences_the_tpu_export_holds_splash_and_no_dense_mask(name):
    """At L=2048 the kernel pays on TPU: the models' finfo.min biases reach splash as a causal
    mask object and segment ids, forward and backward, with no [L, L] operand."""
    t = transformers
    length = 2048
    if name == "gpt2":
        model = t.FlaxGPT2Model(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4,
                                              n_positions=length))
    else:
        model = t.FlaxBertModel(t.BertConfig(vocab_size=VOCAB, num_hidden_layers=1,
                                             num_attention_heads=4, hidden_size=64,
                                             intermediate_size=128,
                                             max_position_embeddings=length))
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def hidden(params, ids, attention_mask):
        return model(ids, attention_mask=attention_mask, params=params).last_hidden_state

    (site,) = hlotool.explain(hidden, model.params, ids, ids).sites
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    fast = hlotool.flash_jit(hidden)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    text = jax.export.export(fast, platforms=["tpu"])(params, ids, ids).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @tpu_custom_call" in ln]
    assert len(calls) == 1 and "splash_mha_fwd" in text
    assert f"{length}x{length}x" not in calls[0].rsplit(" : (", 1)[1]
    grad = jax.export.export(jax.jit(jax.grad(
        lambda p, i, m: jnp.sum(fast(p, i, m) ** 2))), platforms=["tpu"])(params, ids, ids)
    assert grad.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 3


# Slow (draws and compares GPT-2's dropout twice): the README's test command leaves it to CI.
@pytest.mark.slow
def test_gpt2_in_training_mode_keeps_its_attention_dropout_exactly():
    """`train=True`: flax's attention dropout multiplies the probabilities by keep / keep_prob,
    keep drawn from the step's rng. The kernel applies that same multiplier, so outputs and
    gradients equal `jax.jit`'s for the same rng."""
    t = transformers
    model = t.FlaxGPT2Model(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=L, attn_pdrop=0.25))
    ids, attention_mask = _inputs()
    rng = jax.random.PRNGKey(7)

    def hidden(params, ids, attention_mask, rng):
        return model(ids, attention_mask=attention_mask, params=params, dropout_rng=rng,
                     train=True).last_hidden_state

    report = hlotool.explain(hidden, model.params, ids, attention_mask, rng, kernel="chunked")
    assert (len(report.sites), report.rewritten) == (2, 2), str(report)
    assert all("dropout" in s.site.variants for s in report.sites)
    fast = hlotool.flash_jit(hidden, kernel="chunked")
    want = jax.jit(hidden)(model.params, ids, attention_mask, rng)
    got = fast(model.params, ids, attention_mask, rng)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < 1e-5
    # Dropout is on: another rng changes the result.
    other = fast(model.params, ids, attention_mask, jax.random.PRNGKey(8))
    assert float(jnp.max(jnp.abs(other - got))) > 1e-2

    def loss(params, fn):
        return jnp.sum(fn(params, ids, attention_mask, rng) ** 2)

    grads = [np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])
             for g in (jax.grad(loss)(model.params, jax.jit(hidden)),
                       jax.grad(loss)(model.params, fast))]
    assert np.max(np.abs(grads[1] - grads[0])) / np.max(np.abs(grads[0])) < 1e-5


@pytest.mark.slow
def test_gpt2_in_training_mode_exports_the_dropout_kernel_for_tpu():
    """Neither splash nor flash takes dropout: on TPU GPT-2's training-mode attention (causal,
    padding, dropout) runs hlotool's own Pallas kernel, which draws the keep mask in the
    kernel. The export of a gradient holds its forward, dK/dV and dQ calls per layer, none of
    them with an [L, L] operand."""
    from test_rewrite_models import tpu_custom_calls

    t = transformers
    length = 512  # the shortest keys "auto" rewrites
    model = t.FlaxGPT2Model(t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=length, attn_pdrop=0.25))
    ids = jnp.zeros((B, length), jnp.int32)
    mask = jnp.ones((B, length), jnp.int32).at[1, 400:].set(0)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    rng = jax.random.PRNGKey(7)

    def hidden(params, ids, attention_mask, rng):
        return model(ids, attention_mask=attention_mask, params=params, dropout_rng=rng,
                     train=True).last_hidden_state

    report = hlotool.explain(hidden, model.params, ids, mask, rng)
    assert [s.kernels["tpu"] for s in report.sites] == ["dropout_tpu"] * 2, str(report)
    fast = hlotool.flash_jit(hidden)
    grad = jax.export.export(jax.jit(jax.grad(
        lambda p, i, m, r: jnp.sum(fast(p, i, m, r) ** 2))), platforms=["tpu"])(
            params, ids, mask, rng).mlir_module()
    # Forward, dK/dV and dQ per layer, each layer's under its own site's name (so a profile
    # tells the layers apart; identical kernels lowered once per site).
    calls = [ln for ln in grad.splitlines() if "stablehlo.custom_call @tpu_custom_call" in ln]
    assert len(calls) == 3 * 2
    assert tpu_custom_calls(hidden, params, ids, mask, rng) == 2
    assert all(f"{length}x{length}x" not in c.rsplit(" : (", 1)[1] for c in calls)
    assert all(name in grad for name in ("dropout_tpu_forward", "dropout_tpu_dkv",
                                         "dropout_tpu_dq"))


def _clip_with_a_max(monkeypatch):
    """LongT5's relative-position buckets call `jnp.clip(x, a_max=...)`, which jax 0.10 no
    longer takes: the keywords it had, mapped onto today's."""
    clip = jnp.clip

    def old_clip(x, a_min=None, a_max=None, **kw):
        return clip(x, kw.pop("min", a_min), kw.pop("max", a_max), **kw)

    monkeypatch.setattr(jnp, "clip", old_clip)


@pytest.mark.parametrize("kind, keys", [("local", 3 * 17), ("transient-global", 3 * 17 + 16)])
@pytest.mark.slow
def test_longt5_blocked_local_attention_is_a_batch_of_block_sites(kind, keys, monkeypatch):
    """LongT5 cuts the sequence into blocks of radius + 1 queries ([B, L/b, b, H, D]) and gives
    each the keys of its block and both neighbours (transient-global: and the global tokens).
    Both front ends read one site whose batch is (B, blocks); with a kernel forced, outputs
    and every gradient equal jax.jit's and the TPU export holds one pallas_tpu call (its
    relative-position bias is an additive bias, which splash does not take). auto keeps it
    native: a 17 x 51 tile per block is a short sequence."""
    from test_rewrite_models import tpu_custom_calls

    _clip_with_a_max(monkeypatch)
    t = transformers
    length, radius, heads, head_dim = 128, 16, 4, 8
    model = t.FlaxLongT5Model(t.LongT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=head_dim, d_ff=64, num_layers=1,
        num_decoder_layers=1, num_heads=heads, local_radius=radius, global_block_size=8,
        encoder_attention_type=kind))
    ids = jax.random.randint(jax.random.key(1), (B, length), 0, VOCAB)
    mask = jnp.ones((B, length), jnp.int32).at[1, 100:].set(0)

    def encode(params, ids, mask):
        return model.encode(ids, attention_mask=mask, params=params).last_hidden_state

    blocks, block = -(-length // (radius + 1)), radius + 1
    (site,) = hlotool.explain(encode, model.params, ids, mask, kernel="chunked").sites
    assert site.rewritten, site.reason
    assert (site.site.q_shape, site.site.k_shape) == (
        (B, blocks, block, heads, head_dim), (B, blocks, keys, heads, head_dim))
    text = jax.jit(encode).lower(model.params, ids, mask).as_text(dialect="hlo")
    assert [s.q_shape for s in detect_hlo(text)] == [site.site.q_shape]
    (native,) = hlotool.explain(encode, model.params, ids, mask).sites
    assert not native.rewritten and "short sequence" in native.reason

    fast = hlotool.flash_jit(encode, kernel="chunked")
    want = jax.jit(encode)(model.params, ids, mask)
    assert float(jnp.max(jnp.abs(fast(model.params, ids, mask) - want))
                 / jnp.max(jnp.abs(want))) < 1e-5

    def loss(params, fn):
        return jnp.sum(jnp.sin(fn(params, ids, mask)))

    grads = [np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(g)])
             for g in (jax.grad(loss)(model.params, jax.jit(encode)),
                       jax.grad(loss)(model.params, fast))]
    assert np.max(np.abs(grads[1] - grads[0])) / np.max(np.abs(grads[0])) < 1e-5
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model.params)
    assert tpu_custom_calls(encode, params, ids, mask, kernel="pallas_tpu") == 1


# Slow (two library train steps, 23 s): the README's test command leaves it to CI.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_optax_train_step_through_a_causal_lm_is_rewritten(name):
    """An AdamW step with `value_and_grad` inside, through a padded batch: both layers'
    forward and backward are swapped (tests/test_train_steps.py), the loss and gradients
    equal jax.jit's, and the TPU export holds forward, dq and dkv kernel calls per site."""
    import optax

    from test_rewrite_models import relative_error, tpu_custom_calls

    length = 512  # the shortest keys "auto" rewrites on CPU
    make = {"llama": lambda: transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(
                **SMALL, hidden_size=64, num_key_value_heads=2, intermediate_size=128,
                max_position_embeddings=length)),
            "gpt2": lambda: transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=length))}
    model = make[name]()
    ids = jax.random.randint(jax.random.key(0), (B, length), 0, VOCAB)
    mask = jnp.ones((B, length), jnp.int32).at[1, length // 2:].set(0)
    opt = optax.adamw(1e-3)

    def step(params, state, ids, mask):
        def loss(params):
            logits = model(ids, attention_mask=mask, params=params).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], ids[:, 1:]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value, grads

    args = (model.params, opt.init(model.params), ids, mask)
    report = hlotool.explain(step, *args)
    assert (len(report.sites), report.rewritten) == (2, 2), str(report)
    got, want = hlotool.flash_jit(step)(*args), jax.jit(step)(*args)
    assert relative_error(got[2:], want[2:]) < 1e-5
    assert tpu_custom_calls(step, *args) == 2 * 3
