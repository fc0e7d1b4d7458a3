"""Coverage of the attention pattern: every case runs through both front ends (jaxpr and HLO)
and must give exactly the expected sites."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from models.frontends import FRONTENDS, detect, tagged_line

B, L, H, D = 2, 8, 4, 16
LK = 12  # key length of cross attention

rng = np.random.default_rng(0)


def arr(*shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


Q, K, V = arr(B, L, H, D), arr(B, L, H, D), arr(B, L, H, D)  # [B, L, H, D]
QT, KT, VT = (x.transpose(0, 2, 1, 3) for x in (Q, K, V))  # [B, H, L, D]


def softmax_stable(x):
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def softmax_unstable(x):
    e = jnp.exp(x)
    return e / e.sum(-1, keepdims=True)


def softmax_reciprocal(x):
    e = jnp.exp(x - lax.stop_gradient(x.max(-1, keepdims=True)))
    return e * (1.0 / e.sum(-1, keepdims=True))


def attend(q, k, v, scale=None, softmax=jax.nn.softmax, bias=None, mask=None, fill=-jnp.inf):
    """[B, L, H, D] attention written with einsums."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # QK
    if scale is not None:
        s = s * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", softmax(s), v)


# ---------------------------------------------------------------------------------- scale


def scale_mul(q, k, v):
    return attend(q, k, v, scale=0.25)


def scale_div_sqrt(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])  # QK
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def scale_div_math(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)  # QK
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def scale_rsqrt_traced(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # QK
    s = s * lax.rsqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def scale_pow(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5  # QK
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def scale_none(q, k, v):
    return attend(q, k, v)


def prescaled_q(q, k, v):
    q = q / math.sqrt(D)
    return attend(q, k, v)


def prescaled_k(q, k, v):
    return attend(q, k * 0.25, v)


def prescaled_both(q, k, v):
    return attend(q * 0.5, k * 0.5, v)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fn, scale", [
    (scale_mul, 0.25), (scale_div_sqrt, 0.25), (scale_div_math, 0.25),
    (scale_rsqrt_traced, 0.25), (scale_pow, 0.25), (scale_none, None), (prescaled_q, 0.25),
    (prescaled_k, 0.25), (prescaled_both, 0.25),
])
def test_scale(fn, scale, frontend):
    (site,) = detect(fn, (Q, K, V), frontend)
    assert site.scale == (pytest.approx(scale) if scale is not None else None)
    assert (site.batch, site.q_len, site.kv_len, site.num_q_heads, site.head_dim) == (B, L, L, H, D)
    assert site.source == tagged_line(attend if fn in (scale_mul, scale_none, prescaled_q,
                                                       prescaled_k, prescaled_both) else fn)
    assert site.function == "fn" and site.mask == "none"


# ---------------------------------------------------------------------------------- masks


def causal_iota(q, k, v):
    i = lax.broadcasted_iota(jnp.int32, (L, L), 0)
    j = lax.broadcasted_iota(jnp.int32, (L, L), 1)
    return attend(q, k, v, scale=0.25, mask=i >= j)


def causal_tril_bool(q, k, v):
    return attend(q, k, v, mask=jnp.tril(jnp.ones((L, L), bool)), fill=jnp.finfo(jnp.float32).min)


def causal_tril_float(q, k, v):
    keep = jnp.tril(jnp.ones((L, L)))
    return attend(q, k, v, mask=keep == 1, fill=-1e9)


def causal_additive(q, k, v):
    bias = jnp.where(jnp.arange(L)[:, None] >= jnp.arange(L)[None, :], 0.0, -jnp.inf)
    return attend(q, k, v, bias=bias)


def causal_reversed_where(q, k, v):
    future = jnp.arange(L)[None, :] > jnp.arange(L)[:, None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # QK
    s = jnp.where(future, -1e30, s)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def anticausal(q, k, v):
    return attend(q, k, v, mask=jnp.triu(jnp.ones((L, L), bool)))


def alibi(q, k, v):
    slopes = 2.0 ** (-8.0 * (jnp.arange(H) + 1) / H)
    distance = jnp.arange(L)[None, :] - jnp.arange(L)[:, None]  # [Lq, Lk]: j - i
    return attend(q, k, v, scale=0.25, bias=slopes[:, None, None] * distance)


def alibi_causal(q, k, v):
    slopes = 2.0 ** (-8.0 * (jnp.arange(H) + 1) / H)
    distance = jnp.arange(L)[None, :] - jnp.arange(L)[:, None]
    bias = jnp.where(distance <= 0, slopes[:, None, None] * distance, -jnp.inf)
    return attend(q, k, v, scale=0.25, bias=bias)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fn, mask, mask_shape", [
    (causal_iota, "causal", None), (causal_tril_bool, "causal", None),
    (causal_tril_float, "causal", None), (causal_additive, "causal", None),
    (causal_reversed_where, "causal", None), (anticausal, "local", None),
    (alibi, "additive", (1, H, L, L)), (alibi_causal, "additive", (1, H, L, L)),
])
def test_constant_masks(fn, mask, mask_shape, frontend):
    (site,) = detect(fn, (Q, K, V), frontend)
    assert (site.mask, site.mask_shape) == (mask, mask_shape)
    assert site.causal == (mask == "causal")
    assert site.source == tagged_line(causal_reversed_where if fn is causal_reversed_where
                                      else attend)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bias_shape", [(L, L), (B, 1, 1, L), (B, H, L, L), (H, L, L), (L,)])
def test_additive_bias_any_broadcastable_shape(bias_shape, frontend):
    def biased(q, k, v, bias):
        return attend(q, k, v, scale=0.25, bias=bias)

    (site,) = detect(biased, (Q, K, V, arr(*bias_shape)), frontend)
    expected = (1,) * (4 - len(bias_shape)) + bias_shape
    assert (site.mask, site.mask_shape, site.scale) == ("additive", expected, 0.25)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fill", [-jnp.inf, float(jnp.finfo(jnp.float32).min), -1e9, -10000.0])
@pytest.mark.parametrize("mask_shape", [(B, 1, L, L), (L, L)])
def test_boolean_mask_fills(fill, mask_shape, frontend):
    def masked(q, k, v, mask):
        return attend(q, k, v, mask=mask, fill=fill)

    mask = jnp.asarray(rng.random(mask_shape) > 0.3)
    (site,) = detect(masked, (Q, K, V, mask), frontend)
    assert (site.mask, site.mask_shape) == ("boolean", (1,) * (4 - len(mask_shape)) + mask_shape)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_small_fill_is_a_soft_mask(frontend):
    """where(mask, s, -1) hides nothing: the site says so by its fill, which the lowering
    passes on exactly (or keeps native)."""
    def soft_masked(q, k, v, mask):
        return attend(q, k, v, mask=mask, fill=-1.0)

    (site,) = detect(soft_masked, (Q, K, V, jnp.ones((L, L), bool)), frontend)
    assert (site.mask, site.mask_fill) == ("boolean", -1.0)


def key_padding(q, k, v, lengths):
    valid = jnp.arange(L)[None, :] < lengths[:, None]  # [B, Lk]
    return attend(q, k, v, scale=0.25, mask=valid[:, None, None, :])


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_key_padding_mask_from_lengths(frontend):
    (site,) = detect(key_padding, (Q, K, V, jnp.array([5, 8])), frontend)
    assert (site.mask, site.mask_shape) == ("boolean", (B, 1, 1, L))


# -------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("softmax", [jax.nn.softmax, softmax_stable, softmax_unstable,
                                     softmax_reciprocal])
def test_softmax_forms(softmax, frontend):
    def fn(q, k, v):
        return attend(q, k, v, scale=0.25, softmax=softmax)

    (site,) = detect(fn, (Q, K, V), frontend)
    assert (site.scale, site.mask, site.softmax_dtype) == (0.25, "none", "float32")


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_upcast_softmax_in_low_precision_model(dtype, frontend):
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)  # QK
        p = jax.nn.softmax(s.astype(jnp.float32)).astype(dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    args = tuple(x.astype(dtype) for x in (Q, K, V))
    (site,) = detect(fn, args, frontend)
    name = jnp.dtype(dtype).name
    assert (site.dtype, site.softmax_dtype, site.scale) == (name, "float32", 0.25)
    assert site.score_bytes == B * H * L * L * 4


# -------------------------------------------------------------------------------- layouts


def bhld_matmul(q, k, v):
    s = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(D)  # QK
    return jax.nn.softmax(s, axis=-1) @ v


def keys_first_einsum(q, k, v):
    s = jnp.einsum("bkhd,bqhd->bhkq", k, q) * 0.25  # QK
    p = jax.nn.softmax(s, axis=-2)  # over k
    return jnp.einsum("bkhd,bhkq->bhqd", v, p)


def transposed_operands(q, k, v):
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))  # -> [B, H, L, D]
    s = jnp.matmul(qt, kt.transpose(0, 1, 3, 2)) * 0.25  # QK
    return jnp.matmul(jax.nn.softmax(s), vt).transpose(0, 2, 1, 3)


def merged_batch_heads(q, k, v):
    qm, km, vm = (x.transpose(0, 2, 1, 3).reshape(B * H, L, D) for x in (q, k, v))
    s = jnp.einsum("nqd,nkd->nqk", qm, km) * 0.25  # QK
    out = jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(s), vm)
    return out.reshape(B, H, L, D)


def no_batch(q, k, v):
    s = jnp.einsum("qhd,khd->hqk", q, k) * 0.25  # QK
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v)


def single_head(q, k, v):
    s = q @ k.T * 0.25  # QK
    return jax.nn.softmax(s) @ v


def extra_batch(q, k, v):
    s = jnp.einsum("xbqhd,xbkhd->xbhqk", q, k) * 0.25  # QK
    return jnp.einsum("xbhqk,xbkhd->xbqhd", jax.nn.softmax(s), v)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fn, args, layout, dims", [
    (bhld_matmul, (QT, KT, VT), "BHLD", (B, L, L, H, H, D)),
    (keys_first_einsum, (Q, K, V), "BLHD", (B, L, L, H, H, D)),
    (transposed_operands, (Q, K, V), "BLHD", (B, L, L, H, H, D)),
    (merged_batch_heads, (Q, K, V), "BLHD", (B, L, L, H, H, D)),
    (no_batch, (Q[0], K[0], V[0]), "LHD", (1, L, L, H, H, D)),
    (single_head, (Q[0, :, 0], K[0, :, 0], V[0, :, 0]), "LD", (1, L, L, 1, 1, D)),
    (extra_batch, (Q[None].repeat(3, 0), K[None].repeat(3, 0), V[None].repeat(3, 0)), "BBLHD",
     (3 * B, L, L, H, H, D)),
])
def test_layouts(fn, args, layout, dims, frontend):
    (site,) = detect(fn, args, frontend)
    got = (site.batch, site.q_len, site.kv_len, site.num_q_heads, site.num_kv_heads,
           site.head_dim)
    assert (site.layout, got) == (layout, dims)
    assert (site.q_shape, site.k_shape, site.v_shape) == tuple(a.shape for a in args)
    assert site.source == tagged_line(fn)


# --------------------------------------------------------------------------------- shapes


def cross(q, k, v):
    return attend(q, k, v, scale=0.25)


def gqa_repeat(q, k, v):
    k, v = jnp.repeat(k, H // 2, axis=2), jnp.repeat(v, H // 2, axis=2)
    return attend(q, k, v, scale=0.25)


def gqa_broadcast(q, k, v):
    g = H // 2

    def expand(x):
        b, l, hkv, d = x.shape
        return jnp.broadcast_to(x[:, :, :, None, :], (b, l, hkv, g, d)).reshape(b, l, hkv * g, d)

    return attend(q, expand(k), expand(v), scale=0.25)


def gqa_grouped_einsum(q, k, v):
    qg = q.reshape(B, L, 2, H // 2, D)  # [B, L, Hkv, G, D]
    s = jnp.einsum("bqngd,bknd->bngqk", qg, k) * 0.25  # QK
    out = jnp.einsum("bngqk,bknd->bqngd", jax.nn.softmax(s), v)
    return out.reshape(B, L, H, D)


def mqa_broadcast(q, k, v):
    return attend(q, jnp.broadcast_to(k, Q.shape), jnp.broadcast_to(v, Q.shape), scale=0.25)


def mqa_shared_kv(q, k, v):
    s = jnp.einsum("bqhd,bkd->bhqk", q, k) * 0.25  # QK
    return jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s), v)


def gqa_tile(q, k, v):
    k, v = jnp.tile(k, (1, 1, H // 2, 1)), jnp.tile(v, (1, 1, H // 2, 1))
    return attend(q, k, v, scale=0.25)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("fn, kv_shape, lk, hkv", [
    (cross, (B, LK, H, D), LK, H),
    (gqa_repeat, (B, L, 2, D), L, 2),
    (gqa_broadcast, (B, L, 2, D), L, 2),
    (gqa_grouped_einsum, (B, L, 2, D), L, 2),
    (mqa_broadcast, (B, L, 1, D), L, 1),
    (mqa_shared_kv, (B, L, D), L, 1),
    # A tiled repeat pairs query head h with kv head h % Hkv, not h // G: reported with the
    # tiled K/V as its operands, so the head counts stay honest.
    (gqa_tile, (B, L, 2, D), L, H),
])
def test_cross_gqa_mqa(fn, kv_shape, lk, hkv, frontend):
    (site,) = detect(fn, (Q, arr(*kv_shape), arr(*kv_shape)), frontend)
    assert (site.q_len, site.kv_len, site.num_q_heads, site.num_kv_heads) == (L, lk, H, hkv)
    assert site.score_bytes == B * H * L * lk * 4
    expected_kv = kv_shape if fn is not gqa_tile else (B, L, H, D)
    assert site.k_shape == site.v_shape == expected_kv
    assert site.source == tagged_line(fn if fn in (gqa_grouped_einsum, mqa_shared_kv) else attend)


# -------------------------------------------------------------------------------- context


def unbatched(q, k, v):
    """[L, H, D] attention, as equinox modules write it."""
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # QK
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_inside_vmap(frontend):
    (site,) = detect(jax.vmap(unbatched), (Q, K, V), frontend)
    assert (site.batch, site.num_q_heads, site.q_len, site.layout) == (B, H, L, "BLHD")
    assert site.source == tagged_line(unbatched)


def layers(x, weights):
    def layer(h, w):
        q, k, v = (jnp.einsum("bld,de->ble", h, w[i]).reshape(B, L, H, D) for i in range(3))
        out = attend(q, k, v, scale=0.25)
        return out.reshape(B, L, H * D), None

    return lax.scan(layer, x, weights)[0]


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_inside_scan_over_layers(frontend):
    args = (arr(B, L, H * D), arr(3, 3, H * D, H * D) / 8)
    (site,) = detect(layers, args, frontend)
    assert (site.batch, site.q_len, site.num_q_heads, site.head_dim) == (B, L, H, D)
    assert site.source == tagged_line(attend)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_under_checkpoint(frontend):
    fn = jax.checkpoint(causal_iota)
    (site,) = detect(fn, (Q, K, V), frontend)
    assert (site.mask, site.scale) == ("causal", 0.25)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_forward_pattern_inside_grad(frontend):
    def loss(q, k, v):
        return jnp.sum(causal_iota(q, k, v) ** 2)

    (site,) = detect(jax.grad(loss, argnums=(0, 1, 2)), (Q, K, V), frontend)
    assert (site.mask, site.scale, site.num_q_heads) == ("causal", 0.25, H)
    assert site.source == tagged_line(attend)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_two_layers_two_sites(frontend):
    def two(q, k, v):
        return attend(attend(q, k, v, scale=0.25), k, v, scale=0.5)

    sites = detect(two, (Q, K, V), frontend)
    assert [s.scale for s in sites] == [0.25, 0.5]


def test_hlo_site_inside_while_body_names_its_computation():
    from hlotool.hlo import parse_module
    from hlotool.passes.from_hlo import find_matches

    args = (arr(B, L, H * D), arr(3, 3, H * D, H * D) / 8)
    module = parse_module(jax.jit(layers).lower(*args).as_text(dialect="hlo")).inline_calls()
    (match,) = find_matches(module)
    (name,) = match.region
    whiles = [i for i in module.instructions() if i.opcode == "while"]
    assert any(name in w.called_computations for w in whiles)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("build", ["tril", "arange", "triu_hidden", "additive_inf"])
def test_causal_masks_are_read_from_their_structure_at_any_length(build, frontend):
    """At L = 8192 the [L, L] mask is past the folding limit: it is recognized from its
    iotas and compares, not from its values (which would be 67M elements)."""
    n = 8192
    x = jax.ShapeDtypeStruct((1, n, 2, 16), jnp.float32)

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        if build == "tril":
            s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
        elif build == "arange":
            s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(n)[:, None], s, -1e9)
        elif build == "triu_hidden":
            s = jnp.where(jnp.triu(jnp.ones((n, n), bool), 1), -1e9, s)
        else:
            s = s + jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], 0.0, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    (site,) = detect(fn, (x, x, x), frontend)
    assert (site.mask, site.mask_shape) == ("causal", None)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_shifted_diagonal_is_a_window_not_causal(frontend):
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((L, L), bool), 1), s, -jnp.inf)  # sees one key ahead
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    (site,) = detect(fn, (Q, K, V), frontend)
    assert (site.mask, site.window, site.mask_shape) == ("local", (None, 1), None)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_anticausal_is_a_window_open_to_the_right(frontend):
    (site,) = detect(anticausal, (Q, K, V), frontend)
    assert site.window == (0, None)
