"""hlotool's Pallas TPU kernel for dropout (kernels/dropout_tpu.py): run in Pallas' interpret
mode its outputs and gradients equal the reference kernel's with the program's whole keep
mask; exported for TPU a train step holds its forward, dK/dV and dQ calls and no
[L, L] operand; libtpu compiles it for a TPU without one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import random as extend_random

import hlotool
from hlotool.kernels import KernelError, drawn, get
from hlotool.kernels.dropout_tpu import DropoutTpu
from test_drawn import drawn_mask, flax_dropout_step
from test_rewrite_models import relative_error

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def test_the_kernel_body_threefry_is_jax_s():
    """`drawn.threefry2x32` (uint32 arithmetic, what a kernel body can lower) gives jax's
    threefry2x32 primitive's words on random counters and keys."""
    rng = np.random.default_rng(0)
    k0, k1, x0, x1 = (jnp.asarray(rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32))
                      for _ in range(4))
    want = extend_random.threefry2x32_p.bind(k0, k1, x0, x1)
    got = drawn.threefry2x32(k0, k1, x0, x1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert drawn.unavailable(in_kernel=True) is None


def _grads(kernel, q, k, v, post, dtype, **options):
    def f(q, k, v):
        out = kernel(q, k, v, scale=0.25, post_mask=post, **options)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)


CASES = {
    # (Lq, Lk), causal, kv lengths, dtype, drawn per head (else one mask for all)
    "causal GQA, Lq < Lk": ((150, 300), True, None, "float32", True),
    "causal, a batch row with no key": ((300, 150), True, (150, 0), "float32", True),
    "key padding, one mask for all": ((130, 130), False, (100, 7), "float32", False),
    "bfloat16": ((256, 256), True, None, "bfloat16", True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_outputs_and_gradients_equal_the_reference_with_the_whole_mask(case):
    """Lengths that are not lane multiples (the kernel pads them), 4 query heads on 1 K/V
    head, top-left causal with more or fewer keys than queries, kv lengths (one batch row
    with none: its rows are 0), and bf16."""
    (lq, lk), causal, lengths, dtype, per_head = CASES[case]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 32)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, lk, 1, 32)), dtype) for _ in range(2))
    mask = drawn_mask((2, 4, lq, lk) if per_head else (1, 1, lq, lk), jax.random.key(3))
    options = dict(causal=causal,
                   kv_lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32))
    got = _grads(DropoutTpu(interpret=True), q, k, v, mask, dtype, **options)
    want = _grads(get("reference"), q, k, v, mask.dense(), dtype, **options)
    assert relative_error(got, want) < TOLERANCE[dtype]
    # Dropout is applied: without it the result differs.
    plain = _grads(get("reference"), q, k, v, None, dtype, **options)
    assert relative_error(plain, want) > 1e-2


@pytest.mark.slow
def test_a_mask_read_whole_gives_what_the_drawn_one_gives():
    """The dense multiplier (a mask that cannot be drawn) goes through the same kernels."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, 32)), jnp.float32) for _ in range(3))
    mask = drawn_mask((1, 2, 200, 200), jax.random.key(4))
    kernel = DropoutTpu(interpret=True)
    drawn_result = _grads(kernel, q, k, v, mask, "float32", causal=True)
    read = _grads(kernel, q, k, v, mask.dense(), "float32", causal=True)
    assert relative_error(read, drawn_result) < 1e-6


@pytest.mark.slow
def test_a_boolean_mask_after_the_softmax_is_a_multiplier_of_0_and_1():
    """where(mask, p, 0) (Keras' masked softmax and its dropout), read per tile."""
    rng = np.random.default_rng(6)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 160, 2, 32)), jnp.float32) for _ in range(3))
    post = jnp.asarray(rng.random((2, 1, 160, 160)) < 0.7)
    got = _grads(DropoutTpu(interpret=True), q, k, v, post, "float32", causal=True)
    want = _grads(get("reference"), q, k, v, post, "float32", causal=True)
    assert relative_error(got, want) < 1e-5


@pytest.mark.slow
def test_a_finite_fill_with_a_row_that_sees_no_key_runs_in_chunked():
    """Under fill -1e9 a row whose keys are all hidden weighs every key equally, each times
    its dropout multiplier: the kernel (which gives such rows 0) hands the call to the chunked
    kernel, so the result is still the reference's; with every row seeing a key it is its own."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 32)), jnp.float32) for _ in range(3))
    mask = drawn_mask((2, 2, 128, 128), jax.random.key(5))
    keys = jnp.ones((2, 1, 1, 128), bool).at[1].set(False)
    kernel = DropoutTpu(interpret=True)
    for padding in (keys, keys.at[1, ..., :3].set(True)):
        options = dict(mask=padding, fill=-1e9)
        got = _grads(kernel, q, k, v, mask, "float32", **options)
        want = _grads(get("reference"), q, k, v, mask.dense(), "float32", **options)
        assert relative_error(got, want) < 1e-5
    run = jax.make_jaxpr(lambda q: kernel(q, k, v, scale=0.25, post_mask=mask, mask=keys,
                                          fill=-1e9))(q)
    assert "cond" in str(run)


def test_it_refuses_what_splash_and_flash_take_and_masks_it_cannot_skip():
    kernel = get("dropout_tpu")
    q = jnp.zeros((1, 128, 2, 32))
    with pytest.raises(KernelError, match="neither dropout nor a mask after the softmax"):
        kernel(q, q, q, scale=1.0, causal=True)
    mask = drawn_mask((1, 2, 128, 128), jax.random.key(0))
    with pytest.raises(KernelError, match="additive bias unsupported"):
        kernel(q, q, q, scale=1.0, bias=jnp.zeros((128, 128)), post_mask=mask)
    with pytest.raises(KernelError, match="a boolean mask varying along QK"):
        kernel(q, q, q, scale=1.0, mask=jnp.ones((1, 1, 128, 128), bool), post_mask=mask)


def _tpu_export(step, args):
    return jax.export.export(hlotool.flash_jit(step), platforms=["tpu"])(*args)


@pytest.mark.slow
def test_a_flax_train_step_with_dropout_exports_the_kernel_for_tpu():
    """flax attention with dropout and a causal mask under value_and_grad: the TPU export
    holds this kernel's forward, dK/dV and dQ calls, none of which takes an [L, L] operand,
    and no draw of the whole mask reaches a kernel."""
    step, args = flax_dropout_step()
    (site,) = hlotool.explain(step, *args).sites
    assert site.kernels["tpu"] == "dropout_tpu", site.reason
    text = _tpu_export(step, args).mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @tpu_custom_call" in ln]
    assert len(calls) == 3, len(calls)
    assert all("512x512" not in c.rsplit(" : (", 1)[1] for c in calls)
    for name in ("dropout_tpu_forward", "dropout_tpu_dkv", "dropout_tpu_dq"):
        assert name in text


@pytest.mark.slow
def test_the_kernel_compiles_for_a_tpu_deviceless(monkeypatch):
    """libtpu compiles the Mosaic kernels (forward and backward) for v5e with bf16 inputs,
    lengths not a multiple of the tiles and a drawn mask."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topo = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu")
    sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
    b, length, h, d = 1, 1000, 4, 64

    def loss(q, k, v, key):
        mask = drawn_mask((b, h, length, length), key)
        out = DropoutTpu()(q, k, v, scale=d ** -0.5, causal=True, post_mask=mask)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((b, length, h, d), jnp.bfloat16, sharding=sharding)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = f.trace(x, x, x, key).lower().compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3


def test_its_cost_counts_the_draws():
    """Forward and backward visit the same scores; the backward draws each multiplier twice
    more (dK/dV and dQ), DRAW_OPS uint32 operations each."""
    from hlotool.kernels.dropout_tpu import DRAW_OPS
    from hlotool.site import AttentionSite

    site = AttentionSite(batch=1, q_len=4096, kv_len=4096, num_q_heads=8, num_kv_heads=8,
                         head_dim=128, v_head_dim=128, dtype="bfloat16", scale=1.0,
                         mask="causal", dropout=True)
    kernel, splash_like = get("dropout_tpu"), get("pallas_tpu")
    fwd, both = kernel.cost(site), kernel.cost(site, backward=True)
    visited = fwd.transcendentals
    assert visited == 4096 * 4096 * 8 * 36 // 64  # 512-tiles, causal
    assert fwd.flops - splash_like.cost(site).flops == DRAW_OPS * visited
    assert both.hbm_bytes == splash_like.cost(site, backward=True).hbm_bytes
