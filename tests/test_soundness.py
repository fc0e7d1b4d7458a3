"""Never silently wrong: each rewrite keeps the program's meaning, or the site stays native with
the reason. One regression test per case a user found (issue "Never silently wrong")."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import hlotool
from hlotool.kernels.base import hiding_is_exact, make_call
from hlotool.kernels.chunked import Chunked
from hlotool.kernels.reference import Reference

B, L, H, D = 1, 256, 2, 16
rng = np.random.default_rng(11)
F32_MIN = float(jnp.finfo(jnp.float32).min)


def arr(*shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


Q, K, V = arr(B, L, H, D), arr(B, L, H, D), arr(B, L, H, D)


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k)


def attend(s, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fine = np.isfinite(want)
    assert not np.any(~np.isfinite(got) & fine), "non-finite where jax.jit is finite"
    return float(np.max(np.abs(got[fine] - want[fine])) / max(np.max(np.abs(want[fine])), 1e-30))


def grads(fn, *args, argnums=(0, 1, 2)):
    cot = jnp.asarray(np.random.default_rng(0).standard_normal(fn(*args).shape), jnp.float32)
    return jax.grad(lambda *a: jnp.sum(fn(*a) * cot), argnums=argnums)(*args)


def assert_same(fn, *args, kernel="chunked", argnums=(0, 1, 2), tol=1e-5):
    fast = hlotool.flash_jit(fn, kernel=kernel)
    assert rel(fast(*args), jax.jit(fn)(*args)) < tol
    for got, want in zip(grads(fast, *args, argnums=argnums),
                         grads(jax.jit(fn), *args, argnums=argnums)):
        assert rel(got, want) < tol
    assert "hlotool_flash" in fast.lower(*args).as_text()


# ---------------------------------------------------------------------- mask, then a temperature


def mask_then_temperature(q, k, v, m):
    return attend(jnp.where(m, scores(q, k), -1e4) * 1e-4, v)


def causal_then_scale(q, k, v):
    return attend(jnp.where(jnp.tril(jnp.ones((L, L), bool)), scores(q, k), -1e4) * 1e-3, v)


def test_fill_is_read_after_the_steps_that_follow_it():
    m = jnp.asarray(rng.random((B, 1, L, L)) > 0.5)
    (site,) = hlotool.explain(mask_then_temperature, Q, K, V, m).sites
    assert site.site.mask == "boolean" and site.site.mask_fill == pytest.approx(-1.0)
    assert_same(mask_then_temperature, Q, K, V, m)
    (site,) = hlotool.explain(causal_then_scale, Q, K, V).sites
    assert site.site.mask == "causal" and site.site.mask_fill == pytest.approx(-10.0)
    assert_same(causal_then_scale, Q, K, V)


def test_a_fill_that_overflows_between_two_scale_steps_stays_native():
    """finfo.min / 1e-6 is -inf in float32, but XLA folds `/ 1e-6 * 1e-6` into one scaling
    and keeps it finite: which of the two a hidden key gets is the compiler's choice, so the
    site stays native. Overflowing at the last step is -inf whatever XLA does: rewritten."""
    low = float(jnp.finfo(jnp.float32).min)

    def folded(q, k, v, m):
        return attend(jnp.where(m, scores(q, k), low) / 1e-6 * 1e-6, v)

    def last(q, k, v, m):
        return attend(jnp.where(m, scores(q, k), low) * 2.0, v)

    m = jnp.asarray(rng.random((B, 1, L, L)) > 0.5).at[:, :, 0, :].set(False)
    (site,) = hlotool.explain(folded, Q, K, V, m).sites
    assert not site.rewritten and "compiler's choice" in site.reason
    fast = hlotool.flash_jit(folded, kernel="chunked")
    assert "hlotool_flash" not in fast.lower(Q, K, V, m).as_text()
    seen = m.at[:, :, :, 0].set(True)  # every row sees a key: no NaN row at -inf
    (site,) = hlotool.explain(last, Q, K, V, seen).sites
    assert site.site.mask_fill == -math.inf and not site.blocker
    assert_same(last, Q, K, V, seen)


def test_auto_at_length_2048_is_exact_and_tpu_flash_refuses_the_soft_mask():
    q, k, v = arr(1, 2048, 2, 16), arr(1, 2048, 2, 16), arr(1, 2048, 2, 16)
    m = jnp.asarray(rng.random((1, 1, 2048, 2048)) > 0.5)
    (site,) = hlotool.explain(mask_then_temperature, q, k, v, m).sites
    assert site.kernels["tpu"] != "pallas_tpu"
    fast = hlotool.flash_jit(mask_then_temperature)
    assert rel(fast(q, k, v, m), jax.jit(mask_then_temperature)(q, k, v, m)) < 1e-5


@pytest.mark.parametrize("dtype, fill, hidden", [
    (jnp.float16, -1e9, -math.inf),  # -1e9 is -inf in float16: a hard mask after all
    (jnp.bfloat16, -1e9, float(np.asarray(-1e9, jnp.bfloat16))),
    (jnp.float32, -1e4, -1e4),
])
def test_fill_is_rounded_to_the_programs_dtype(dtype, fill, hidden):
    def masked(q, k, v, m):
        return attend(jnp.where(m, scores(q, k), fill), v)

    q, k, v = (x.astype(dtype) for x in (Q, K, V))
    m = jnp.asarray(rng.random((B, 1, L, L)) > 0.5)
    (site,) = hlotool.explain(masked, q, k, v, m).sites
    assert site.site.mask_fill == hidden
    got = hlotool.flash_jit(masked, kernel="chunked")(q, k, v, m)
    assert rel(got, jax.jit(masked)(q, k, v, m)) < (2e-3 if dtype == jnp.float16 else 2e-2
                                                    if dtype == jnp.bfloat16 else 1e-5)


# ---------------------------------------------------------------------- chains with no kernel form


def bias_after_soft_mask(q, k, v, m, b):
    return attend(jnp.where(m, scores(q, k), -1e4) + b, v)


def two_fills(q, k, v, m):
    s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), scores(q, k), -1e9)
    return attend(jnp.where(m, s, -jnp.inf), v)


def negative_scale_after_mask(q, k, v, m):
    return attend(jnp.where(m, scores(q, k), -jnp.inf) * -1.0, v)


@pytest.mark.parametrize("fn, reason", [
    (bias_after_soft_mask, "a bias is added after a mask whose hidden keys keep the finite "
                           "logit -10000"),
    (two_fills, "the masks leave hidden keys different logits (-inf, -1e+09)"),
    (negative_scale_after_mask, "hidden keys end with logit inf"),
])
def test_chains_without_a_kernel_form_stay_native_with_the_reason(fn, reason):
    m = jnp.asarray(rng.random((B, 1, L, L)) > 0.5)
    args = (Q, K, V, m) + ((arr(1, 1, L, L),) if fn is bias_after_soft_mask else ())
    (site,) = hlotool.explain(fn, *args, kernel="chunked").sites
    assert not site.rewritten and site.reason.startswith(reason)
    assert "hlotool_flash" not in hlotool.flash_jit(fn, kernel="chunked").lower(*args).as_text()


def test_additive_causal_constant_hides_keys_only_when_it_ends_minus_inf():
    tri = jnp.tril(jnp.ones((L, L), bool))

    def additive(value):
        def fn(q, k, v):
            return attend(scores(q, k) * 0.25 + jnp.where(tri, 0.0, value), v)
        return fn

    hard, soft = additive(-jnp.inf), additive(-1e4)
    assert hlotool.explain(hard, Q, K, V).sites[0].site.mask == "causal"
    (site,) = hlotool.explain(soft, Q, K, V).sites
    assert site.site.mask == "additive"  # s - 1e4 still depends on s: an exact bias
    assert_same(hard, Q, K, V)
    assert_same(soft, Q, K, V)


# ---------------------------------------------------------------------- head masks


def head_masked(q, k, v, m):
    """Hugging Face Flax BERT's form: einsum("...hqk,h->...hqk", probs, head_mask)."""
    p = jnp.einsum("...hqk,h->...hqk", jax.nn.softmax(scores(q, k) * 0.25), m)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.slow
def test_a_head_mask_is_the_identity_when_all_ones_and_a_factor_of_the_output_otherwise():
    ones = jnp.ones(H)
    (site,) = hlotool.explain(head_masked, Q, K, V, ones).sites
    assert site.site.multiplier_shape == (H, 1, 1, 1)  # an argument: not known to be ones
    assert_same(head_masked, Q, K, V, jnp.asarray([0.5, 0.0]), argnums=(0, 1, 2, 3))

    def constant_ones(q, k, v):
        return head_masked(q, k, v, jnp.ones(H))

    (site,) = hlotool.explain(constant_ones, Q, K, V).sites
    assert site.site.multiplier_shape is None
    assert_same(constant_ones, Q, K, V)


def test_merged_batch_and_heads_of_equal_size_keep_their_order_through_a_transpose():
    """[B·H, L, D] scores split back to [B, H, L, L], then a head mask einsum puts H first:
    with B == H only the split order tells which axis is which (the fuzz found this)."""
    q, k, v = arr(2, 16, 2, 8), arr(2, 16, 2, 8), arr(2, 16, 2, 8)

    def merged(q, k, v, m):
        qm, km, vm = (x.transpose(0, 2, 1, 3).reshape(4, 16, 8) for x in (q, k, v))
        s = jnp.einsum("nqd,nkd->nqk", qm, km).reshape(2, 2, 16, 16) * 0.5
        p = jnp.einsum("...hqk,h->...hqk", jax.nn.softmax(s), m).reshape(4, 16, 16)
        return jnp.einsum("nqk,nkd->nqd", p, vm).reshape(2, 2, 16, 8)

    assert_same(merged, q, k, v, jnp.asarray([1.4, 0.6]), argnums=(0, 1, 2, 3))


def test_a_factor_that_varies_along_the_keys_is_refused():
    def dropout_like(q, k, v, keep):
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores(q, k)) * keep, v)

    keep = jnp.asarray(rng.random((B, H, L, L)) > 0.1, jnp.float32)
    assert hlotool.explain(dropout_like, Q, K, V, keep).sites == ()


# ---------------------------------------------------------------------- fully masked rows


def _conventions():
    """(name, mask kind, function of (q, k, v, operand), operand, rows the program empties)."""
    empty = jnp.ones((B, 1, L, L), bool).at[:, :, 7].set(False).at[:, :, 100].set(False)
    tri = jnp.tril(jnp.ones((L, L), bool))
    lengths = jnp.array([0])
    cases = []
    for fill_name, fill in (("-inf", -jnp.inf), ("finfo.min", F32_MIN), ("-1e9", -1e9)):
        cases.append((f"boolean {fill_name}", empty,
                      lambda q, k, v, m, fill=fill: attend(jnp.where(m, scores(q, k), fill), v)))
        cases.append((f"causal+boolean {fill_name}", empty,
                      lambda q, k, v, m, fill=fill: attend(
                          jnp.where(m & tri, scores(q, k), fill), v)))
        cases.append((f"additive {fill_name}", jnp.where(empty, 0.0, fill),
                      lambda q, k, v, b: attend(scores(q, k) * 0.25 + b, v)))
        cases.append((f"key lengths 0 {fill_name}", lengths,
                      lambda q, k, v, n, fill=fill: attend(jnp.where(
                          (jnp.arange(L) < n[:, None])[:, None, None, :], scores(q, k), fill),
                          v)))
    return cases


@pytest.mark.parametrize("name, operand, fn", _conventions(), ids=lambda x: x if isinstance(
    x, str) else "")
@pytest.mark.sweep(keep=4)
def test_rows_with_no_visible_key_equal_the_naive_program(name, operand, fn):
    """finfo.min and -1e9 give such a row the mean of v (every logit equal), forward and every
    gradient; -inf gives NaN in the naive program, and the rewrite returns that NaN too (its
    gradients are finite where the naive ones are NaN)."""
    argnums = (0, 1, 2, 3) if operand.dtype == jnp.float32 else (0, 1, 2)
    fast = hlotool.flash_jit(fn, kernel="chunked")
    got, want = fast(Q, K, V, operand), jax.jit(fn)(Q, K, V, operand)
    assert "hlotool_flash" in fast.lower(Q, K, V, operand).as_text()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert rel(jnp.nan_to_num(got), jnp.nan_to_num(want)) < 1e-5
    if "-inf" in name:
        assert bool(jnp.isnan(want).any())
        for g in grads(fast, Q, K, V, operand, argnums=argnums):
            assert np.isfinite(np.asarray(g)).all()
        return
    for g, w in zip(grads(fast, Q, K, V, operand, argnums=argnums),
                    grads(jax.jit(fn), Q, K, V, operand, argnums=argnums)):
        assert rel(g, w) < 1e-5


def test_padded_row_gradient_beside_a_finfo_min_bias():
    """The user's case: an additive finfo.min padding bias with one query row fully padded.
    The log-sum-exp of that row absorbed log(Lk): its dq was 8.1 against 0.81."""
    bias = jnp.where(jnp.asarray(rng.random((B, 1, L, L)) > 0.3), 0.0, F32_MIN)
    bias = bias.at[:, :, 5, :].set(F32_MIN)

    def padded(q, k, v, b):
        return attend(scores(q, k) / math.sqrt(D) + b, v)

    assert_same(padded, Q, K, V, bias, argnums=(0, 1, 2, 3))


# ---------------------------------------------------------------------- kernels hide keys exactly


@pytest.mark.parametrize("fill", [-math.inf, -1e4, -3.0])
@pytest.mark.parametrize("blocks", [(16, 16), (32, 8)])
@pytest.mark.sweep(keep=2)
def test_chunked_skips_causal_blocks_and_stays_exact_with_a_finite_fill(fill, blocks):
    q, k, v = arr(1, 96, 2, 8), arr(1, 96, 2, 8), arr(1, 96, 2, 8)
    kw = dict(scale=0.5, causal=True, fill=fill)

    cot = arr(1, 96, 2, 8)

    def value_and_grads(kernel):
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, **kw), q, k, v)
        return out, vjp(cot)

    got, want = value_and_grads(Chunked(*blocks)), value_and_grads(Reference())
    assert rel(got[0], want[0]) < 1e-5
    for g, w in zip(got[1], want[1]):
        assert rel(g, w) < 1e-5


@pytest.mark.parametrize("window", [(None, 0), (20, 0), (7, 0), (30, 9), (None, 40), (3, 3)])
@pytest.mark.parametrize("fill", [-math.inf, -3.0])
@pytest.mark.slow
def test_chunked_applies_the_band_on_edge_tiles_only_and_stays_exact(window, fill):
    """Tiles wholly inside the band skip its mask; lengths that are no block multiple, bands
    narrower and wider than a block, and GQA, against the reference."""
    q, cot = arr(1, 83, 4, 8), arr(1, 83, 4, 8)
    k, v = arr(1, 83, 2, 8), arr(1, 83, 2, 8)
    causal, window = window[1] == 0, window
    kw = dict(scale=0.5, causal=causal, window=window, fill=fill)

    def value_and_grads(kernel):
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, **kw), q, k, v)
        return out, vjp(cot)

    want = value_and_grads(Reference())
    for blocks in ((16, 8), (8, 16), (24, 24)):
        got = value_and_grads(Chunked(*blocks))
        assert rel(got[0], want[0]) < 1e-5, blocks
        for g, w in zip(got[1], want[1]):
            assert rel(g, w) < 1e-5, blocks


def test_hiding_check_passes_ordinary_calls_and_fails_where_hiding_would_change_the_result():
    q, k = arr(1, 64, 2, 16), arr(1, 64, 2, 16)
    call = make_call(q, k, k, scale=0.25, causal=True)
    assert bool(hiding_is_exact(call, -0.7 * float(np.finfo(np.float32).max)))
    # A finite fill close to the visible logits: hidden keys keep weight.
    soft = make_call(q, k, k, scale=0.25, causal=True, fill=-5.0)
    assert not bool(hiding_is_exact(soft, -1e30))
    # Visible logits down at the kernel's own mask value (a finfo.min bias on visible keys).
    biased = make_call(q, k, k, scale=0.25, causal=True,
                       bias=jnp.full((1, 1, 64, 64), F32_MIN))
    assert not bool(hiding_is_exact(biased, -0.7 * float(np.finfo(np.float32).max)))
    inf_q = make_call(q.at[0, 0, 0, 0].set(jnp.inf), k, k, scale=0.25, causal=True)
    assert not bool(hiding_is_exact(inf_q, -1e30))


def test_pallas_tpu_falls_back_to_the_exact_kernel_when_its_hiding_would_show():
    from jax.experimental.pallas import tpu as pltpu

    from hlotool.kernels.pallas_tpu import PallasTpuFlash

    q, k, v = arr(1, 128, 2, 64), arr(1, 128, 2, 64), arr(1, 128, 2, 64)
    bias = jnp.full((1, 1, 128, 128), F32_MIN)  # visible logits at finfo.min
    kw = dict(scale=0.125, causal=True, bias=bias)
    with pltpu.force_tpu_interpret_mode(True):
        got = jax.jit(lambda q, k, v: PallasTpuFlash()(q, k, v, **kw))(q, k, v)
    want = Reference()(q, k, v, **kw)
    assert rel(got, want) < 1e-5


# ---------------------------------------------------------------------- validate=True


def causal(q, k, v):
    return attend(jnp.where(jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)),
                            scores(q, k) * 0.25, -1e9), v)


# Slow (validates three wrappings): the README's test command leaves it to CI.
@pytest.mark.slow
def test_validate_under_grad_jit_and_vmap_keeps_the_kernels():
    q, k, v = arr(1, 512, 2, 16), arr(1, 512, 2, 16), arr(1, 512, 2, 16)

    def loss(q, k, v):
        return jnp.sum(causal(q, k, v) ** 2)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = hlotool.flash_jit(loss, validate=True)
        got = jax.grad(fast, argnums=(0, 1, 2))(q, k, v)
        assert fast.report.rewritten == 1
        assert "hlotool_flash" in jax.jit(jax.grad(fast)).lower(q, k, v).as_text()
        batched = jax.vmap(hlotool.flash_jit(causal, validate=True))(q[None], k[None], v[None])
    for g, w in zip(got, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        assert rel(g, w) < 1e-5
    assert rel(batched[0], causal(q, k, v)) < 1e-5
    (notes,) = fast.notes.values()
    assert notes == ["validated on generated values (the call was traced)"]


@pytest.mark.slow
def test_validate_checks_each_new_signature():
    fast = hlotool.flash_jit(causal, validate=True)
    fast(arr(1, 512, 2, 16), arr(1, 512, 2, 16), arr(1, 512, 2, 16))
    fast(arr(1, 1024, 2, 16), arr(1, 1024, 2, 16), arr(1, 1024, 2, 16))
    fast(arr(1, 1024, 2, 16), arr(1, 1024, 2, 16), arr(1, 1024, 2, 16))
    assert len(fast.verdicts) == 2 and all(v == {} for v in fast.verdicts.values())
    assert all(n == ["validated on the call's values"] for n in fast.notes.values())


def test_validate_passes_a_kernel_that_is_finite_where_native_is_not():
    """A -inf fill that empties rows: the naive program's gradients are NaN through those
    rows (and, via their keys, everywhere), the kernel's are finite: a pass, with a note."""
    empty = jnp.ones((1, 1, 512, 512), bool).at[:, :, 3].set(False)

    def masked(q, k, v, m):
        return attend(jnp.where(m, scores(q, k) * 0.25, -jnp.inf), v)

    args = (arr(1, 512, 2, 16), arr(1, 512, 2, 16), arr(1, 512, 2, 16), empty)
    native_grads = grads(jax.jit(masked), *args, argnums=(0, 1, 2))
    assert not all(bool(jnp.isfinite(g).all()) for g in native_grads)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = hlotool.flash_jit(masked, validate=True)
        out = fast(*args)
    assert fast.verdicts and all(v == {} for v in fast.verdicts.values())
    (notes,) = fast.notes.values()
    assert "native has NaN or inf where the kernels are finite" in notes
    assert "hlotool_flash" in fast.lower(*args).as_text()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(jax.jit(masked)(*args)))


@pytest.mark.slow
def test_validate_fails_one_site_for_one_signature_only(monkeypatch):
    from hlotool.passes import lower

    real = lower.restore

    def wrong_for_long(site, out, after):
        y = real(site, out, after)
        return y * 1.01 if 1024 in y.shape else y

    monkeypatch.setattr(lower, "restore", wrong_for_long)
    fast = hlotool.flash_jit(causal, validate=True)
    short = (arr(1, 512, 2, 16), arr(1, 512, 2, 16), arr(1, 512, 2, 16))
    long = (arr(1, 1024, 2, 16), arr(1, 1024, 2, 16), arr(1, 1024, 2, 16))
    with pytest.warns(UserWarning, match=r"stays native for this signature: outputs or "
                                         r"gradients differ from jax.jit by 0\.01 .*float32 "
                                         r"tolerance 1e-05"):
        fast(*long)
    np.testing.assert_array_equal(fast(*long), jax.jit(causal)(*long))
    assert "hlotool_flash" in fast.lower(*short).as_text()


# ---------------------------------------------------------------------- edge shapes


@pytest.mark.parametrize("shape", [(1, 0, 2, 16), (0, 8, 2, 16)])
def test_zero_length_axes_stay_native_with_the_reason(shape):
    x = jnp.zeros(shape)

    def fn(q, k, v):
        return attend(scores(q, k), v)

    (site,) = hlotool.explain(fn, x, x, x).sites
    assert site.reason.startswith("zero-length axis") and not site.rewritten
    assert hlotool.flash_jit(fn, kernel="chunked")(x, x, x).shape == shape


def test_symbolic_dimensions_are_left_native_with_the_reason():
    def fn(q, k, v):
        return attend(scores(q, k) * 0.25, v)

    sds = jax.ShapeDtypeStruct(export.symbolic_shape("b, 64, 2, 16"), jnp.float32)
    with pytest.warns(UserWarning, match=r"left native: symbolic dimension b \(shape "
                                         r"polymorphism\)"):
        exported = export.export(hlotool.flash_jit(fn))(sds, sds, sds)
    assert str(exported.in_avals[0].shape[0]) == "b"
    report = hlotool.explain(fn, sds, sds, sds)
    assert report.sites == () and "symbolic dimension b" in str(report)


@pytest.mark.slow
def test_decode_step_and_single_key_are_detected_and_rewritten():
    q, kv = arr(4, 1, 8, 64), arr(4, 4096, 8, 64)

    def fn(q, k, v):
        return attend(scores(q, k) * 0.125, v)

    (site,) = hlotool.explain(fn, q, kv, kv).sites
    assert (site.site.q_len, site.site.kv_len) == (1, 4096)
    assert_same(fn, q, kv, kv)
    q, one = arr(2, 5, 2, 16), arr(2, 1, 2, 16)
    (site,) = hlotool.explain(fn, q, one, one).sites
    assert (site.site.q_len, site.site.kv_len) == (5, 1)
    fast = hlotool.flash_jit(fn, kernel="chunked")
    assert "hlotool_flash" in fast.lower(q, one, one).as_text()
    assert rel(fast(q, one, one), fn(q, one, one)) < 1e-5
    (dq, dk, dv), (wq, wk, wv) = grads(fast, q, one, one), grads(jax.jit(fn), q, one, one)
    assert rel(dv, wv) < 1e-5
    # One key: softmax is 1 whatever q and k are, so dq and dk are 0; the kernel's are
    # rounding noise, below float32 resolution of the terms they sum (0.125·|k|·|dO|·|v|).
    terms = 0.125 * float(jnp.max(jnp.abs(q)) * jnp.max(jnp.abs(one)) ** 2) * 4
    for got, want in ((dq, wq), (dk, wk)):
        assert float(jnp.max(jnp.abs(want))) == 0.0
        assert float(jnp.max(jnp.abs(got))) < 1e-6 * terms
