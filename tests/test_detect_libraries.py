"""Attention layers of real libraries: exactly one site per layer, right shapes and mask kind,
through both front ends, with the source pointing at the user's call (not the library)."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models.frontends import FRONTENDS, detect, tagged_line

B, L, H, D = 2, 8, 4, 16
E = H * D
X = jnp.asarray(np.random.default_rng(2).standard_normal((B, L, E)), jnp.float32)


class TwoLinenLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.MultiHeadDotProductAttention(num_heads=H)(x, mask=nn.make_causal_mask(x[..., 0]))
        return nn.MultiHeadDotProductAttention(num_heads=H)(x)  # QK


def expect(site, mask, lk=L, hkv=H, d=D):
    assert (site.batch, site.q_len, site.kv_len) == (B, L, lk)
    assert (site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim) == (H, hkv, d, d)
    assert site.q_shape == (B, L, H, d) and site.layout == "BLHD"
    assert site.mask == mask and site.scale == pytest.approx(d**-0.5)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_flax_linen_multi_head_dot_product_attention(frontend):
    model = TwoLinenLayers()
    params = model.init(jax.random.key(0), X)

    def forward(params, x):
        return model.apply(params, x)

    first, second = detect(forward, (params, X), frontend)
    expect(first, "causal")
    expect(second, "none")
    call_line = tagged_line(TwoLinenLayers)
    assert second.source == call_line
    assert first.source.rsplit(":", 1)[1] == str(int(call_line.rsplit(":", 1)[1]) - 1)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_flax_nnx_multi_head_attention(frontend):
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=E, decode=False, rngs=nnx.Rngs(0))

    def forward(x):
        return layer(x, mask=nnx.make_causal_mask(x[..., 0]))  # QK

    (site,) = detect(forward, (X,), frontend)
    expect(site, "causal")
    assert site.source == tagged_line(forward)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_haiku_multi_head_attention(frontend):
    def layer(x):
        mha = hk.MultiHeadAttention(num_heads=H, key_size=D,
                                    w_init=hk.initializers.VarianceScaling())
        return mha(x, x, x, mask=jnp.tril(jnp.ones((1, 1, L, L))))  # QK

    f = hk.transform(layer)
    params = f.init(jax.random.key(0), X)

    def forward(params, x):
        return f.apply(params, None, x)

    (site,) = detect(forward, (params, X), frontend)
    expect(site, "causal")
    assert site.source == tagged_line(layer)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_equinox_multihead_attention_under_vmap(frontend):
    mha = eqx.nn.MultiheadAttention(num_heads=H, query_size=E, key=jax.random.key(0))

    def forward(x, y):
        return jax.vmap(lambda a, b: mha(a, b, b))(x, y)  # QK

    (site,) = detect(forward, (X, X[:, :6]), frontend)
    expect(site, "none", lk=6)
    assert site.source == tagged_line(forward)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("hkv", [H, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_nn_dot_product_attention_xla(hkv, causal, frontend):
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, L, hkv, D)), jnp.float32)

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")  # QK

    (site,) = detect(forward, (q, kv, kv), frontend)
    expect(site, "causal" if causal else "none", hkv=hkv)
    assert site.k_shape == (B, L, hkv, D)
    assert site.source == tagged_line(forward)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_jax_nn_dot_product_attention_bias_and_mask(frontend):
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, H, L, L)), jnp.float32)
    mask = jnp.asarray(rng.random((B, 1, L, L)) > 0.2)

    def with_bias(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    def with_mask(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

    (biased,) = detect(with_bias, (q, k, v, bias), frontend)
    (masked,) = detect(with_mask, (q, k, v, mask), frontend)
    assert biased.mask == "additive" and masked.mask == "boolean"


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_flax_linen_bfloat16_with_fp32_softmax(frontend):
    model = nn.MultiHeadDotProductAttention(num_heads=H, dtype=jnp.bfloat16,
                                           force_fp32_for_softmax=True)
    x = X.astype(jnp.bfloat16)
    params = model.init(jax.random.key(0), x)

    def forward(params, x):
        return model.apply(params, x)

    (site,) = detect(forward, (params, x), frontend)
    # The float32 probabilities multiply v promoted to float32: the value dot, and so the
    # kernel, computes in float32.
    assert (site.dtype, site.softmax_dtype, site.scale) == ("float32", "float32", 0.25)
    assert site.score_bytes == B * H * L * L * 4
