"""Programs that look like attention but are not: no site may be reported, by either front end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models.frontends import FRONTENDS, detect

B, L, H, D = 2, 8, 4, 16
rng = np.random.default_rng(1)
Q, K, V = (jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32) for _ in range(3))


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25


def softmax_over_queries(q, k, v):
    p = jax.nn.softmax(scores(q, k), axis=-2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def softmax_over_heads(q, k, v):
    p = jax.nn.softmax(scores(q, k), axis=1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def contraction_over_queries(q, k, v):
    p = jax.nn.softmax(scores(q, k), axis=-1)
    return jnp.einsum("bhqk,bqhd->bkhd", p, v)


def contraction_over_keys_and_queries(q, k, v):
    p = jax.nn.softmax(scores(q, k), axis=-1)
    return jnp.einsum("bhqk,bqhd->bhd", p, v)


def linear_attention(q, k, v):
    phi_q, phi_k = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
    kv = jnp.einsum("bkhd,bkhe->bhde", phi_k, v)
    z = 1 / jnp.einsum("bqhd,bhd->bqh", phi_q, phi_k.sum(1))
    return jnp.einsum("bqhd,bhde,bqh->bqhe", phi_q, kv, z)


def linear_attention_quadratic(q, k, v):
    s = scores(q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", s / s.sum(-1, keepdims=True), v)


def sigmoid_attention(q, k, v):
    p = jax.nn.sigmoid(scores(q, k) - jnp.log(L))
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def log_softmax_attention(q, k, v):
    p = jax.nn.log_softmax(scores(q, k), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def exp_without_normalization(q, k, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(scores(q, k)), v)


def normalized_by_other_axis(q, k, v):
    e = jnp.exp(scores(q, k))
    return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-2, keepdims=True), v)


def max_over_other_axis(q, k, v):
    s = scores(q, k)
    e = jnp.exp(s - s.max(-2, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)


def router_top_k(x, w_router, experts):
    """A mixture-of-experts router: softmax over experts, then top-k, then a combine."""
    probs = jax.nn.softmax(x @ w_router, axis=-1)  # [T, E]
    weights, index = jax.lax.top_k(probs, 2)  # [T, 2]
    chosen = experts[index]  # [T, 2, Dout]
    return jnp.einsum("tk,tkd->td", weights, chosen)


CASES = [
    (softmax_over_queries, (Q, K, V)), (softmax_over_heads, (Q, K, V)),
    (contraction_over_queries, (Q, K, V)), (contraction_over_keys_and_queries, (Q, K, V)),
    (linear_attention, (Q, K, V)), (linear_attention_quadratic, (Q, K, V)),
    (sigmoid_attention, (Q, K, V)), (log_softmax_attention, (Q, K, V)),
    (exp_without_normalization, (Q, K, V)), (normalized_by_other_axis, (Q, K, V)),
    (max_over_other_axis, (Q, K, V)),
    (router_top_k, (jnp.ones((L, D)), jnp.ones((D, 6)), jnp.ones((6, D)))),
]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fn, args", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_not_attention(fn, args, frontend):
    assert detect(fn, args, frontend) == []


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_negatives_beside_a_real_site_leave_only_it(frontend):
    """The matcher must not be fooled by neighbours: one true site among the negatives."""

    def mixed(q, k, v):
        real = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores(q, k)), v)
        return real + softmax_over_queries(q, k, v) + log_softmax_attention(q, k, v)

    (site,) = detect(mixed, (Q, K, V), frontend)
    assert (site.scale, site.q_len, site.num_q_heads) == (0.25, L, H)
