"""Masks in kernel terms, not dense operands: sliding windows and other bands read from the
mask's structure, segment ids of packed sequences, and the additive `select(m, 0, finfo.min)`
biases of Hugging Face and flax read as the masks they almost are. Each is reported per site,
rewritten with outputs and gradients equal to `jax.jit`'s, skipped or compared tile by tile in
the chunked kernel, and given to splash on TPU without a dense [L, L] operand.

The programs are the forms real code writes: `jax.nn.dot_product_attention`'s
`local_window_size` (a constant arange, not an iota), GPT-OSS' `abs(i - j) <= w`, Mistral-style
`(j <= i) & (j > i - w)`, a bottom-right aligned causal mask, an additive band, `q_seg[:, :,
None] == kv_seg[:, None, :]`, flax's `select(mask > 0, 0, finfo.min)`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool
from hlotool.kernels import KernelError, get
from hlotool.kernels.splash_tpu import SplashTpu
from hlotool.passes.from_hlo import detect_hlo
from hlotool.passes.from_jaxpr import detect_jaxpr

B, LQ, LK, H, D = 2, 96, 96, 2, 16


def _attend(mask_of):
    """softmax(where(mask_of(i, j), q·kᵀ/4, -inf))·v with i, j iotas of [Lq, Lk]."""
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        i = jnp.arange(q.shape[1])[:, None]
        j = jnp.arange(k.shape[1])[None, :]
        s = jnp.where(mask_of(i, j), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return fn


def _dpa(**options):
    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **options)
    return fn


def _additive_band(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    i = jax.lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (q.shape[1], k.shape[1]), 1)
    s = s + jnp.where((i - j < 8) & (j <= i), 0.0, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _cumsum_causal(reverse: bool):
    """keras' `use_causal_mask`: positions counted by running sums of ones,
    cumsum(ones, axis=0) >= cumsum(ones, axis=1) (reversed: Lq - i <= Lk - j)."""
    def fn(q, k, v):
        ones = jnp.ones((q.shape[1], k.shape[1]), jnp.int32)
        row, col = (jax.lax.cumsum(ones, axis=a, reverse=reverse) for a in (0, 1))
        keep = row <= col if reverse else row >= col
        s = jnp.where(keep, jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return fn


# (program, lq, lk, mask kind, window)
PROGRAMS = {
    "mistral (j <= i) & (j > i - 16)":
        (_attend(lambda i, j: (j <= i) & (j > i - 16)), LQ, LK, "causal", (15, 0)),
    "gpt-oss abs(i - j) <= 10": (_attend(lambda i, j: jnp.abs(i - j) <= 10), LQ, LK, "local",
                                 (10, 10)),
    "where(abs(i - j) > 10) hides": (_attend(lambda i, j: ~(jnp.abs(i - j) > 10)), LQ, LK,
                                     "local", (10, 10)),
    "dot_product_attention causal, local_window_size=(12, 0)":
        (_dpa(is_causal=True, local_window_size=(12, 0)), LQ, LK, "causal", (12, 0)),
    "dot_product_attention local_window_size=(3, 5)":
        (_dpa(local_window_size=(3, 5)), LQ, LK, "local", (3, 5)),
    "bottom-right causal, Lq < Lk": (_attend(lambda i, j: j <= i + (160 - 64)), 64, 160,
                                     "local", (None, 96)),
    "strictly past keys (row 0 sees none)": (_attend(lambda i, j: j < i), LQ, LK, "local",
                                             (None, -1)),
    "window past the keys' end, Lq > Lk": (_attend(lambda i, j: jnp.abs(i - j) <= 4), 160, 64,
                                           "local", (4, 4)),
    "additive band": (_additive_band, LQ, LK, "causal", (7, 0)),
    "keras cumsum causal": (_cumsum_causal(False), LQ, LK, "causal", None),
    "reversed cumsum causal": (_cumsum_causal(True), LQ, LK, "causal", None),
}


def _inputs(lq, lk, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, lq, H, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, lk, H, D)), dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name", PROGRAMS)
def test_each_band_is_read_as_its_window_in_both_front_ends(name):
    fn, lq, lk, kind, window = PROGRAMS[name]
    args = _inputs(lq, lk)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*args))
    (from_hlo,) = detect_hlo(jax.jit(fn).lower(*args).as_text(dialect="hlo", debug_info=True))
    for s in (site.site, from_hlo):
        assert (s.mask, s.window, s.mask_shape) == (kind, window, None), name
    assert site.site.to_json()["window"] == (None if window is None else list(window))


def test_an_or_of_half_planes_is_no_window():
    """abs(i - j) >= 10 keeps two regions: no band, a boolean mask (folded at this size)."""
    fn = _attend(lambda i, j: jnp.abs(i - j) >= 10)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*_inputs(LQ, LK)))
    assert (site.site.mask, site.site.window) == ("boolean", None)


@pytest.mark.parametrize("form", ["where", "finfo.min bias"])
@pytest.mark.parametrize("constant", ["iota < length", "numpy array"])
@pytest.mark.sweep(keep=2)
def test_a_key_mask_broadcast_over_the_queries_is_no_band(constant, form):
    """`arange(Lk) < n` (or its values, closed over) as [1, 1, 1, Lk]: one row that every
    query shares. Read as a band of that single row, it once became window (∞, n - 1), so
    query i saw keys up to i + n - 1 (outputs and dv off by up to 99%)."""
    n = LK - 37
    if constant == "numpy array":
        keep = jnp.asarray(np.arange(LK)[None, None, None, :] < n)
    else:
        keep = jnp.arange(LK)[None, None, None, :] < n

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        if form == "where":
            s = jnp.where(keep, s, -jnp.inf)
        else:
            s = s + jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    args = tuple(a[:1] for a in _inputs(LQ, LK))
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*args))
    assert site.site.window is None and site.site.mask != "local", site.site
    (want_grads, want), (got_grads, got) = (
        _value_and_grads(f)(*args) for f in (fn, hlotool.flash_jit(fn, kernel="chunked")))
    for w, g in zip((want, *want_grads), (got, *got_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_running_sums_of_ones_are_read_as_causal_at_any_length(reverse):
    """At L = 65536 nothing is folded: keras' counts of ones (jaxpr `cumsum`, XLA:CPU's
    `reduce-window` over the whole axis) are read as positions in both front ends."""
    fn = _cumsum_causal(reverse)
    spec = jax.ShapeDtypeStruct((1, 65536, 8, 64), jnp.bfloat16)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(spec, spec, spec))
    (from_hlo,) = detect_hlo(jax.jit(fn).lower(spec, spec, spec).as_text(dialect="hlo"))
    for s in (site.site, from_hlo):
        assert (s.mask, s.window, s.mask_shape) == ("causal", None, None)


def test_positions_counted_in_bfloat16_are_not_read_as_causal():
    """bfloat16 holds integers exactly only up to 256: `arange(L, dtype=bfloat16)` rounds
    beyond, and j <= i over those rounded positions is not causal. It is read from its values
    (a boolean mask), and the rewrite keeps the program's output."""
    length = 640

    def fn(q, k, v):
        i = jnp.arange(length, dtype=jnp.bfloat16)[:, None]
        j = jnp.arange(length, dtype=jnp.bfloat16)[None, :]
        s = jnp.where(j <= i, jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    args = _inputs(length, length)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*args))
    assert (site.site.mask, site.site.window) == ("boolean", None)
    got = hlotool.flash_jit(fn, kernel="chunked")(*args)
    np.testing.assert_allclose(got, jax.jit(fn)(*args), rtol=1e-5, atol=1e-5)


def test_a_window_is_read_at_any_length():
    """At L = 65536 nothing is folded: the window comes from the iotas alone."""
    fn = _attend(lambda i, j: (j <= i) & (j > i - 4096))
    spec = jax.ShapeDtypeStruct((1, 65536, 8, 64), jnp.bfloat16)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(spec, spec, spec))
    assert (site.site.mask, site.site.window, site.site.mask_shape) == ("causal", (4095, 0),
                                                                       None)


def _value_and_grads(fn):
    def loss(q, k, v):
        out = fn(q, k, v)
        weights = jax.random.normal(jax.random.PRNGKey(1), out.shape, jnp.float32)
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out.astype(jnp.float32)) * weights), out

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.sweep(keep=3)
def test_each_band_is_rewritten_with_outputs_and_gradients_equal(name):
    fn, lq, lk, _, _ = PROGRAMS[name]
    args = _inputs(lq, lk)
    report = hlotool.explain(fn, *args, kernel="chunked")
    assert report.rewritten == 1, str(report)
    (want_grads, want), (got_grads, got) = (
        _value_and_grads(f)(*args) for f in (fn, hlotool.flash_jit(fn, kernel="chunked")))
    # Rows that see no key are NaN in the naive program, and stay NaN; the naive gradients
    # are NaN wherever such a row reaches (the rewrite's are finite there: compared elsewhere).
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isfinite(np.asarray(want)).any()
    for w, g in zip((want, *want_grads), (got, *got_grads)):
        w, g = np.asarray(w), np.asarray(g)
        fine = np.isfinite(w)
        if fine.any():
            err = np.max(np.abs(g[fine] - w[fine]))
            assert err <= 1e-5 * max(np.max(np.abs(w[fine])), 1e-30), err


def test_the_chunked_kernel_prices_only_the_blocks_a_window_reaches():
    """L = 4096 in 512 × 256 tiles, window (64, 64): query block i (rows 512i .. 512i + 511)
    reaches key blocks 2i - 1 .. 2i + 2, clipped at the ends: 3 + 6 · 4 + 3 = 30 of 128."""
    import dataclasses

    site = detect_jaxpr(jax.make_jaxpr(PROGRAMS["gpt-oss abs(i - j) <= 10"][0])(
        *_inputs(LQ, LK)))[0].site
    long = dataclasses.replace(site, q_len=4096, kv_len=4096, window=(64, 64))
    full = dataclasses.replace(long, window=None, mask="none")
    kernel = get("chunked")
    assert kernel.cost(long).transcendentals / kernel.cost(full).transcendentals == 30 / 128


WINDOWS = {"causal window": dict(causal=True, window=(40, 0)),
           "both sides, unaligned lengths": dict(window=(20, 30)),
           "queries past the keys": dict(window=(5, 0), lq=160, lk=96)}


@pytest.mark.parametrize("options", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.slow
def test_splash_takes_windows_as_local_masks(options):
    opts = dict(options)
    lq, lk = opts.pop("lq", 136), opts.pop("lk", 200)
    _splash_matches_the_reference(lq, lk, opts, seed=1)


def _splash_matches_the_reference(lq: int, lk: int, opts: dict, seed: int) -> None:
    """Splash in interpret mode against the reference kernel: output and dq, dk, dv within
    1e-5 of the largest, GQA 4/2, lengths padded to lanes inside the adapter."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 64)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, lk, 2, 64)), jnp.float32) for _ in range(2))

    def grads(kernel):
        def loss(q, k, v):
            out = kernel(q, k, v, scale=0.125, **opts)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (g_splash, o_splash), (g_ref, o_ref) = grads(SplashTpu(interpret=True)), grads(
        get("reference"))
    for got, want in zip((o_splash, *g_splash), (o_ref, *g_ref)):
        scale = max(float(jnp.max(jnp.abs(want))), 1e-30)
        assert float(jnp.max(jnp.abs(got - want))) / scale < 1e-5


def test_kernels_without_windows_refuse_them_by_name():
    site = detect_jaxpr(jax.make_jaxpr(PROGRAMS["gpt-oss abs(i - j) <= 10"][0])(
        *_inputs(LQ, LK)))[0].site
    assert get("pallas_tpu").supports(site).reason == (
        "a sliding window unsupported (pallas_tpu has none)")
    assert get("splash_tpu").supports(site) or get("splash_tpu").unavailable_reason
    with pytest.raises(KernelError, match="window .* shows no key to any query"):
        get("reference")(*_inputs(8, 8), scale=1.0, window=(2, -3))


LONG = 2048


def _kernel_operands(text: str) -> list[list[str]]:
    return [re.findall(r"tensor<[^>]*>", line.rsplit(" : (", 1)[1].split(") ->")[0])
            for line in text.splitlines() if "stablehlo.custom_call @tpu_custom_call" in line]


def test_a_windowed_causal_mask_with_padding_exports_to_splash_without_dense_operands():
    """Mistral's mask (causal, a 512-key window, key padding): splash forward and backward,
    the window as its mask object, padding as segment ids, nothing [L, L]."""
    def fn(q, k, v, lengths):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        i, j = jnp.arange(LONG)[:, None], jnp.arange(LONG)[None, :]
        keep = ((j <= i) & (j > i - 512))[None] & (j[None] < lengths[:, None, None])
        s = jnp.where(keep[:, None], s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)

    qkv = jax.ShapeDtypeStruct((B, LONG, 8, 64), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    report = hlotool.explain(fn, qkv, qkv, qkv, lengths)
    (site,) = report.sites
    assert (site.site.mask, site.site.window, site.site.mask_axes) == ("boolean", (511, 0),
                                                                       "BK")
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    fast = hlotool.flash_jit(fn)
    text = jax.export.export(jax.jit(fast), platforms=["tpu"])(qkv, qkv, qkv, lengths
                                                                ).mlir_module()
    (operands,) = _kernel_operands(text)
    assert not [t for t in operands if re.search(rf"{LONG}x{LONG}x\w+>$", t)], operands
    grad = jax.export.export(jax.jit(jax.grad(
        lambda *a: fast(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))),
        platforms=["tpu"])(qkv, qkv, qkv, lengths).mlir_module()
    assert grad.count("tpu_custom_call") == 3


def test_local_mqa_over_packed_segments_exports_to_splash_forward_and_backward():
    """recurrentgemma's local attention (#38): one K/V head, a 64-key causal window, packed
    segments: splash takes the window as its mask object and the ids as segment ids."""
    def fn(q, k, v, segment_ids):
        s = jnp.einsum("btnh,bsh->bnts", q, k[:, :, 0]) * q.shape[-1] ** -0.5
        i, j = jnp.arange(LONG)[:, None], jnp.arange(LONG)[None, :]
        keep = ((segment_ids[:, :, None] == segment_ids[:, None, :])
                & ((i >= j) & (i - j < 64))[None])
        s = jnp.where(keep[:, None], s, -2.3819763e38)
        p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
        return jnp.einsum("bnts,bsh->btnh", p, v[:, :, 0])

    q = jax.ShapeDtypeStruct((B, LONG, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, LONG, 1, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((B, LONG), jnp.int32)
    (site,) = hlotool.explain(fn, q, kv, kv, ids).sites
    assert (site.site.window, site.site.segments, site.site.num_kv_heads) == ((63, 0), True, 1)
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    fast = hlotool.flash_jit(fn)
    text = jax.export.export(jax.jit(fast), platforms=["tpu"])(q, kv, kv, ids).mlir_module()
    (operands,) = _kernel_operands(text)
    assert "splash_mha_fwd" in text
    assert not [t for t in operands if re.search(rf"{LONG}x{LONG}x\w+>$", t)], operands
    grad = jax.export.export(jax.jit(jax.grad(
        lambda *a: fast(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))),
        platforms=["tpu"])(q, kv, kv, ids).mlir_module()
    assert grad.count("tpu_custom_call") == 3


# ---------------------------------------------------------------------- segment ids


def _packed(causal: bool):
    def fn(q, k, v, segments):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        keep = segments[:, :, None] == segments[:, None, :]
        if causal:
            keep = keep & jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        s = jnp.where(keep[:, None], s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
    return fn


def _segments(length: int, seed: int = 0) -> jax.Array:
    """[B, L] ids of packed sequences: runs of increasing ids."""
    return jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (B, length)), axis=1))


@pytest.mark.parametrize("causal", [False, True], ids=["segments", "segments and causal"])
def test_segment_ids_are_read_and_rewritten_with_outputs_and_gradients_equal(causal):
    fn = _packed(causal)
    q, k, v = _inputs(LQ, LQ)
    segments = _segments(LQ)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(q, k, v, segments))
    (from_hlo,) = detect_hlo(jax.jit(fn).lower(q, k, v, segments).as_text(dialect="hlo",
                                                                           debug_info=True))
    for s in (site.site, from_hlo):
        assert s.segments and "segment ids" in s.variants
        assert (s.mask, s.mask_shape, s.mask_axes) == ("causal" if causal else "none", None,
                                                       None)
    fast = hlotool.flash_jit(fn, kernel="chunked")
    (want_grads, want), (got_grads, got) = (
        _value_and_grads(lambda q, k, v, f=f: f(q, k, v, segments))(q, k, v)
        for f in (fn, fast))
    for w, g in zip((want, *want_grads), (got, *got_grads)):
        w, g = np.asarray(w), np.asarray(g)
        assert np.max(np.abs(g - w)) <= 1e-5 * np.max(np.abs(w))


def test_an_equality_of_other_ids_is_no_segment_mask():
    """Ids that vary along the heads are no segment ids: a boolean mask."""
    def fn(q, k, v, ids):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(ids[:, :, :, None] == ids[:, :, None, :], s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    ids = jnp.zeros((B, H, LK), jnp.int32)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*_inputs(LK, LK), ids))
    assert not site.site.segments and site.site.mask == "boolean"


@pytest.mark.slow
def test_splash_takes_segment_ids_with_key_padding():
    rng = np.random.default_rng(2)
    segments = (jnp.asarray(np.sort(rng.integers(0, 3, (2, 136)), axis=1)),
                jnp.asarray(np.sort(rng.integers(0, 3, (2, 200)), axis=1)))
    _splash_matches_the_reference(136, 200, dict(causal=True, segment_ids=segments,
                                                 kv_lengths=jnp.array([200, 90])), seed=2)


def test_packed_sequences_export_to_splash_with_their_ids():
    fn = _packed(causal=True)
    qkv = jax.ShapeDtypeStruct((1, LONG, 8, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, LONG), jnp.int32)
    (site,) = hlotool.explain(fn, qkv, qkv, qkv, ids).sites
    assert site.kernels["tpu"] == "splash_tpu", site.reason
    text = jax.export.export(jax.jit(hlotool.flash_jit(fn)), platforms=["tpu"])(
        qkv, qkv, qkv, ids).mlir_module()
    (operands,) = _kernel_operands(text)
    assert not [t for t in operands if re.search(rf"{LONG}x{LONG}x\w+>$", t)], operands
    # The ids themselves, as splash lays them out: q ids across lanes, kv ids across sublanes.
    assert f"tensor<{LONG}x128xi32>" in operands and f"tensor<8x{LONG}xi32>" in operands


# ------------------------------------------------------- additive biases read as masks


def _flax_bias(fill):
    """flax / Hugging Face: s + select(mask > 0, 0, fill) from a [B, Lk] padding mask."""
    def fn(q, k, v, attention_mask):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        keep = attention_mask[:, None, None, :] > 0
        bias = jax.lax.select(keep, jnp.zeros(keep.shape, s.dtype),
                              jnp.full(keep.shape, fill, s.dtype))
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s + bias, axis=-1), v)
    return fn


def test_a_finfo_min_bias_reads_as_a_key_padding_mask():
    fn = _flax_bias(float(jnp.finfo(jnp.float32).min))
    lengths = jnp.ones((B, LK), jnp.int32).at[1, 50:].set(0)
    (site,) = detect_jaxpr(jax.make_jaxpr(fn)(*_inputs(LQ, LK), lengths))
    assert (site.site.mask, site.site.mask_axes) == ("boolean", "BK")
    # -1e9 in float32: s + -1e9 differs from -1e9 once |s| > 16, so it stays a bias.
    (site,) = detect_jaxpr(jax.make_jaxpr(_flax_bias(-1e9))(*_inputs(LQ, LK), lengths))
    assert site.site.mask == "additive"


@pytest.mark.parametrize("case", ["reads as a mask", "large logits", "a row sees no key"])
def test_the_run_time_check_keeps_a_bias_read_as_a_mask_exact(case):
    """Each call checks |s| against half of finfo.min's ulp and that every row sees a key;
    where either fails it runs the bias as written, so outputs and gradients stay equal."""
    fn = _flax_bias(float(jnp.finfo(jnp.float32).min))
    q, k, v = _inputs(LQ, LK)
    keep = jnp.ones((B, LK), jnp.int32).at[1, 50:].set(0)
    if case == "large logits":
        q = q * 1e16  # |s| ~ 1e32: s + finfo.min is no longer finfo.min
    if case == "a row sees no key":
        keep = keep.at[0].set(0)  # batch row 0 sees nothing: autodiff still passes gradients
    fast = hlotool.flash_jit(fn, kernel="chunked")
    assert hlotool.explain(fn, q, k, v, keep, kernel="chunked").rewritten == 1
    (want_grads, want), (got_grads, got) = (
        _value_and_grads(lambda q, k, v, f=f: f(q, k, v, keep))(q, k, v) for f in (fn, fast))
    # Errors relative to each value, or to the size of the terms it sums where it is ~0 (with
    # one-hot softmax rows dq is 0 up to rounding): |v|, and |dO|·|v|·C·|k| or ·|q| (|dO| ≤ 3).
    c = D ** -0.5
    big = [float(np.max(np.abs(np.asarray(x)))) for x in (q, k, v)]
    terms = [big[2], 3 * big[2] * c * big[1], 3 * big[2] * c * big[0], 3.0]
    for w, g, t in zip((want, *want_grads), (got, *got_grads), terms):
        w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
        assert np.array_equal(np.isfinite(w), np.isfinite(g))
        fine = np.isfinite(w)
        assert np.max(np.abs(g[fine] - w[fine])) <= 1e-5 * max(np.max(np.abs(w[fine])), t)
