"""flash_jit on train steps: programs that take their own gradient (`value_and_grad` inside,
as flax/optax, haiku, equinox and the example's train step do). Each site's forward and jax's
backward of it are replaced by a kernel's forward and backward (passes/backward.py): the loss
and every gradient equal jax.jit(step)'s, no naive site is left, and the TPU export holds a
forward and a backward kernel call (flash: fwd, dq, dkv) per site."""

from __future__ import annotations

import functools
import warnings

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import hlotool
from hlotool import jaxcompat
from hlotool.passes.from_jaxpr import detect_jaxpr
from test_rewrite_models import (
    B, D, E, H, L, X, LinenLayers, haiku_layer, load_example, relative_error, tpu_custom_calls,
)

TPU_CALLS_PER_SITE = 3  # forward, dq, dk/dv


def value_and_grad_step(forward, has_aux=False):
    """A train step's core as frameworks write it: the loss and its gradient, taken inside."""
    def loss(params, *rest):
        y = forward(params, *rest).astype(jnp.float32)
        value = jnp.mean(jnp.sin(y) * jnp.cos(3 * y))
        return (value, jnp.mean(y)) if has_aux else value

    def step(params, *rest):
        return jax.value_and_grad(loss, has_aux=has_aux)(params, *rest)
    return step


def check_step(step, args, sites: int, tol: float = 1e-5, **jit_kwargs) -> None:
    """Every site rewritten (forward and backward), outputs and gradients equal."""
    report = hlotool.explain(step, *args)
    assert (len(report.sites), report.rewritten) == (sites, sites), str(report)
    fast = hlotool.flash_jit(step, **jit_kwargs)
    assert relative_error(fast(*args), jax.jit(step, **jit_kwargs)(*args)) < tol
    assert detect_jaxpr(fast.trace(*args).jaxpr) == []
    assert tpu_custom_calls(step, *args, **jit_kwargs) == TPU_CALLS_PER_SITE * sites


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.slow
def test_flax_linen(has_aux):
    model = LinenLayers()
    params = model.init(jax.random.key(0), X)
    check_step(value_and_grad_step(model.apply, has_aux), (params, X), sites=2)


def test_flax_nnx():
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def forward(state, x):
        return nnx.merge(graph, state)(x, mask=nnx.make_causal_mask(x[..., 0]))

    check_step(value_and_grad_step(forward), (state, X), sites=1)


@pytest.mark.slow
def test_haiku():
    f = hk.transform(haiku_layer)
    params = f.init(jax.random.key(0), X)
    check_step(value_and_grad_step(lambda p, x: f.apply(p, None, x)), (params, X), sites=1)


def test_equinox_filter_value_and_grad():
    mha = eqx.nn.MultiheadAttention(num_heads=H, query_size=E, key=jax.random.key(0))
    arrays, static = eqx.partition(mha, eqx.is_array)

    def step(arrays, x):
        def loss(m):
            return jnp.mean(jnp.sin(jax.vmap(lambda a: m(a, a, a))(x)))
        return eqx.filter_value_and_grad(loss)(eqx.combine(arrays, static))

    check_step(step, (arrays, X), sites=1)


def qkv_weights(heads_kv: int) -> jax.Array:
    rng = np.random.default_rng(7)
    return jnp.asarray(rng.standard_normal((E, (H + 2 * heads_kv) * D)) / 8, jnp.float32)


def projected_attention(w, x, heads_kv=H):
    """jax.nn.dot_product_attention (nested jits) on q, k, v projected from x [B, L, E]."""
    qkv = (x @ w).reshape(B, L, H + 2 * heads_kv, D)
    q, k, v = jnp.split(qkv, [H, H + heads_kv], axis=2)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@pytest.mark.parametrize("heads_kv", [H, 1])
@pytest.mark.sweep(keep=1)
def test_jax_nn_dot_product_attention(heads_kv):
    step = value_and_grad_step(lambda w, x: projected_attention(w, x, heads_kv))
    check_step(step, (qkv_weights(heads_kv), X), sites=1)


def test_validate_compares_a_train_steps_outputs():
    """validate=True on a train step checks its outputs (the gradients), without
    differentiating the kernels' backward passes a second time."""
    step = value_and_grad_step(projected_attention)
    args = (qkv_weights(H), X)
    fast = hlotool.flash_jit(step, validate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fast(*args)
    assert fast.report.rewritten == 1, str(fast.report)
    assert relative_error(got, jax.jit(step)(*args)) < 1e-5


@pytest.mark.slow
def test_gradient_accumulation_loop():
    """The gradient taken in a scan over micro-batches: site and backward share the body."""
    def step(w, xs):
        def micro(total, x):
            value, grad = value_and_grad_step(projected_attention)(w, x[None])
            return total + grad, value
        return jax.lax.scan(micro, jnp.zeros_like(w), xs)

    check_step(step, (qkv_weights(H), jnp.concatenate([X, 2 * X])), sites=1)


@pytest.mark.slow
def test_optax_adamw_step():
    model = LinenLayers()
    params = model.init(jax.random.key(0), X)
    opt = optax.adamw(1e-3)

    def step(params, state, x):
        value, grads = value_and_grad_step(model.apply)(params, x)
        updates, state = opt.update(grads, state, params)
        # The gradients are returned too: Adam's first update is ~lr·sign(g), so the new
        # parameters alone would hide how close the gradients are.
        return optax.apply_updates(params, updates), state, value, grads

    args = (params, opt.init(params), X)
    report = hlotool.explain(step, *args)
    assert (len(report.sites), report.rewritten) == (2, 2), str(report)
    got = hlotool.flash_jit(step)(*args)
    want = jax.jit(step)(*args)
    assert relative_error(got[2:], want[2:]) < 1e-5
    # Keys' bias gradients are zero up to rounding (softmax ignores a constant per row),
    # and Adam turns rounding's sign into ±lr: new parameters agree to 2·lr.
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-3)
    assert tpu_custom_calls(step, *args) == 2 * TPU_CALLS_PER_SITE


@pytest.mark.slow
def test_example_causal_decoder_train_step():
    m = load_example("causal_decoder")
    params = m.init_params(jax.random.key(0), 16, 2)
    tokens = jax.random.randint(jax.random.key(1), (1, L), 0, m.VOCAB)

    def step(params, tokens):  # the example's loss and gradient, as its train_step takes them
        return jax.value_and_grad(m.loss_fn)(params, tokens, 2)

    check_step(step, (params, tokens), sites=2)
    report = hlotool.explain(m.train_step, params, tokens, 2)
    assert (len(report.sites), report.rewritten) == (2, 2), str(report)
    got = hlotool.flash_jit(m.train_step, static_argnames="heads")(params, tokens, 2)
    assert relative_error(got, m.train_step(params, tokens, 2)) < 1e-5


def keras_attention_step(**attention):
    """A Keras 3 train step on the JAX backend: `model.stateless_call` under
    `jax.value_and_grad`, the step Keras' JAX trainer writes, through
    `layers.MultiHeadAttention(**attention)` with a causal mask; (step, args)."""
    import keras

    inputs = keras.Input((L, E))
    y = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, seed=0, **attention)(
        inputs, inputs, use_causal_mask=True)
    model = keras.Model(inputs, keras.layers.Dense(E)(y))
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def forward(trainable, others, x):
        return model.stateless_call(trainable, others, x, training=True)[0]

    return value_and_grad_step(forward), (trainable, others, X)


@pytest.mark.slow
def test_keras_stateless_call():
    step, args = keras_attention_step()
    report = hlotool.explain(step, *args)
    assert report.sites[0].site.mask == "causal", str(report)
    check_step(step, args, sites=1)


def test_learned_position_bias_gets_its_gradient_through_the_kernel():
    """T5's relative position bias: a learned [H, L, L] parameter broadcast over the batch
    and added to the scores. The kernel reads the bias the site adds (the broadcast), so the
    program's own transpose of the broadcast sums the kernel's dbias into the parameter's
    gradient."""
    def t5_layer(params, x):
        length = x.shape[1]
        q, k, v = jnp.split((x @ params["w"]).reshape(B, length, 3 * H, D), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + params["relative"][None]  # T5: no scale
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return o.reshape(B, length, E)

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((E, 3 * E)) / 4, jnp.float32),
              "relative": jnp.asarray(rng.standard_normal((H, L, L)), jnp.float32)}
    check_step(value_and_grad_step(t5_layer), (params, X), sites=1)


def gpt_oss_layer(params, x):
    """KerasHub GPT-OSS's attention as a layer: a learned sink logit per head broadcast to a
    column, concatenated to the causal scores, the row max shifted out, the column sliced
    off the probabilities."""
    length = x.shape[1]
    q, k, v = jnp.split((x @ params["w"]).reshape(B, length, 3 * H, D), 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
    sink = jnp.broadcast_to(params["sinks"].reshape(1, H, 1, 1), (B, H, length, 1))
    s = jnp.concatenate([s, sink], axis=-1)
    s = s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jax.nn.softmax(s, axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, length, E)


@pytest.mark.slow
def test_attention_sinks_get_their_gradient_through_the_kernel():
    """The sinks' gradient is the kernel's dsinks summed by the program's transpose of the
    broadcast. The mask's fill, a constant broadcast to the scores' shape, is an input of
    the site that jax never differentiates: the match must not ask for its derivative."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((E, 3 * E)) / 4, jnp.float32),
              "sinks": jnp.asarray(rng.standard_normal(H), jnp.float32)}
    step = value_and_grad_step(gpt_oss_layer)
    report = hlotool.explain(step, params, X)
    assert report.sites[0].site.sinks, str(report)
    check_step(step, (params, X), sites=1)
    _, grads = hlotool.flash_jit(step)(params, X)
    assert np.abs(np.asarray(grads["sinks"])).min() > 0  # every head's sink is learned


@pytest.mark.slow
def test_keras_attention_dropout_in_training():
    """Keras' dropout on the probabilities (`where(keep, p / keep_prob, 0)`, its keep mask
    drawn from the seed generator's state): dropout, and 1 / keep_prob a factor the kernel's
    output takes. The kernels draw the keep mask themselves, tile by tile, with the bits the
    program's draw has there (kernels/drawn.py): chunked on CPU. On TPU the table's kernel
    for dropout is dropout_tpu, but priced forward and backward at D = 8 it does not pay
    (tests/test_dropout_tpu.py runs it). Keras' causal mask counts positions with
    cumsum (read as causal at any length) and is applied after the softmax again: that
    repeat is left out where every row sees a key, as each causal row does."""
    step, args = keras_attention_step(dropout=0.1)
    report = hlotool.explain(step, *args)
    (site,) = report.sites
    assert site.rewritten and site.kernels["cpu"] == "chunked", str(report)
    assert (site.site.mask, site.kernels["tpu"]) == ("causal", None), str(report)
    assert site.choices["tpu"].priced == "dropout_tpu"
    assert "head dim too small: D=8" in site.choices["tpu"].reason
    assert not site.site.post_mask and site.site.out_scale == pytest.approx(1 / 0.9)
    assert site.site.dropout and "dropout" in site.site.variants
    assert "after the softmax repeats the logits' mask: left out" in site.reason
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
    assert detect_jaxpr(fast.trace(*args).jaxpr) == []
    assert "threefry2x32" in str(fast.trace(*args).jaxpr)  # chunked draws its own tiles
    assert tpu_custom_calls(step, *args) == 0


@pytest.mark.slow
def test_flax_linen_bfloat16():
    model = nn.MultiHeadDotProductAttention(num_heads=H, dtype=jnp.bfloat16,
                                           force_fp32_for_softmax=True)
    x = X.astype(jnp.bfloat16)
    params = model.init(jax.random.key(0), x)
    check_step(value_and_grad_step(model.apply), (params, x), sites=1, tol=2e-2)


def test_probabilities_read_besides_the_gradient_stay_native():
    """A step that also returns the attention weights: dropping the naive equations would
    change that output, so the site stays native and says why."""
    w = qkv_weights(H)

    def step(w, x):
        def loss(w):
            q, k, v = jnp.split((x @ w).reshape(B, L, 3 * H, D), 3, axis=2)
            p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D), axis=-1)
            return jnp.mean(jnp.einsum("bhqk,bkhd->bqhd", p, v) ** 2), p[0, 0, 0]
        return jax.grad(loss, has_aux=True)(w)

    report = hlotool.explain(step, w, X)
    (site,) = report.sites
    assert not site.rewritten
    assert "used outside it" in site.reason and "jax.grad(flash_jit(loss))" in site.reason
    got = hlotool.flash_jit(step)(w, X)
    for g, want in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(step)(w, X))):
        np.testing.assert_array_equal(g, want)


# ----------------------------------------------------------------------------------------
# jax.checkpoint: the backward recomputes the attention inside the checkpointed body

# The forward; in the checkpointed body the kernel's forward again (its residuals), dq, dk/dv.
TPU_CALLS_PER_CHECKPOINTED_SITE = 4
POLICIES = {
    "recompute everything": None,
    "dots without batch dims saved": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "named values saved": jax.checkpoint_policies.save_only_these_names("unused"),
}


def checkpointed_attention(w, x, policy=None):
    """Only the attention under jax.checkpoint: q, k, v projected outside it."""
    q, k, v = jnp.split((x @ w).reshape(B, L, 3 * H, D), 3, axis=2)
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                               implementation="xla")
    return jax.checkpoint(attend, policy=policy)(q, k, v)


def padded_attention(w, x, lengths):
    """Attention over keys below `lengths` [B], projected inside: under jax.checkpoint its
    body rebuilds the padding mask from the same lengths the forward read."""
    q, k, v = jnp.split((x @ w).reshape(B, L, 3 * H, D), 3, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    keep = jnp.arange(L)[None, None, None, :] < lengths[:, None, None, None]
    p = jax.nn.softmax(jnp.where(keep, s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


CHECKPOINTED = {
    "attention": (checkpointed_attention, ()),
    "whole layer": (jax.checkpoint(projected_attention), ()),
    **{f"layer, {name}": (jax.checkpoint(projected_attention, policy=policy), ())
       for name, policy in POLICIES.items() if policy is not None},
    "padded, lengths an argument": (jax.checkpoint(padded_attention), (jnp.array([L - 37]),)),
}


def recompute_calls(jaxpr) -> int:
    """Spliced recompute calls inside the program's checkpoint bodies."""
    return sum(str(e.params["jaxpr"]).count("name=hlotool_flash_recompute")
               for e in jaxpr.eqns if e.primitive.name in ("remat2", "checkpoint"))


@pytest.mark.parametrize("name", CHECKPOINTED)
@pytest.mark.sweep(keep=1)
def test_checkpointed_attention_recomputes_in_the_kernel(name):
    """The body jax.checkpoint writes rebuilds the scores and probabilities for the backward
    ([B, H, L, L] again) and never computes the output: it is replaced by the kernel's
    forward and backward, so neither direction holds a naive score matrix."""
    fn, rest = CHECKPOINTED[name]
    step = value_and_grad_step(fn)
    args = (qkv_weights(H), X, *rest)
    report = hlotool.explain(step, *args)
    assert (len(report.sites), report.rewritten) == (1, 1), str(report)
    assert "its backward under jax.checkpoint recomputes it in the kernel too" in \
        report.sites[0].reason
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
    traced = fast.trace(*args).jaxpr
    assert recompute_calls(traced.jaxpr) == 1
    assert not [e for e in naive_equations(traced.jaxpr)
                if e.primitive.name == "exp" and e.outvars[0].aval.shape[-2:] == (L, L)]
    assert tpu_custom_calls(step, *args) == TPU_CALLS_PER_CHECKPOINTED_SITE


def naive_equations(jaxpr):
    """The equations of `jaxpr` and of the bodies nested in it, outside the spliced calls."""
    for e in jaxpr.eqns:
        if str(e.params.get("name", "")).startswith("hlotool_flash"):
            continue
        yield e
        for sub in jaxcompat.jaxprs_in_params(e.params):
            yield from naive_equations(getattr(sub, "jaxpr", sub))


@pytest.mark.parametrize("policy", ["dots_saveable", "everything_saveable"])
def test_a_policy_that_saves_the_scores_keeps_the_site_native(policy):
    """Saved scores are read by the backward inside the checkpointed body, which the kernel
    cannot replace: native, with a reason that names a policy that works."""
    f = jax.checkpoint(projected_attention, policy=getattr(jax.checkpoint_policies, policy))
    step = value_and_grad_step(f)
    args = (qkv_weights(H), X)
    report = hlotool.explain(step, *args)
    (site,) = report.sites
    assert not site.rewritten
    assert "jax.checkpoint's policy saves" in site.reason
    assert "dots_with_no_batch_dims_saveable" in site.reason
    for g, want in zip(jax.tree.leaves(hlotool.flash_jit(step)(*args)),
                       jax.tree.leaves(jax.jit(step)(*args))):
        np.testing.assert_array_equal(g, want)


def test_a_checkpointed_body_computing_something_else_stays_native():
    """A program whose checkpointed body is not jax's recompute of the forward (here its
    causal mask is mirrored: `<=` where the forward has `>=`): the recompute matches the
    site's derivative in shape, but the mask it reads is not shown to be the forward's, so
    the body stays native and the gradients stay the program's own."""
    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        rows = jax.lax.broadcasted_iota(jnp.int32, (L, L), 0)
        cols = jax.lax.broadcasted_iota(jnp.int32, (L, L), 1)
        p = jax.nn.softmax(jnp.where(rows >= cols, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    def loss(q, k, v):
        return jnp.sum(jnp.sin(jax.checkpoint(attend)(q, k, v)))

    qkv = [jnp.asarray(np.random.default_rng(i).standard_normal((B, L, H, D)), jnp.float32)
           for i in range(3)]
    with jax.softmax_custom_jvp(False):  # jax.nn.softmax as plain operations, as hlotool reads it
        closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*qkv)
    (at,) = [i for i, e in enumerate(closed.jaxpr.eqns) if e.primitive.name in ("remat2",
                                                                               "checkpoint")]
    remat = closed.jaxpr.eqns[at]
    body = remat.params["jaxpr"]
    mirrored = [e.replace(primitive=jax.lax.le_p) if e.primitive is jax.lax.ge_p else e
                for e in body.eqns]
    assert mirrored != list(body.eqns)
    eqns = list(closed.jaxpr.eqns)
    eqns[at] = remat.replace(params={**remat.params, "jaxpr": body.replace(eqns=mirrored)})
    program = jaxcompat.jaxpr_as_fun(closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns)))

    report = hlotool.explain(program, *qkv)
    (site,) = report.sites
    assert site.rewritten  # the forward itself is the program's
    assert "its backward under jax.checkpoint stays native" in site.reason
    assert "not shown to hold the value the site reads" in site.reason
    fast = hlotool.flash_jit(program)
    assert recompute_calls(fast.trace(*qkv).jaxpr.jaxpr) == 0
    assert relative_error(fast(*qkv), jax.jit(program)(*qkv)) < 1e-5


# ----------------------------------------------------------------------------------------
# lax.scan over layers


def scanned_layers(remat: bool, dropout: bool = False, sinks: bool = False):
    """value_and_grad of a scan over 3 causal layers (the loop's fill and mask reach its
    body as loop-invariant operands), optionally each layer under jax.checkpoint, as
    flax's nn.scan(nn.remat(Block)) and maxtext write it; with `dropout`, flax's attention
    dropout on the probabilities, each layer drawing from its own key (scanned with its
    weights); with `sinks`, GPT-OSS's sink logit per head, learned with the layer's weights
    (the last H entries of its output projection's first row)."""
    def layer(x, w, key):
        length = x.shape[1]
        q, k, v = jnp.split((x @ w[0]).reshape(B, length, 3 * H, D), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
        if sinks:
            sink = jnp.broadcast_to(w[1][0, -H:].reshape(1, H, 1, 1), (B, H, length, 1))
            p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
        else:
            p = jax.nn.softmax(s, axis=-1)
        if dropout:
            keep = jax.random.bernoulli(key, 0.9, p.shape)
            p = p * (keep.astype(p.dtype) / jnp.asarray(0.9, p.dtype))
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, length, E)
        return x + jnp.tanh(o @ w[1][:, :E])

    body = jax.checkpoint(layer) if remat else layer

    def loss(ws, x):
        keys = jax.random.split(jax.random.key(7), ws.shape[0])
        y, _ = jax.lax.scan(lambda x, wk: (body(x, *wk), None), x, (ws, keys))
        return jnp.mean(jnp.sin(y))

    ws = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, E, 3 * E)) / 4,
                     jnp.float32)
    return jax.value_and_grad(loss), (ws, X)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.slow
def test_scan_over_checkpointed_layers_rewrites_both_loops(sinks):
    """The forward loop's site, and the backward loop's checkpointed body, which recomputes
    the layer (output included) beside its derivative: both in kernels."""
    step, args = scanned_layers(remat=True, sinks=sinks)
    report = hlotool.explain(step, *args)
    assert [(s.where, s.site.sinks, s.rewritten) for s in report.sites] == [
        ("scan.jaxpr", sinks, True), ("scan.jaxpr > remat2.jaxpr", sinks, True)], str(report)
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
    assert detect_jaxpr(fast.trace(*args).jaxpr) == []
    # The forward loop's kernel; in the backward loop's body: forward again, dq, dk/dv.
    assert tpu_custom_calls(step, *args) == 1 + TPU_CALLS_PER_SITE


def test_scan_over_checkpointed_layers_is_read_at_any_length():
    """At L = 16384 the loop-invariant fill ([B, H, L, L] broadcast) and mask are too large
    to fold: the loop bodies get the caller's expressions instead, and read them as the
    constant and the causal band they are."""
    step, (ws, _) = scanned_layers(remat=True)
    x = jax.ShapeDtypeStruct((B, 16384, E), jnp.float32)
    report = hlotool.explain(step, ws, x)
    assert [(s.where, s.site.mask, s.rewritten) for s in report.sites] == [
        ("scan.jaxpr", "causal", True), ("scan.jaxpr > remat2.jaxpr", "causal", True)], \
        str(report)


@pytest.mark.parametrize("dropout, sinks", [(False, False), (True, False), (False, True)],
                         ids=["plain", "dropout", "sinks"])
@pytest.mark.slow
def test_scan_over_layers_without_checkpoint_recomputes_in_the_backward_loop(dropout, sinks):
    """Without jax.checkpoint the forward loop saves the probabilities ([n, B, H, L, L]) for
    the backward loop, and with dropout its multiplier too. The rewrite saves q, k, v
    instead and recomputes the site in the backward loop, as jax.checkpoint would, the
    multiplier from the layer's key and the sink column from the layer's weights (saved,
    a [B, H, L, 1] column would not read as one logit per head): it then matches the site's
    derivative there, dropout and sinks included. Both loops hold kernels, no [L, L] value
    crosses between them, and the gradients are the program's."""
    step, args = scanned_layers(remat=False, dropout=dropout, sinks=sinks)
    report = hlotool.explain(step, *args)
    assert [(s.site.dropout, s.site.sinks) for s in report.sites] == [(dropout, sinks)] * 2, \
        str(report)
    assert [(s.where, s.rewritten) for s in report.sites] == [
        ("scan.jaxpr", True), ("scan.jaxpr", True)], str(report)
    assert "recomputed in the backward loop" in report.sites[1].reason
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
    traced = fast.trace(*args).jaxpr.jaxpr
    assert detect_jaxpr(fast.trace(*args).jaxpr) == []
    length = args[1].shape[1]

    def saved_scores(jaxpr):  # the forward loop's stacked outputs of shape [..., L, L]
        loops = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        assert len(loops) == 2
        return [v.aval.shape for v in loops[0].outvars if v.aval.shape[-2:] == (length, length)]

    assert saved_scores(jax.make_jaxpr(step)(*args).jaxpr)  # what the native program keeps
    assert saved_scores(traced) == []
    if dropout:  # the kernels draw the keep mask themselves, per tile, in both loops
        # (kernels/drawn.py). On TPU dropout_tpu pays in the forward loop; in the backward
        # loop, priced forward and backward at D = 8, it does not: native there.
        assert "threefry2x32" in str(traced)
        assert [s.kernels["tpu"] for s in report.sites] == ["dropout_tpu", None], str(report)
        assert report.sites[1].choices["tpu"].priced == "dropout_tpu"
        assert tpu_custom_calls(step, *args) == 1
        return
    # The forward loop's kernel; in the backward loop's body: forward again, dq, dk/dv.
    assert tpu_custom_calls(step, *args) == 1 + TPU_CALLS_PER_SITE
