"""flash_jit: outputs and gradients equal jax.jit(fn); sites gone from the rewritten program;
native (with the reason) where a rewrite would not be exact."""

from __future__ import annotations

import math
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlotool
from hlotool import flash, jaxcompat, kernels
from hlotool.cost import decision
from hlotool.jaxcompat import jaxprs_in_params
from hlotool.errors import HlotoolError
from hlotool.passes import lower
from hlotool.passes.from_jaxpr import detect_jaxpr
from test_detect_negative import CASES as NEGATIVES


B, L, H, D = 1, 512, 2, 16  # L = 512: the shortest sequence the cost model sends to a kernel
rng = np.random.default_rng(0)


def arr(*shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


Q, K, V = arr(B, L, H, D), arr(B, L, H, D), arr(B, L, H, D)


def attend(q, k, v, scale=0.25, bias=None, mask=None, fill=-jnp.inf):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = jnp.where(mask, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def causal(q, k, v):
    return attend(q, k, v, mask=jnp.tril(jnp.ones((L, L), bool)), fill=-1e9)


def causal_iota(q, k, v):
    i, j = lax.broadcasted_iota(jnp.int32, (L, L), 0), lax.broadcasted_iota(jnp.int32, (L, L), 1)
    return attend(q, k, v, mask=i >= j)


def bias_then_scale(q, k, v, bias):
    s = (jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias) * 0.5  # kernel bias is 0.5 * bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def alibi(q, k, v):
    slopes = 2.0 ** (-8.0 * (jnp.arange(H) + 1) / H)
    return attend(q, k, v, bias=slopes[:, None, None] * (jnp.arange(L)[None] - jnp.arange(L)[:, None]))


def key_padding(q, k, v, lengths):
    valid = jnp.arange(L)[None, :] < lengths[:, None]
    return attend(q, k, v, mask=valid[:, None, None, :], fill=jnp.finfo(jnp.float32).min)


def bhld_matmul(q, k, v):
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    return jax.nn.softmax(qt @ kt.swapaxes(-1, -2) / math.sqrt(D)) @ vt


def merged_batch_heads(q, k, v):
    qm, km, vm = (x.transpose(0, 2, 1, 3).reshape(B * H, L, D) for x in (q, k, v))
    s = jnp.einsum("nqd,nkd->nqk", qm, km) * 0.25
    return jnp.einsum("nqk,nkd->nqd", jax.nn.softmax(s), vm).reshape(B, H, L, D)


def gqa(q, k, v):
    return attend(q, jnp.repeat(k[:, :, :1], H, axis=2), jnp.repeat(v[:, :, :1], H, axis=2))


def unbatched(q, k, v):
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v)


def nested_jit(q, k, v):
    return jax.jit(jax.jit(causal))(q, k, v) * 2.0


def checkpointed(q, k, v):
    return jax.checkpoint(causal)(q, k, v)


CASES = [
    (causal, (Q, K, V)), (causal_iota, (Q, K, V)), (alibi, (Q, K, V)),
    (bias_then_scale, (Q, K, V, arr(1, H, L, L))),
    (key_padding, (Q, K, V, jnp.array([300]))), (bhld_matmul, (Q, K, V)),
    (merged_batch_heads, (Q, K, V)), (gqa, (Q, K, V)), (jax.vmap(unbatched), (Q, K, V)),
    (nested_jit, (Q, K, V)), (checkpointed, (Q, K, V)),
]
IDS = ["causal", "causal_iota", "alibi", "bias_then_scale", "key_padding", "bhld_matmul",
       "merged_batch_heads", "gqa", "vmap", "nested_jit", "checkpoint"]


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def remaining_sites(fn, *args) -> int:
    return len(detect_jaxpr(jax.make_jaxpr(fn)(*args)))


@pytest.mark.parametrize("fn, args", CASES, ids=IDS)
@pytest.mark.sweep(keep=5)
def test_outputs_equal_and_no_naive_site_left(fn, args):
    fast = hlotool.flash_jit(fn)
    assert relative_error(fast(*args), jax.jit(fn)(*args)) < 1e-5
    assert remaining_sites(fast, *args) == 0 < remaining_sites(fn, *args)
    (report,) = hlotool.explain(fn, *args).sites
    # Splash on TPU, the flash kernel where a bias must be added (splash takes none).
    tpu = "pallas_tpu" if report.site.mask == "additive" else "splash_tpu"
    assert (report.kernels["cpu"], report.kernels["tpu"]) == ("chunked", tpu)


@pytest.mark.parametrize("fn, args", [CASES[0], CASES[3], CASES[4], CASES[7]],
                         ids=["causal", "bias_then_scale", "key_padding", "gqa"])
def test_gradients_equal(fn, args):
    def loss(f):
        return lambda q, k, v, *rest: jnp.sum(f(q, k, v, *rest) * V)

    want = jax.grad(loss(fn), argnums=(0, 1, 2))(*args)
    got = jax.jit(jax.grad(loss(hlotool.flash_jit(fn)), argnums=(0, 1, 2)))(*args)
    for g, w in zip(got, want):
        assert relative_error(g, w) < 1e-5


def test_backward_never_materializes_scores():
    """No [.., Lq, Lk] float array anywhere in the jaxpr of grad(flash_jit(loss)) at a key
    length above the chunked kernel's blocks (1024 x 512)."""
    n = 1024
    q = arr(1, n, 1, 8)

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, mask=jnp.tril(jnp.ones((n, n), bool))))

    def has_scores(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            if any(getattr(v.aval, "shape", ())[-2:] == (n, n) and v.aval.dtype == jnp.float32
                   for v in eqn.outvars):
                return True
            if any(has_scores(sub) for sub in jaxprs_in_params(eqn.params)):
                return True
        return False

    grad = jax.grad(hlotool.flash_jit(loss, kernel="chunked"), argnums=(0, 1, 2))
    assert not has_scores(jax.make_jaxpr(grad)(q, q, q).jaxpr)
    assert has_scores(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q).jaxpr)


@pytest.mark.parametrize("fill, expect_nan", [(-jnp.inf, True),
                                              (float(jnp.finfo(jnp.float32).min), False)])
def test_rows_with_every_key_masked_match_native(fill, expect_nan):
    def masked(q, k, v, mask):
        return attend(q, k, v, mask=mask, fill=fill)

    mask = jnp.asarray(rng.random((1, 1, L, L)) > 0.5).at[0, 0, 3].set(False)
    got, want = hlotool.flash_jit(masked)(Q, K, V, mask), jax.jit(masked)(Q, K, V, mask)
    assert bool(jnp.isnan(want[0, 3]).all()) == expect_nan
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert relative_error(jnp.nan_to_num(got), jnp.nan_to_num(want)) < 1e-5


def test_scanned_stack_is_one_site_rewritten_once():
    def stack(x, w):
        def layer(h, wl):
            q, k, v = (jnp.einsum("bld,de->ble", h, wl[i]).reshape(B, L, H, D) for i in range(3))
            return causal(q, k, v).reshape(B, L, H * D), None
        return lax.scan(layer, x, w)[0]

    args = (arr(B, L, H * D), arr(24, 3, H * D, H * D) / 6)
    fast = hlotool.flash_jit(stack)
    assert relative_error(fast(*args), jax.jit(stack)(*args)) < 1e-5
    text = str(jax.make_jaxpr(fast)(*args))
    assert text.count("name=hlotool_flash") == 1
    assert remaining_sites(fast, *args) == 0
    assert hlotool.explain(stack, *args).sites[0].where == "scan.jaxpr"


def test_escaping_probabilities_stay_native():
    def with_probs(q, k, v):
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p.mean()

    (site,) = hlotool.explain(with_probs, Q, K, V).sites
    assert not site.rewritten and "used outside it" in site.reason
    got, want = hlotool.flash_jit(with_probs)(Q, K, V), jax.jit(with_probs)(Q, K, V)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_function_differentiating_one_input_is_rewritten():
    """The gradient inside, w.r.t. q only: jax's backward of the site has no dk, dv, and the
    match finds it with q alone differentiated (tests/test_train_steps.py has the rest)."""
    def train_step(q, k, v):
        return jax.value_and_grad(lambda q: jnp.sum(causal(q, k, v) ** 2))(q)

    (site,) = hlotool.explain(train_step, Q, K, V).sites
    assert site.rewritten, site.reason
    got, want = hlotool.flash_jit(train_step)(Q, K, V), jax.jit(train_step)(Q, K, V)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_short_keys_stay_native():
    def short(q, k, v):
        return attend(q, k, v)

    q = Q[:, :256]
    (site,) = hlotool.explain(short, q, q, q).sites
    assert site.kernels == {"cpu": None, "tpu": None, "cuda": None}
    assert site.reason.startswith("cpu: keep native (short sequence: Lq=256, Lk=256;")
    assert remaining_sites(hlotool.flash_jit(short), q, q, q) == 1
    assert "hlotool_flash" not in hlotool.flash_jit(short).lower(q, q, q).as_text()


def test_auto_follows_the_cost_verdict_per_platform():
    from hlotool.cost import verdict

    for length in (256, 512, 1024):
        q = Q[:, :length]
        (report,) = hlotool.explain(lambda q, k, v: attend(q, k, v), q, q, q).sites
        for platform, kernel in report.kernels.items():
            # As explain prices it: XLA:TPU's fusion asked where this process has a TPU
            # compiler loaded (another test may have loaded one), said unknown where not.
            v = verdict(report.site, decision.chip_for(platform))
            assert kernel == (v.kernel_name if v.pays else None), (length, platform)
            assert v.reason in report.reason
    assert [decision.chip_for(p) for p in hlotool.kernels.PLATFORMS] == ["cpu", "tpu-v5e", "h100"]


def test_native_on_cpu_kernel_elsewhere(tpu_compiler):
    # D=384 bf16: both sides are compute-bound matmuls on the CPU, so the roofline gain is
    # the softmax passes alone, below ×1.2; on TPU the HBM traffic saved pays. On the GPU
    # cuDNN refuses D=384, and Pallas's small D=384 blocks re-read K and V (native too);
    # where jax no longer ships Pallas' Triton kernel (0.12.1), chunked's larger tiles pay.
    def wide(q, k, v):
        return attend(q, k, v, scale=384 ** -0.5)

    q, k, v = (arr(1, 512, 1, 384, dtype=jnp.bfloat16) for _ in range(3))
    (site,) = hlotool.explain(wide, q, k, v).sites
    triton = kernels.registered("pallas_gpu").unavailable_reason is None
    assert site.kernels == {"cpu": None, "tpu": "splash_tpu",
                            "cuda": None if triton else "chunked"}
    assert re.search(r"cpu: keep native \(roofline ×1\.[01]\d is below ×1\.2\)", site.reason)
    # XLA:TPU's own attention pass was asked (a deviceless compile): it leaves this site.
    assert site.choices["tpu"].verdict.native_fused is False
    # CPU and GPU share platform_dependent's default branch: one naive copy, not two.
    fast = hlotool.flash_jit(wide)
    assert remaining_sites(fast, q, k, v) == 1
    assert relative_error(fast(q, k, v), jax.jit(wide)(q, k, v)) < 2e-2
    exported = jax.export.export(fast, platforms=["tpu"])(q, k, v)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 1


def test_native_is_priced_as_what_xla_makes_of_the_site(monkeypatch):
    """Every command prices native as the compiler runs it: the fusion probe (a deviceless
    compile per site shape) is asked for each platform's chip, once a site is long enough
    to be priced at all; where XLA fuses the site, the kernel must beat XLA's own call."""
    probed = []

    def probe(site, target):
        probed.append(target)
        return target is not None and target.startswith("tpu")

    monkeypatch.setattr("hlotool.cost.decision.xla_fuses_natively", probe)
    monkeypatch.setattr("hlotool.cost.decision.tpu_compiler_loaded", lambda: True)
    q = Q[:, :256]
    hlotool.explain(lambda q, k, v: attend(q, k, v), q, q, q)
    assert probed == []  # a short site is kept native before any probe
    (site,) = hlotool.explain(causal, Q, K, V).sites
    assert "tpu-v5e" in probed  # off-TPU too: the same answer in every command
    tpu = site.choices["tpu"].verdict
    assert tpu.native_fused and "XLA:TPU's own online-softmax fusion" in tpu.reason


def test_attached_chip_is_priced(monkeypatch):
    class Device:
        device_kind = "TPU v5 lite"

    monkeypatch.setattr(decision, "running_platform", lambda: "tpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    assert decision.chip_for.__wrapped__("tpu") == "tpu-v5e"
    Device.device_kind = "TPU v5"
    assert decision.chip_for.__wrapped__("tpu") == "tpu-v5p"
    Device.device_kind = "TPU v6 lite"
    assert decision.chip_for.__wrapped__("tpu") == "tpu-v6e"
    assert decision.chip_for.__wrapped__("cuda") == "h100"  # no GPU attached
    monkeypatch.setattr(decision, "running_platform", lambda: "cuda")
    Device.device_kind = "NVIDIA H200"
    assert decision.chip_for.__wrapped__("cuda") == "h200"
    Device.device_kind = "NVIDIA A100-SXM4-80GB"
    assert decision.chip_for.__wrapped__("cuda") == "a100"


def test_bfloat16_within_tolerance():
    args = tuple(x.astype(jnp.bfloat16) for x in (Q, K, V))
    got, want = hlotool.flash_jit(causal)(*args), jax.jit(causal)(*args)
    assert got.dtype == jnp.bfloat16 and relative_error(got, want) < 2e-2


def test_forced_kernel_and_errors():
    assert hlotool.explain(causal, Q, K, V, kernel="chunked").sites[0].kernels == {
        "cpu": "chunked", "tpu": "chunked", "cuda": "chunked"}
    report = hlotool.explain(causal, Q, K, V, kernel="pallas_tpu").sites[0]
    assert report.kernels["cpu"] is None and "pallas_tpu: does not run on cpu" in report.reason
    with pytest.raises(HlotoolError, match="no kernel named 'flash9'"):
        hlotool.flash_jit(causal, kernel="flash9")


def test_jit_api_static_args_and_report_text():
    def scaled(q, k, v, scale):
        return attend(q, k, v, scale=scale)

    fast = hlotool.flash_jit(scaled, static_argnames="scale")
    assert relative_error(fast(Q, K, V, scale=0.5), jax.jit(scaled, static_argnames="scale")(
        Q, K, V, scale=0.5)) < 1e-5
    assert "hlotool_flash" in fast.lower(Q, K, V, scale=0.5).as_text()
    assert fast.__name__ == "scaled"
    text = str(hlotool.explain(scaled, Q, K, V, 0.5))
    assert "1 site(s), 1 rewritten" in text and "cpu: chunked" in text


@pytest.mark.slow
def test_validate_accepts_a_correct_rewrite():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = hlotool.flash_jit(causal, validate=True)
        assert relative_error(fast(Q, K, V), jax.jit(causal)(Q, K, V)) < 1e-5
    assert "hlotool_flash" in fast.lower(Q, K, V).as_text()
    # Equal values: the exact gradients are zero, rounding noise must not count as an error.
    ones = jnp.ones_like(Q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hlotool.flash_jit(causal, validate=True)(ones, ones, ones)
    exported = jax.export.export(fast, platforms=["tpu"])(Q, K, V)
    assert exported.mlir_module().count("stablehlo.custom_call @tpu_custom_call") == 1


def test_validate_falls_back_and_names_the_site(monkeypatch):
    real = lower.restore
    monkeypatch.setattr(lower, "restore", lambda *a: real(*a) * 1.01)
    fast = hlotool.flash_jit(causal, validate=True)
    with pytest.warns(UserWarning, match=r"attention at .*test_rewrite.py:\d+ stays native for "
                                         r"this signature: "
                                         r"outputs or gradients differ"):
        got = fast(Q, K, V)
    np.testing.assert_array_equal(got, jax.jit(causal)(Q, K, V))
    assert "hlotool_flash" not in fast.lower(Q, K, V).as_text()


@pytest.mark.parametrize("fn, args", NEGATIVES, ids=[fn.__name__ for fn, _ in NEGATIVES])
def test_negatives_untouched(fn, args):
    """Look-alikes of attention: no site, and the traced program is jax's own."""
    assert hlotool.explain(fn, *args).sites == ()
    fast = hlotool.flash_jit(fn)
    assert str(fast.trace(*args).jaxpr) == str(jax.jit(fn).trace(*args).jaxpr)
    np.testing.assert_array_equal(fast(*args), jax.jit(fn)(*args))


def test_identical_sites_share_one_traced_kernel_and_keep_their_lines():
    def two_layers(q, k, v):
        return causal(q, k, v) + causal(q, v, k)

    calls = [e for e in jax.make_jaxpr(flash.Rewritten(two_layers, "auto"))(Q, K, V).eqns
             if e.params.get("name") == "hlotool_flash"]
    # One trace, each copy under its own site's scope (so a profile tells them apart).
    bodies = [e.params["jaxpr"] for e in calls]
    assert len(calls) == 2 and str(bodies[0]) == str(bodies[1])
    for i, (call, body) in enumerate(zip(calls, bodies), 1):
        scope = f"hlotool/site{i}:test_rewrite.py:"
        assert scope in str(call.source_info.name_stack)
        assert all(str(e.source_info.name_stack).startswith(scope) for e in body.jaxpr.eqns)
    lines = [next(jaxcompat.user_frames(e.source_info.traceback)).start_line for e in calls]
    assert lines == [attend.__code__.co_firstlineno + 6] * 2  # attend's `return ... softmax`
