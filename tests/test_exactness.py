"""Issue 35's classes of silently wrong rewrites, each as a program: the rewrite keeps its
outputs and gradients, or the site stays native with a reason naming the construct, and no
exception escapes `flash_jit` or `explain`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlotool
from hlotool.kernels import get
from hlotool.passes.graph import Node, covers, fold
from hlotool.passes import masks

RNG = np.random.default_rng(0)


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.standard_normal(shape), dtype)


def attention(q, k, v, logits=lambda s: s, probs=lambda p: p):
    """[B, H, L, D] attention with hooks on the logits and the probabilities."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", probs(jax.nn.softmax(logits(s), axis=-1)), v)


def _fp8(x):
    return lax.reduce_precision(x, exponent_bits=4, mantissa_bits=3)


def _outputs_and_grads(fn, args):
    def loss(*xs):
        out = fn(*xs)
        weights = jax.random.normal(jax.random.PRNGKey(1), out.shape, jnp.float32)
        return jnp.sum(out.astype(jnp.float32) * weights), out
    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return [np.asarray(x, np.float64) for x in (out, *grads)]


def _assert_kept(fn, args, kernel="chunked", tolerance=1e-5):
    """flash_jit(fn) rewrites every site, with outputs and gradients equal to jax.jit's."""
    report = hlotool.explain(fn, *args, kernel=kernel)
    assert report.sites and report.rewritten == len(report.sites), str(report)
    got = _outputs_and_grads(hlotool.flash_jit(fn, kernel=kernel), args)
    want = _outputs_and_grads(fn, args)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        finite = np.isfinite(w)
        assert np.array_equal(np.isfinite(g)[finite], finite[finite]), name
        scale = max(float(np.max(np.abs(w[finite]), initial=0.0)), 1e-6)
        error = float(np.max(np.abs(g[finite] - w[finite]), initial=0.0)) / scale
        assert error <= tolerance, f"{name} off by {error:.3g}"


def _assert_native(fn, args, reason: str):
    report = hlotool.explain(fn, *args, kernel="chunked")
    assert report.sites and report.rewritten == 0, str(report)
    assert all(reason in s.reason for s in report.sites), str(report)
    # Left native, flash_jit is jax.jit's program.
    got = _outputs_and_grads(hlotool.flash_jit(fn, kernel="chunked"), args)
    for g, w in zip(got, _outputs_and_grads(fn, args)):
        np.testing.assert_array_equal(g, w)


Q, K, V = (_normal(1, 2, 48, 8) for _ in range(3))


# ------------------------------------------------------------------------------------------
# Ops on an operand stay in the program, before the kernel: it reads what the dot read


@pytest.mark.parametrize("which", "qkv")
@pytest.mark.parametrize("op", [
    pytest.param(lax.stop_gradient, id="stop_gradient"),
    pytest.param(_fp8, id="reduce_precision"),
    pytest.param(lambda x: (x * 16).astype(jnp.int8).astype(jnp.float32) / 16, id="int8 fake quant"),
    pytest.param(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), id="bfloat16 round trip"),
])
@pytest.mark.sweep(keep=3)
def test_an_op_on_an_operand_is_kept_before_the_kernel(which, op):
    def fn(q, k, v):
        named = {"q": q, "k": k, "v": v}
        named[which] = op(named[which])
        return attention(named["q"], named["k"], named["v"])
    _assert_kept(fn, (Q, K, V))


@pytest.mark.parametrize("where, op, reason", [
    ("logits", lax.stop_gradient, "lax.stop_gradient"),
    ("probs", lax.stop_gradient, "lax.stop_gradient"),
    ("logits", _fp8, "lax.reduce_precision"),
    ("probs", _fp8, "lax.reduce_precision"),
    ("logits", lambda s: s.astype(jnp.bfloat16).astype(jnp.float32),
     "a cast from float32 to bfloat16"),
    ("probs", lambda p: (p * 16).astype(jnp.int8).astype(jnp.float32) / 16,
     "a cast from float32 to int8"),
])
@pytest.mark.sweep(keep=2)
def test_an_op_inside_the_attention_that_changes_values_keeps_it_native(where, op, reason):
    def fn(q, k, v):
        return attention(q, k, v, **{where: op})
    _assert_native(fn, (Q, K, V), reason)


def test_the_shift_of_a_hand_written_softmax_may_be_cast_or_stopped():
    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        shift = lax.stop_gradient(_fp8(jnp.max(s, axis=-1, keepdims=True)))
        e = jnp.exp(s - shift)
        return jnp.einsum("bhqk,bhkd->bhqd", e / jnp.sum(e, axis=-1, keepdims=True), v)
    _assert_kept(fn, (Q, K, V))


def test_a_bfloat16_program_may_compute_its_softmax_in_float32_and_cast_back():
    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bhkd->bhqd", p, v)
    args = tuple(x.astype(jnp.bfloat16) for x in (Q, K, V))
    _assert_kept(fn, args, tolerance=2e-2)


# ------------------------------------------------------------------------------------------
# Mixed dtypes and custom derivative rules


@pytest.mark.parametrize("low", ["q", "kv"])
def test_mixed_operand_dtypes_compute_in_the_promoted_dtype(low):
    q, k, v = Q, K, V
    if low == "q":
        q = q.astype(jnp.bfloat16)
    else:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    assert hlotool.explain(attention, q, k, v, kernel="chunked").sites[0].site.dtype == "float32"
    _assert_kept(attention, (q, k, v))


@jax.custom_vjp
def _softmax_half_gradient(s):
    return jax.nn.softmax(s, axis=-1)


_softmax_half_gradient.defvjp(
    lambda s: (_softmax_half_gradient(s), s),
    lambda s, g: (jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), s)[1](g)[0] * 0.5,))


def test_a_softmax_with_its_own_derivative_rule_keeps_the_site_native():
    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        return jnp.einsum("bhqk,bhkd->bhqd", _softmax_half_gradient(s), v)
    _assert_native(fn, (Q, K, V), "inside a custom_vjp_call (_softmax_half_gradient")


def test_attention_inside_a_custom_vjp_keeps_the_users_rule():
    @jax.custom_vjp
    def whole(q, k, v):
        return attention(q, k, v)

    def bwd(res, g):
        return tuple(c * 0.5 for c in jax.vjp(attention, *res)[1](g))

    whole.defvjp(lambda *a: (attention(*a), a), bwd)
    _assert_kept(whole, (Q, K, V))


# ------------------------------------------------------------------------------------------
# Masks read as bands only where their arithmetic is exact


def _masked(mask_fn):
    def fn(q, k, v):
        return attention(q, k, v, logits=lambda s: jnp.where(
            mask_fn(s.shape[-2], s.shape[-1]), s, -jnp.inf))
    return fn


def test_a_window_over_uint32_positions_is_read_with_its_wrap():
    """`(i - j) < 3` wraps for j > i, hiding those keys: a causal window of 3, not `j > i - 3`."""
    def window(lq, lk):
        return (jnp.arange(lq, dtype=jnp.uint32)[:, None]
                - jnp.arange(lk, dtype=jnp.uint32)[None, :]) < 3
    (site,) = hlotool.explain(_masked(window), Q, K, V, kernel="chunked").sites
    assert site.site.window == (2, 0)
    _assert_kept(_masked(window), (Q, K, V))


def test_a_window_over_float_positions_is_read_as_its_values():
    """Rounding moves the edge of `i·0.1 - j·0.1 < 0.3`: the mask is the values it takes."""
    def window(lq, lk):
        i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
        return ((i * 0.1) - (j * 0.1) < 0.3) & (j <= i)
    (site,) = hlotool.explain(_masked(window), Q, K, V, kernel="chunked").sites
    assert site.site.window is None and site.site.mask == "boolean"
    _assert_kept(_masked(window), (Q, K, V))


def test_an_int32_window_is_still_a_band():
    def window(lq, lk):
        i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
        return ((i - j) < 3) & (j <= i)
    (site,) = hlotool.explain(_masked(window), Q, K, V, kernel="chunked").sites
    assert site.site.window == (2, 0)
    _assert_kept(_masked(window), (Q, K, V))


def _node(op, *inputs, shape, dtype, **params):
    return Node(op, tuple(inputs), shape, dtype, params)


def test_affine_forms_hold_only_values_their_dtype_holds():
    i = _node("iota", shape=(8, 8), dtype="uint32", dimension=0)
    j = _node("iota", shape=(8, 8), dtype="uint32", dimension=1)
    assert masks._eval(_node("sub", i, j, shape=(8, 8), dtype="uint32"), [64]) is None
    assert masks._eval(_node("sub", j, i, shape=(8, 8), dtype="int32"), [64]) is not None
    tenth = _node("constant", shape=(), dtype="float32", value=np.float32(0.1))
    fi = _node("iota", shape=(8, 8), dtype="float32", dimension=0)
    assert masks._eval(_node("mul", fi, tenth, shape=(8, 8), dtype="float32"), [64]) is None


def test_folding_divides_integers_as_xla_does():
    a = _node("constant", shape=(4,), dtype="int32", value=np.array([-7, 7, -1, 5], np.int32))
    b = _node("constant", shape=(), dtype="int32", value=np.int32(2))
    assert list(fold(_node("div", a, b, shape=(4,), dtype="int32"))) == [-3, 3, 0, 2]
    assert list(fold(_node("rem", a, b, shape=(4,), dtype="int32"))) == [-1, 1, -1, 1]


def test_covers_names_the_casts_that_keep_every_value():
    assert covers("float32", "bfloat16") and covers("float32", "float16")
    assert not covers("bfloat16", "float16") and not covers("float16", "bfloat16")
    assert covers("int32", "uint16") and not covers("int32", "uint32")
    assert covers("float32", "int16") and not covers("float32", "int32")


# ------------------------------------------------------------------------------------------
# Constructs that once raised, and gradients that once were wrong


_INT_MASK = jnp.asarray(RNG.integers(0, 2, (1, 1, 1, 48)), jnp.int32).at[..., 0].set(1)


@pytest.mark.parametrize("logits", [
    pytest.param(lambda s: jnp.where(_INT_MASK == 1, s, -1e9), id="where(m == 1, s, -1e9)"),
    pytest.param(lambda s: s + jnp.where(_INT_MASK.astype(bool).astype(jnp.int32) > 0, 0.0,
                                         jnp.finfo(jnp.float32).min),
                 id="Wav2Vec2: int mask cast to bool, select(m > 0, 0, finfo.min)"),
])
def test_integer_masks_are_read_not_raised_on(logits):
    def fn(q, k, v):
        return attention(q, k, v, logits=logits)
    _assert_kept(fn, (Q, K, V))


@pytest.mark.slow
def test_an_int_frame_mask_cast_to_bool_is_the_mask_it_makes():
    """Wav2Vec2's frame mask: an int argument cast to bool (x != 0, so -1 and 2 attend), then
    `select(m > 0, 0, finfo.min)`: read as the boolean the cast makes, not the int."""
    frames = jnp.asarray([[1, 2, -1, 0] * 12, [3, 0, 0, 1] * 12], jnp.int32)[:, None, None, :]

    def fn(q, k, v, m):
        keep = m.astype(bool)
        return attention(q, k, v, logits=lambda s: s + jnp.where(
            keep.astype(jnp.int32) > 0, 0.0, jnp.finfo(jnp.float32).min))
    q, k, v = (jnp.concatenate([x, x * 0.5]) for x in (Q, K, V))  # two rows, two masks
    _assert_kept(fn, (q, k, v, frames))
    # On TPU splash takes it, the frames as key padding (whether auto pays for it depends
    # on XLA:TPU's own fusion of this layout: asked by name here).
    x = jax.ShapeDtypeStruct((2, 2, 2048, 64), jnp.float32)
    m = jax.ShapeDtypeStruct((2, 1, 1, 2048), jnp.int32)
    (site,) = hlotool.explain(fn, x, x, x, m, kernel="splash_tpu").sites
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    exported = jax.export.export(hlotool.flash_jit(fn, kernel="splash_tpu"),
                                 platforms=["tpu"])(x, x, x, m)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 1


def test_a_window_bound_computed_in_the_program_is_read_as_its_values():
    def fn(q, k, v, c):
        i, j = jnp.arange(q.shape[2])[:, None], jnp.arange(k.shape[2])[None, :]
        visible = ((i - j) < 3 * c) & (j <= i)
        return attention(q, k, v, logits=lambda s: jnp.where(visible, s, -jnp.inf))
    report = hlotool.explain(fn, Q, K, V, jnp.int32(2), kernel="chunked")
    assert report.rewritten == 1, str(report)
    fast = hlotool.flash_jit(fn, kernel="chunked")
    np.testing.assert_allclose(fast(Q, K, V, jnp.int32(2)), jax.jit(fn)(Q, K, V, jnp.int32(2)),
                               atol=1e-6)


@pytest.mark.parametrize("lq, lk, kernel", [
    (1000, 1000, "chunked"), (7, 129, "chunked"), (129, 1000, "chunked"), (1, 1000, "chunked"),
    (1000, 1000, "auto"),  # auto keeps the shorter ones native on the CPU
])
@pytest.mark.sweep(keep=3)
def test_repeated_kv_heads_have_exact_gradients_at_ragged_lengths(lq, lk, kernel):
    q, k, v = _normal(1, 2, lq, 8), _normal(1, 1, lk, 8), _normal(1, 1, lk, 8)

    def fn(q, k, v):
        return attention(q, jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1))
    chunked = get("chunked")
    assert lk % chunked.block_k or lk < chunked.block_k  # ragged against the kernel's block
    _assert_kept(fn, (q, k, v), kernel=kernel)


@pytest.mark.slow
def test_a_nan_key_hidden_by_padding_under_a_soft_cap_has_a_zero_gradient():
    k = K.at[:, :, -1].set(jnp.nan)
    visible = (jnp.arange(48) < 47)[None, None, None, :]

    def fn(q, k, v):
        return attention(q, k, v, logits=lambda s: jnp.tanh(
            jnp.where(visible, s, -jnp.inf) / 5.0) * 5.0)
    _assert_kept(fn, (Q, k, V))
    dk = jax.grad(lambda k: jnp.sum(hlotool.flash_jit(fn, kernel="chunked")(Q, k, V)))(k)
    assert np.all(np.asarray(dk[:, :, -1]) == 0)


def test_no_exception_escapes_flash_jit_when_detection_fails(monkeypatch):
    from hlotool.passes import attention as pattern

    def broken(*args, **kwargs):
        raise ValueError("a bug of the detection")
    monkeypatch.setattr(pattern, "_describe", broken)
    with pytest.warns(UserWarning, match="attention detection failed"):
        out = hlotool.flash_jit(attention, kernel="chunked")(Q, K, V)
    np.testing.assert_array_equal(out, jax.jit(attention)(Q, K, V))
