"""Near misses: almost-attention that is not detected says why, in both front ends and in
`hlotool inspect --why-not`."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from hlotool.cli import cli
from hlotool.passes.from_hlo import detect_hlo, near_misses_hlo
from hlotool.passes.from_jaxpr import detect_jaxpr, near_misses_jaxpr

B, L, H, D = 1, 64, 2, 16
rng = np.random.default_rng(3)
Q = jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32)
MASK = jnp.asarray(rng.random((B, 1, L, L)) > 0.3)


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25


def values(p, v):
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def post_softmax_where_half(q, k, v, m):
    return values(jnp.where(m, jax.nn.softmax(scores(q, k)), 0.5), v)


def floor_capped(q, k, v, m):
    return values(jax.nn.softmax(jnp.floor(scores(q, k) / 50.0) * 50.0), v)


def two_sink_columns(q, k, v, m):
    s = jnp.concatenate([scores(q, k), jnp.zeros((B, H, L, 2))], axis=-1)
    return values(jax.nn.softmax(s)[..., :-2], v)


def sink_first(q, k, v, m):
    s = jnp.concatenate([scores(q, k), jnp.zeros((B, H, L, 1))], axis=-1)
    return values(jax.nn.softmax(s)[..., 1:], v)


def mask_after_sinks(q, k, v, m):
    s = jnp.concatenate([scores(q, k), jnp.zeros((B, H, L, 1))], axis=-1)
    s = jnp.where(jnp.concatenate([m, jnp.ones((B, 1, L, 1), bool)], axis=-1), s, -1e9)
    return values(jax.nn.softmax(s)[..., :-1], v)


def shift_by_a_column_max(q, k, v, m):
    s = scores(q, k)
    return values(jax.nn.softmax(s - jax.lax.stop_gradient(s.max(-2, keepdims=True))), v)


def head_mask(q, k, v, m):
    return values(jnp.einsum("bhqk,h->bhqk", jax.nn.softmax(scores(q, k)), jnp.ones(H)), v)


def dropout(q, k, v, m):
    p = jax.nn.softmax(scores(q, k))
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.9, p.shape)
    return values(p * keep / 0.9, v)


def softmax_over_queries(q, k, v, m):
    return values(jax.nn.softmax(scores(q, k), axis=-2), v)


def zeroed_probabilities(q, k, v, m):
    return values(jax.nn.softmax(scores(q, k)) * 0.0, v)


def data_fill(q, k, v, m):
    return values(jax.nn.softmax(jnp.where(m, scores(q, k), q[..., :1].mean())), v)


CASES = [
    (post_softmax_where_half, "a where() after the softmax that does not zero what it drops"),
    (floor_capped, "a floor between the scores and the softmax"),
    (two_sink_columns, "a concatenate between the scores and the softmax that adds other "
                       "than one logit column along the keys"),
    (sink_first, "the slice after the softmax keeps other than the keys before the sink "
                 "column"),
    (mask_after_sinks, "a mask step after the sink column is concatenated"),
    (shift_by_a_column_max, "the logits are shifted by a max over other axes than the keys"),
    (softmax_over_queries, "the second dot does not contract the key axis the softmax runs "
                           "over"),
    (zeroed_probabilities, "a scale by 0 after the softmax (the output is not the "
                           "probabilities' weighted values scaled by it)"),
    (data_fill, "a where() between the scores and the softmax whose fill is not a constant"),
]


@pytest.mark.parametrize("fn, reason", CASES, ids=[fn.__name__ for fn, _ in CASES])
def test_each_near_miss_names_the_first_rule_it_breaks(fn, reason):
    args = (Q, Q, Q, MASK)
    closed = jax.make_jaxpr(fn)(*args)
    assert detect_jaxpr(closed) == []
    (miss,) = near_misses_jaxpr(closed, fn.__name__)
    assert (miss.function, miss.reason) == (fn.__name__, reason)
    assert miss.source.endswith("test_near_miss.py:" + miss.source.rsplit(":", 1)[1])
    hlo = jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True)
    assert detect_hlo(hlo) == []
    (miss,) = near_misses_hlo(hlo, fn.__name__)
    assert miss.reason == reason


def test_dropout_then_a_constant_scale_is_a_site_whose_output_takes_the_scale():
    """`p * keep / 0.9`: the multiplication by the keep mask is dropout, and the division by
    a constant after it is a factor the kernel's output takes (HF and flax write
    `p * (keep / keep_prob)`, Keras `where(keep, p / keep_prob, 0)`)."""
    closed = jax.make_jaxpr(dropout)(Q, Q, Q, MASK)
    (site,) = detect_jaxpr(closed)
    assert site.site.dropout and site.site.out_scale == pytest.approx(1 / 0.9)
    assert near_misses_jaxpr(closed) == []
    (from_hlo,) = detect_hlo(jax.jit(dropout).lower(Q, Q, Q, MASK).as_text(dialect="hlo"))
    assert from_hlo.dropout and from_hlo.out_scale == pytest.approx(1 / 0.9)


def dropout_as_flax_writes_it(q, k, v, m):
    p = jax.nn.softmax(scores(q, k))
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.9, p.shape)
    return values(p * (keep.astype(p.dtype) / jnp.asarray(0.9, p.dtype)), v)


def noise(q, k, v, m):
    """Gaussian noise on the probabilities: no scaled boolean, no gradient-free multiplier."""
    p = jax.nn.softmax(scores(q, k))
    return values(p * jax.random.normal(jax.random.PRNGKey(0), p.shape), v)


def test_dropout_as_flax_writes_it_is_a_site_and_noise_is_not():
    (site,) = detect_jaxpr(jax.make_jaxpr(dropout_as_flax_writes_it)(Q, Q, Q, MASK))
    assert site.site.dropout and "dropout" in site.site.variants
    (from_hlo,) = detect_hlo(jax.jit(dropout_as_flax_writes_it).lower(Q, Q, Q, MASK).as_text(
        dialect="hlo"))
    assert from_hlo.dropout
    assert detect_jaxpr(jax.make_jaxpr(noise)(Q, Q, Q, MASK)) == []
    (miss,) = near_misses_jaxpr(jax.make_jaxpr(noise)(Q, Q, Q, MASK))
    assert miss.reason == ("random values multiply the probabilities (not dropout's keep / "
                           "keep_prob)")


def test_a_head_mask_is_no_near_miss_but_a_site():
    closed = jax.make_jaxpr(head_mask)(Q, Q, Q, MASK)
    (site,) = detect_jaxpr(closed)
    assert site.site.multiplier_shape is None  # all ones: the identity
    assert near_misses_jaxpr(closed) == []


def test_attention_and_unrelated_exps_are_no_near_misses():
    def attention(q, k, v, m):
        return values(jax.nn.softmax(jnp.where(m, scores(q, k), -1e9)), v)

    def gelu_mlp(x, w):
        return jax.nn.gelu(x @ w, approximate=False) @ w.T

    closed = jax.make_jaxpr(attention)(Q, Q, Q, MASK)
    assert len(detect_jaxpr(closed)) == 1 and near_misses_jaxpr(closed) == []
    x = jnp.ones((8, 16))
    assert near_misses_jaxpr(jax.make_jaxpr(gelu_mlp)(x, jnp.ones((16, 32)))) == []


def test_inspect_why_not_lists_them_in_the_table_and_json(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp
        x = jnp.ones((1, 64, 2, 16))
        @jax.jit
        def capped(q, k, v):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.floor(s / 30) * 30), v)
        capped(x, x, x)
    """))
    result = CliRunner().invoke(cli, ["inspect", str(script), "--why-not"])
    assert result.exit_code == 0, result.output
    assert "1 near miss (almost attention, not detected)" in result.output
    assert "a floor between the scores and the softmax" in result.output
    result = CliRunner().invoke(cli, ["inspect", str(script), "--why-not", "--json"])
    doc = json.loads(result.stdout)
    assert doc["sites"] == [] and doc["near_misses"] == [{
        "function": "capped", "source": f"{script}:7",
        "reason": "a floor between the scores and the softmax"}]
    plain = CliRunner().invoke(cli, ["inspect", str(script), "--json"])
    assert "near_misses" not in json.loads(plain.stdout)


def loss_head(x, w, targets):
    """A language model's loss: logits by a dot, a slice, log_softmax; its gradient puts a
    dot after the exp (two dots around an exp, but no softmax between them)."""
    logp = jax.nn.log_softmax((x @ w)[:, :-1])
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def test_a_log_softmax_loss_head_is_no_near_miss():
    x, w = jnp.ones((2, 8, 16)), jnp.ones((16, 32))
    targets = jnp.zeros((2, 7), jnp.int32)
    train = jax.grad(loss_head, argnums=(0, 1))
    assert near_misses_jaxpr(jax.make_jaxpr(train)(x, w, targets)) == []
    hlo = jax.jit(train).lower(x, w, targets).as_text(dialect="hlo", debug_info=True)
    assert near_misses_hlo(hlo) == []
