"""flash_jit on train steps: programs that take their own gradient (`value_and_grad` inside,
as flax/optax, haiku, equinox and the example's train step do). Each site's forward and jax's
backward of it are replaced by a kernel's forward and backward (passes/backward.py): the loss
and every gradient equal jax.jit(step)'s, no naive site is left, and the TPU export holds a
forward and a backward kernel call (flash: fwd, dq, dkv) per site."""

from __future__ import annotations

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


def test_gradient_accumulation_loop():
    """The gradient taken in a scan over micro-batches: site and backward share the body."""
    def step(w, xs):
        def micro(total, x):
            value, grad = value_and_grad_step(projected_attention)(w, x[None])
            return total + grad, value
        return jax.lax.scan(micro, jnp.zeros_like(w), xs)

    check_step(step, (qkv_weights(H), jnp.concatenate([X, 2 * X])), sites=1)


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
