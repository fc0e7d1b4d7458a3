"""Dropout's keep mask drawn in the kernel, tile by tile (kernels/drawn.py): the bits of each
tile are those jax.random draws for the whole [B, H, Lq, Lk] array at its positions, and the
program's own equations turn them into the mask. A rewritten training program keeps its
results, and no [B, H, Lq, Lk] mask is in its memory."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlotool
from hlotool.kernels import drawn, get
from hlotool.kernels.drawn import DrawnMask
from hlotool.passes.from_jaxpr import detect_jaxpr
from test_rewrite_models import relative_error

KEEP = 0.8


def dropout_multiplier(shape):
    """flax's and Hugging Face's dropout factor: bernoulli keep mask / keep_prob."""
    def draw(key):
        return jax.random.bernoulli(key, KEEP, shape).astype(jnp.float32) / KEEP
    return draw


def drawn_mask(shape, key):
    cone = jax.make_jaxpr(dropout_multiplier(shape))(key).jaxpr
    assert drawn.check(cone, shape) is None
    return DrawnMask.of(cone, (key,), jnp.float32)


def test_the_supported_jax_versions_draw_tiles():
    assert drawn.usable() is None


@pytest.mark.parametrize("c", [1, 0xFFFF, 0x10000, 2**31 + 12345, 2**32 - 1])
def test_wide_products_are_exact(c):
    a = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64)
    high, low = drawn._mul_wide(jnp.asarray(a.astype(np.uint32)), c)
    got = (np.asarray(high).astype(object) << 32) | np.asarray(low).astype(object)
    assert list(got) == [int(x) * c for x in a]


@pytest.mark.parametrize("start", [(0, 0), (3, 17), (37, 88)])
@pytest.mark.slow
def test_tiles_are_the_whole_draw_at_their_positions(start):
    shape, key = (2, 3, 45, 97), jax.random.key(11)
    mask = drawn_mask(shape, key)
    want = np.asarray(dropout_multiplier(shape)(key))
    i, j = start
    got = np.asarray(jax.jit(lambda m: m.tile(i, 8, j, 9))(mask))
    inside = want[:, :, i:i + 8, j:j + 9]
    np.testing.assert_array_equal(got[:, :, :inside.shape[2], :inside.shape[3]], inside)
    # Past the end (a kernel's padding): zeros, not more of the draw.
    assert not got[:, :, inside.shape[2]:].any() and not got[..., inside.shape[3]:].any()
    np.testing.assert_array_equal(np.asarray(mask.dense()), want)


def test_positions_beyond_32_bits_count_as_jax_counts_them():
    """At [1, 2, 70000, 70000] flat positions pass 2³²: the counter's high word is used. The
    bits are threefry2x32 of (position >> 32, position mod 2³²), computed here in Python."""
    full, key = (1, 2, 70000, 70000), jax.random.key(5)
    i, j = 69990, 69980
    got = np.asarray(drawn.tile_bits(jax.random.key_data(key), full, i, 4, j, 8))
    rows = (np.arange(2)[:, None] * full[2] + i + np.arange(4)[None, :]).astype(np.uint64)
    flat = rows[:, :, None] * np.uint64(full[3]) + (j + np.arange(8)).astype(np.uint64)
    assert flat.max() >= 2**32
    data = jax.random.key_data(key)
    x1, x2 = drawn._threefry().bind(data[0], data[1], jnp.asarray(flat >> 32, jnp.uint32),
                                    jnp.asarray(flat & 0xFFFFFFFF, jnp.uint32))
    np.testing.assert_array_equal(got[0], np.asarray(x1 ^ x2))


@pytest.mark.parametrize("lengths", [(83, 83), (40, 83)])
@pytest.mark.parametrize("per_head", [True, False], ids=["per head", "one for all (flax)"])
@pytest.mark.slow
def test_the_chunked_kernel_draws_what_it_would_read(lengths, per_head):
    """Blocks that do not divide the lengths, GQA (2 query heads per K/V head), causal, a
    mask per batch row and head or one broadcast over them: out, dq, dk, dv with the mask
    drawn per tile equal those with the program's whole mask."""
    lq, lk = lengths
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, lq, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, lk, 2, 16)), jnp.float32) for _ in range(2))
    key = jax.random.key(3)
    mask = drawn_mask((2, 4, lq, lk) if per_head else (1, 1, lq, lk), key)
    kernel = get("chunked")
    kernel.block_q, kernel.block_k = 16, 8
    try:
        def run(post):
            def f(q, k, v):
                return kernel(q, k, v, scale=0.25, causal=True, post_mask=post)
            return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(
                q, k, v)
        got, want = run(mask), run(mask.dense())
    finally:
        kernel.block_q, kernel.block_k = 512, 256
    assert relative_error(got, want) < 1e-6


def flax_dropout_step():
    """A train step through flax's attention with dropout (its keep mask from the 'dropout'
    rng): value_and_grad of the loss, as a flax training loop takes it."""
    model = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, dropout_rate=0.1,
                                            deterministic=False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 512, 64)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def step(params, x, key):
        def loss(params):
            y = model.apply(params, x, mask=nn.make_causal_mask(x[..., 0]),
                            rngs={"dropout": key})
            return jnp.mean(jnp.sin(y))
        return jax.value_and_grad(loss)(params)

    return step, (params, x, jax.random.key(7))


@pytest.mark.slow
def test_a_flax_train_step_with_dropout_draws_the_mask_in_the_kernel():
    step, args = flax_dropout_step()
    report = hlotool.explain(step, *args)
    (site,) = report.sites
    assert site.rewritten and site.site.dropout, str(report)
    assert "chunked/dropout_tpu draws the keep mask per tile from its key" in site.reason
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
    text = str(fast.trace(*args).jaxpr)
    # The program's draw of the whole [1, 4, 512, 512] mask is gone; the kernel draws tiles.
    assert "random_bits" in str(jax.make_jaxpr(step)(*args))
    assert "random_bits" not in text and "threefry2x32" in text
    assert detect_jaxpr(fast.trace(*args).jaxpr) == []


@pytest.mark.slow
def test_with_bits_that_depend_on_the_whole_shape_the_mask_is_read_whole():
    """With jax_threefry_partitionable off, jax draws bits for the array as a whole: no tile
    can be drawn alone. The kernel then reads the program's mask, says so, and the step
    keeps its results."""
    previous = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        step, args = flax_dropout_step()
        (site,) = hlotool.explain(step, *args).sites
        assert site.rewritten and ("chunked/dropout_tpu reads the keep mask whole "
                                   "(jax_threefry_partitionable is off") in site.reason
        fast = hlotool.flash_jit(step)
        assert relative_error(fast(*args), jax.jit(step)(*args)) < 1e-5
        text = str(fast.trace(*args).jaxpr)
        assert "random_bits" in text and "threefry2x32" not in text
    finally:
        jax.config.update("jax_threefry_partitionable", previous)


@pytest.mark.slow
def test_a_long_dropout_step_holds_no_mask_in_memory():
    """At L = 4096 (H = 8) one [B, H, L, L] float32 array is 512 MiB: the rewritten step's
    compiled temporaries stay below a quarter of it (the kernel reads no mask operand)."""
    b, length, h, d = 1, 4096, 8, 64

    def attention(q, k, v, key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = p * dropout_multiplier(p.shape)(key)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    def step(q, k, v, key):
        return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, key) ** 2),
                        argnums=(0, 1, 2))(q, k, v)

    args = [jax.ShapeDtypeStruct((b, length, h, d), jnp.float32)] * 3 + [
        jax.eval_shape(lambda: jax.random.key(0))]
    compiled = hlotool.flash_jit(step).lower(*args).compile()
    one_matrix = b * h * length * length * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < one_matrix / 4, temp
    assert not re.search(rf"f32\[{b},{h},{length},{length}\]", compiled.as_text())
