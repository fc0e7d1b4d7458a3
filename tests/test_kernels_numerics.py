"""Every kernel against the reference: forward and all gradients (dq, dk, dv, dbias).

Errors are relative to the reference's largest magnitude: max|x - ref| / max|ref| ≤ 1e-5 in
float32 (reference at HIGHEST precision), ≤ 2e-2 for bfloat16 inputs. Pallas kernels run in
their interpret modes, so shapes stay small.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from hlotool.jaxcompat import jaxprs_in_params
from hlotool.kernels import chunked
from hlotool.kernels.base import make_call
from hlotool.kernels.chunked import Chunked
from hlotool.kernels import cudnn as cudnn_kernel
from hlotool.kernels.cudnn import CudnnFlash
from hlotool.kernels.pallas_gpu import PallasGpuFlash
from hlotool.kernels.pallas_tpu import PallasTpuFlash
from hlotool.kernels.reference import Reference

TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lq: int = 64
    lk: int = 64
    hq: int = 2
    hkv: int = 2
    d: int = 64
    batch: int = 1
    causal: bool = False
    bias: tuple[int, ...] | None = None  # bias shape, broadcast against [B, Hq, Lq, Lk]
    mask: bool = False  # random boolean mask with one fully masked query row
    kv_lengths: tuple[int, ...] | None = None  # keys beyond are NaN in q/k/v inputs
    dtype: str = "float32"
    scale: float | None = 0.3
    window: tuple[int | None, int | None] | None = None
    fill: float = -math.inf
    softcap: float | None = None
    sinks: bool = False  # one sink logit per query head


CASES = [
    Case("causal_lq_ne_lk", lq=96, lk=160, causal=True),
    Case("lq_gt_lk", lq=160, lk=128),
    Case("single_query", lq=1, lk=5),
    Case("tail_not_multiple_of_128", lq=200, lk=200, scale=None),
    Case("gqa_causal", hq=4, hkv=2, causal=True),
    Case("mqa", hq=4, hkv=1),
    Case("key_padding_nan", batch=3, lq=40, lk=72, kv_lengths=(72, 33, 0)),
    Case("key_padding_causal", batch=2, lq=72, lk=72, causal=True, kv_lengths=(50, 0)),
    Case("head_dim_128", d=128, causal=True),
    Case("head_dim_256", d=256),
    Case("bias_full", bias=(1, 2, 64, 64)),
    Case("bias_keys_causal", batch=2, bias=(2, 1, 1, 64), causal=True),
    Case("boolean_mask", batch=2, mask=True),
    Case("bf16_causal", lq=96, lk=96, causal=True, dtype="bfloat16"),
]


def _inputs(case: Case):
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, so inputs would differ per run.
    keys = jax.random.split(jax.random.PRNGKey(zlib.crc32(case.name.encode())), 6)
    dt = jnp.dtype(case.dtype)
    q = jax.random.normal(keys[0], (case.batch, case.lq, case.hq, case.d)).astype(dt)
    k = jax.random.normal(keys[1], (case.batch, case.lk, case.hkv, case.d)).astype(dt)
    v = jax.random.normal(keys[2], (case.batch, case.lk, case.hkv, case.d)).astype(dt)
    extra = {"causal": case.causal, "scale": case.scale}
    for name in ("window", "softcap"):
        if getattr(case, name) is not None:
            extra[name] = getattr(case, name)
    if case.fill != -math.inf:
        extra["fill"] = case.fill
    if case.sinks:
        extra["sinks"] = jax.random.normal(jax.random.fold_in(keys[3], 1), (1, case.hq, 1, 1))
    bias = None
    if case.bias is not None:
        bias = jax.random.normal(keys[3], case.bias)
    if case.mask:
        mask = jax.random.bernoulli(keys[4], 0.6, (case.batch, 1, case.lq, case.lk))
        extra["mask"] = mask.at[0, 0, 3].set(False)  # a query row that sees no key
    if case.kv_lengths is not None:
        lengths = jnp.array(case.kv_lengths, jnp.int32)
        pad = (jnp.arange(case.lk)[None, :] >= lengths[:, None])[:, :, None, None]
        k, v = jnp.where(pad, jnp.nan, k), jnp.where(pad, jnp.nan, v)
        extra["kv_lengths"] = lengths
    cotangent = jax.random.normal(keys[5], (case.batch, case.lq, case.hq, case.d))
    return (q, k, v, bias), extra, cotangent


def _value_and_grads(kernel, case: Case):
    (q, k, v, bias), extra, cot = _inputs(case)

    def loss(q, k, v, bias):
        out = kernel(q, k, v, bias=bias, **extra)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    run = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))
    (_, out), grads = run(q, k, v, bias)
    return out, grads


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _check(kernel, case: Case, tol: float | None = None):
    with jax.default_matmul_precision("highest"):
        out, grads = _value_and_grads(kernel, case)
        ref_out, ref_grads = _value_and_grads(Reference(), dataclasses.replace(
            case, dtype="float32") if case.dtype != "float32" else case)
    tol = tol or TOL[case.dtype]
    assert out.shape == (case.batch, case.lq, case.hq, case.d)
    assert out.dtype == jnp.dtype(case.dtype)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert _rel_err(out, ref_out) <= tol, ("out", _rel_err(out, ref_out))
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert g.shape == r.shape, name
        # Keys beyond kv_lengths are NaN inputs: their gradient must be exactly zero.
        assert not np.isnan(np.asarray(g, np.float32)).any(), name
        assert _rel_err(g, r) <= tol, (name, _rel_err(g, r))
    if case.kv_lengths is not None and 0 in case.kv_lengths:
        empty = case.kv_lengths.index(0)
        np.testing.assert_array_equal(np.asarray(out[empty], np.float32), 0.0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.sweep(keep=2)
def test_chunked_small_blocks(case):
    """Blocks of 32×16 so every case spans several query and key blocks."""
    _check(Chunked(block_q=32, block_k=16), case)


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=lambda c: c.name)
def test_chunked_default_blocks(case):
    _check(Chunked(), case)


@pytest.mark.parametrize("by_halves", [False, True])
@pytest.mark.parametrize("case", [
    Case("logits_in_the_hundreds", lq=96, lk=160, causal=True, scale=10.0),
    Case("logits_in_the_hundreds_200_keys", lq=200, lk=200, scale=10.0), CASES[7]],
    ids=lambda c: c.name)
@pytest.mark.sweep(keep=2)
def test_chunked_row_max_either_way(monkeypatch, case, by_halves):
    """The forward's row max is taken by elementwise maxima of halves where XLA:CPU's own is
    slow (jaxlib 0.9), else by jnp.max. Softmax does not depend on the shift, so only logits
    far apart show a wrong max (exp overflows): both ways are exact, on power-of-two key
    blocks and on a 200-key block (halved down to 25, then jnp.max). Logits of ±200 round
    at ~1e-5 of themselves, differently where the kernel scales q and the reference the
    scores: hence 1e-4 there."""
    monkeypatch.setattr(chunked, "_max_by_halves", lambda: by_halves)
    tol = 1e-4 if case.scale == 10.0 else None
    _check(Chunked(), case, tol)
    _check(Chunked(block_q=32, block_k=16), case, tol)


F32_MIN = float(np.finfo(np.float32).min)
EDGE_CASES = [
    Case("causal", lq=83, lk=83, hq=4, d=16, causal=True),
    Case("causal_fill_-1e9", lq=83, lk=83, hq=4, d=16, causal=True, fill=-1e9),
    Case("causal_fill_finfo_min_lq_lt_lk", lq=61, lk=83, hq=4, d=16, causal=True,
         fill=F32_MIN),
    Case("sliding_window", lq=83, lk=83, hq=4, d=16, causal=True, window=(20, 0)),
    # A fill near the logits: skipped keys keep visible weight.
    Case("causal_fill_-2", lq=83, lk=83, hq=4, d=16, causal=True, fill=-2.0),
    Case("right_offset_fill_-2", lq=83, lk=83, hq=4, d=16, window=(None, 5), fill=-2.0),
    Case("both_sides_bias_sinks_softcap", lq=83, lk=83, hq=4, d=16, window=(7, 3),
         bias=(1, 4, 83, 83), sinks=True, softcap=5.0),
    Case("causal_key_padding_bias", batch=2, lq=83, lk=83, hq=4, d=16, causal=True,
         kv_lengths=(83, 40), bias=(2, 1, 1, 83)),
]


@pytest.mark.parametrize("blocks", [(16, 8), (8, 16)])
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.name)
@pytest.mark.sweep(keep=3)
def test_chunked_band_edges_with_small_blocks(case, blocks):
    """Several tiles on each edge of the band (block_q above and below block_k, lengths no
    block multiple), GQA (G = 2), and finite fills whose skipped keys enter in closed form:
    suffix sums of V per query block forward, prefix sums of w·dO per key block backward."""
    _check(Chunked(*blocks), case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.slow
def test_pallas_tpu_interpret(case):
    with pltpu.force_tpu_interpret_mode(True):
        _check(PallasTpuFlash(), case)


GPU_CASES = [c for c in CASES if c.bias is None and not c.mask and c.kv_lengths is None]


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
@pytest.mark.sweep(keep=1)
def test_pallas_gpu_interpret(case):
    kernel = PallasGpuFlash(interpret=True)
    if kernel.unavailable_reason:
        pytest.skip(kernel.unavailable_reason)
    _check(kernel, case)


def _bf16(case: Case) -> Case:
    return dataclasses.replace(case, name=f"{case.name}_bf16", dtype="bfloat16")


_CASE = {c.name: c for c in CASES + EDGE_CASES}
# What cuDNN takes: bfloat16 with causal, key lengths (NaN beyond them, a batch row with
# none), windows that end at the query, grouped K/V heads, Lq ≠ Lk, hard finite fills.
CUDNN_CASES = [_bf16(_CASE[name]) for name in (
    "causal_lq_ne_lk", "lq_gt_lk", "single_query", "tail_not_multiple_of_128", "gqa_causal",
    "mqa", "key_padding_nan", "key_padding_causal", "head_dim_128", "sliding_window",
    "causal_fill_-1e9", "causal_fill_finfo_min_lq_lt_lk")]
# What it refuses, and why.
CUDNN_REFUSED = {
    "head_dim_256": "head dim 256 unsupported (cuDNN takes multiples of 8 up to 128)",
    "bias_full": "additive bias unsupported",
    "boolean_mask": "boolean mask varying along BQK unsupported",
    "causal_fill_-2": "hidden keys keep logit -2 (a soft mask",
    "right_offset_fill_-2": "sliding window with right bound 5 unsupported",
    "both_sides_bias_sinks_softcap": "logit soft-capping and attention sinks unsupported",
}


@pytest.mark.parametrize("case", CUDNN_CASES, ids=lambda c: c.name)
@pytest.mark.sweep(keep=1)
def test_cudnn_mapping_through_xla(case):
    """The cudnn adapter's jax.nn call, run by XLA's implementation of it (jax keeps the
    two equal): causal, lengths, window and fill reach jax.nn as the reference means them."""
    kernel = CudnnFlash(implementation="xla")
    call = _call(case)
    support = kernel.supports(call.site(), call.features)
    assert support, support.reason
    _check(kernel, case)


def _call(case: Case):
    (q, k, v, bias), extra, _ = _inputs(case)
    return make_call(q, k, v, bias=bias, **extra)


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "holes"])
@pytest.mark.slow
def test_cudnn_takes_key_padding_as_lengths_where_each_row_keeps_a_prefix(prefix):
    """A key mask [B, 1, 1, Lk] reaches cuDNN as key lengths where every batch row keeps a
    prefix of the keys (a row keeping none included); a mask with holes sends the call to
    the chunked kernel. Either way: the reference's output and gradients."""
    b, lq, lk, h, d = 3, 40, 72, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v = (jax.random.normal(key, (b, length, h, d)).astype(jnp.bfloat16)
               for key, length in zip(keys, (lq, lk, lk)))
    lengths = np.array([72, 33, 0])
    keep = np.arange(lk)[None, :] < lengths[:, None]
    if not prefix:
        keep[0, 5] = False
    mask = jnp.asarray(keep)[:, None, None, :]
    call = make_call(q, k, v, scale=0.25, causal=True, mask=mask)
    kernel = CudnnFlash(implementation="xla")
    assert kernel.supports(call.site(), call.features)
    assert bool(cudnn_kernel.lengths_are_exact(call)) == prefix
    # A NaN value it hides makes the naive output NaN (0·NaN), which padding would not.
    hidden_nan = dataclasses.replace(call, v=jnp.where(keep[:, :, None, None], v, jnp.nan))
    assert not cudnn_kernel.lengths_are_exact(hidden_nan)
    cot = jax.random.normal(keys[3], (b, lq, h, d))

    def grads(kernel, *qkv):
        def loss(q, k, v):
            out = kernel(q, k, v, scale=0.25, causal=True, mask=mask)
            return jnp.sum(out.astype(jnp.float32) * cot), out
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*qkv)

    (_, out), got = grads(kernel, q, k, v)
    with jax.default_matmul_precision("highest"):
        (_, ref), want = grads(Reference(), *(x.astype(jnp.float32) for x in (q, k, v)))
    assert _rel_err(out, ref) <= TOL["bfloat16"]
    for g, r in zip(got, want):
        assert not np.isnan(np.asarray(g, np.float32)).any()
        assert _rel_err(g, r) <= TOL["bfloat16"]
    np.testing.assert_array_equal(np.asarray(out[2], np.float32), 0.0)


@pytest.mark.parametrize("name", CUDNN_REFUSED)
def test_cudnn_refuses_with_its_reason(name):
    call = _call(_bf16(_CASE[name]))
    support = CudnnFlash().supports(call.site(), call.features)
    assert not support and CUDNN_REFUSED[name] in support.reason
    call = _call(_CASE["causal_lq_ne_lk"])
    assert CudnnFlash().supports(call.site(), call.features).reason == (
        "dtype float32 unsupported (cuDNN flash attention takes bfloat16, float16)")


def test_layout_bhld_matches_blhd():
    case = Case("bhld", lq=48, lk=80, hq=4, hkv=2, causal=True)
    (q, k, v, _), extra, _ = _inputs(case)
    kern = jax.jit(Chunked(32, 16), static_argnames=("scale", "causal", "layout"))
    blhd = kern(q, k, v, **extra)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    bhld = kern(t(q), t(k), t(v), layout="BHLD", **extra)
    assert bhld.shape == (1, 4, 48, 64)
    np.testing.assert_allclose(np.asarray(t(bhld)), np.asarray(blhd), rtol=0, atol=0)


@pytest.mark.slow
def test_chunked_skips_causal_blocks_rather_than_masking():
    """Under causal (top-left), keys at positions ≥ Lq are seen by no query. Filled with NaN,
    they poison a kernel that computes masked tiles (0·NaN in P·V), as the reference shows,
    but not one that skips those key blocks."""
    lq, lk = 32, 96
    q = jax.random.normal(jax.random.PRNGKey(0), (1, lq, 2, 16))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, lk, 2, 16))
    v = jnp.zeros((1, lk, 2, 16)).at[:, lq:].set(jnp.nan)
    assert np.isnan(np.asarray(Reference()(q, k, v, scale=1.0, causal=True))).all()
    out, (dq, dk, dv) = jax.jit(jax.value_and_grad(
        lambda q, k, v: Chunked(16, 16)(q, k, v, scale=1.0, causal=True).sum(), (0, 1, 2)
    ))(q, k, v)
    assert not np.isnan(np.asarray(out)) and not np.isnan(np.asarray(dq)).any()
    assert not np.isnan(np.asarray(dk[:, :lq])).any()


def _largest_intermediate(jaxpr) -> int:
    biggest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            biggest = max(biggest, math.prod(getattr(var.aval, "shape", ())))
        for sub in jaxprs_in_params(eqn.params):
            biggest = max(biggest, _largest_intermediate(sub))
    return biggest


def test_chunked_never_materializes_scores():
    """Forward and backward intermediates stay O(L·D + tile), far below Lq·Lk."""
    b, l, h, d = 1, 2048, 2, 32
    x = jax.ShapeDtypeStruct((b, l, h, d), jnp.float32)
    kern = Chunked(block_q=256, block_k=128)

    def loss(q, k, v):
        return kern(q, k, v, scale=0.1, causal=True).sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, x, x).jaxpr
    assert _largest_intermediate(jaxpr) <= max(b * l * h * d, h * 256 * 128)
    naive = jax.make_jaxpr(jax.grad(
        lambda q, k, v: Reference()(q, k, v, scale=0.1, causal=True).sum(), (0, 1, 2)))
    assert _largest_intermediate(naive(x, x, x).jaxpr) >= b * h * l * l
