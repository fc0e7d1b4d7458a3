"""Blockwise online-softmax attention in plain JAX: the portable kernel and the CPU default.

Queries are processed in blocks of `block_q`, keys in blocks of `block_k`; a query block
carries its running max, normalizer and output accumulator across key blocks (FlashAttention),
so memory is O(L·D) plus one [Hq, block_q, block_k] score tile. Under `causal`, key blocks
entirely above the diagonal are skipped by the loop bounds, not computed and masked. The
backward pass (custom VJP) recomputes score tiles from Q, K, V and the saved log-sum-exp
instead of storing probabilities.

Internal layout: q [B, Hkv, G, Lq, D] with G = Hq / Hkv query heads per K/V head, so GQA
never repeats K/V; k [B, Hkv, Lk, D]; v [B, Hkv, Lk, Dv]; bias and mask [B|1, Hkv|1, G|1,
Lq|1, Lk|1].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from hlotool.kernels.base import (
    AttentionKernel,
    Call,
    Features,
    KernelCost,
    KernelError,
    Support,
    flash_cost,
    zero_invalid_keys,
)
from hlotool.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class _Static:
    """Trace-time constants of one call (hashable: custom_vjp non-differentiable args)."""

    block_q: int
    block_k: int
    kv_len: int  # unpadded; keys at and beyond it are masked
    causal: bool


def _cdiv(a, b):
    return (a + b - 1) // b


def _tile(x: jax.Array | None, i, j, st: _Static) -> jax.Array | None:
    """The [.., block_q|1, block_k|1] tile (i, j) of a broadcastable bias/mask operand."""
    if x is None:
        return None
    if x.shape[3] != 1:
        x = lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, axis=3)
    if x.shape[4] != 1:
        x = lax.dynamic_slice_in_dim(x, j * st.block_k, st.block_k, axis=4)
    return x


def _scores(q_i, k_j, bias, mask, kv_lengths, i, j, st: _Static) -> jax.Array:
    """f32 [B, Hkv, G·block_q, block_k] scores of tile (i, j), -inf where not visible.

    q_i: [B, Hkv, G·block_q, D], the G query heads of a K/V head stacked as rows, so each
    tile is one batched matmul per K/V head.
    """
    s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=jnp.float32)
    b, hkv, rows, bk = s.shape
    s = s.reshape(b, hkv, rows // st.block_q, st.block_q, bk)
    if bias is not None:
        s = s + _tile(bias, i, j, st).astype(jnp.float32)
    k_pos = j * st.block_k + lax.iota(jnp.int32, st.block_k)
    visible = None
    if kv_lengths is not None:
        visible = k_pos < kv_lengths[:, None, None, None, None]
    elif st.kv_len % st.block_k:
        visible = k_pos < st.kv_len
    if st.causal:
        q_pos = i * st.block_q + lax.iota(jnp.int32, st.block_q)
        causal = q_pos[:, None] >= k_pos[None, :]
        visible = causal if visible is None else visible & causal
    if mask is not None:
        m = _tile(mask, i, j, st)
        visible = m if visible is None else visible & m
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    return s.reshape(b, hkv, rows, bk)


def _rows(x: jax.Array, i, st: _Static) -> jax.Array:
    """Query block i of a [B, Hkv, G, Lq, ...] array as [B, Hkv, G·block_q, ...]."""
    x = lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, axis=3)
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _num_k_blocks(i, nk: int, st: _Static):
    """Key blocks query block i visits: all, or under `causal` those touching j <= i."""
    if not st.causal:
        return nk
    return jnp.minimum(nk, _cdiv((i + 1) * st.block_q, st.block_k))


def _first_q_block(j, st: _Static):
    """First query block that sees key block j (0 unless causal)."""
    if not st.causal:
        return 0
    return (j * st.block_k) // st.block_q


def _forward(q, k, v, bias, mask, kv_lengths, st: _Static):
    """out [B, Hkv, G, Lq, Dv] (f32) and lse [B, Hkv, G, Lq] (+inf for rows with no key)."""
    b, hkv, g, lq, _ = q.shape
    dv = v.shape[-1]
    nq, nk = lq // st.block_q, k.shape[2] // st.block_k

    def query_block(i):
        q_i = _rows(q, i, st)

        def key_block(j, carry):
            m, l, acc = carry
            k_j = lax.dynamic_slice_in_dim(k, j * st.block_k, st.block_k, axis=2)
            v_j = lax.dynamic_slice_in_dim(v, j * st.block_k, st.block_k, axis=2)
            s = _scores(q_i, k_j, bias, mask, kv_lengths, i, j, st)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives 0.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            corr = jnp.exp(m - shift)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v_j.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        rows = (b, hkv, g * st.block_q)
        init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
                jnp.zeros(rows + (dv,), jnp.float32))
        m, l, acc = lax.fori_loop(0, _num_k_blocks(i, nk, st), key_block, init)
        empty = l == 0
        out = acc / jnp.where(empty, 1.0, l)[..., None]
        lse = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))
        return out.reshape(b, hkv, g, st.block_q, dv), lse.reshape(b, hkv, g, st.block_q)

    if nq == 1:
        return query_block(0)
    out, lse = lax.map(query_block, jnp.arange(nq))
    # [nq, B, Hkv, G, bq, ...] -> [B, Hkv, G, nq * bq, ...]
    out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, lq, dv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hkv, g, lq)
    return out, lse


def _backward(q, k, v, bias, mask, kv_lengths, out, lse, do, st: _Static):
    """dq, dk, dv, dbias (f32; dbias None without bias), recomputing each score tile once.

    One loop over key blocks accumulates that block's dk, dv over the query blocks that see
    it, and adds each tile's contribution into dq.
    """
    b, hkv, g, lq, d = q.shape
    nq, nk = lq // st.block_q, k.shape[2] // st.block_k
    delta = jnp.sum(out * do, axis=-1)  # [B, Hkv, G, Lq]

    def key_block(j, carry):
        dq, dk, dv, dbias = carry
        k_j = lax.dynamic_slice_in_dim(k, j * st.block_k, st.block_k, axis=2)
        v_j = lax.dynamic_slice_in_dim(v, j * st.block_k, st.block_k, axis=2)

        def query_block(i, inner):
            dq, dk_j, dv_j, dbias = inner
            q_i, do_i = _rows(q, i, st), _rows(do, i, st)
            lse_i, delta_i = _rows(lse, i, st), _rows(delta, i, st)
            s = _scores(q_i, k_j, bias, mask, kv_lengths, i, j, st)
            p = jnp.exp(s - lse_i[..., None])
            dv_j = dv_j + jnp.einsum("bhqk,bhqd->bhkd", p, do_i)
            dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None])
            dk_j = dk_j + jnp.einsum("bhqk,bhqd->bhkd", ds, q_i,
                                     preferred_element_type=jnp.float32)
            dq_i = _rows(dq, i, st) + jnp.einsum("bhqk,bhkd->bhqd", ds, k_j,
                                                 preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(
                dq, dq_i.reshape(b, hkv, g, st.block_q, d), i * st.block_q, axis=3)
            if dbias is not None:
                ds = ds.reshape(b, hkv, g, st.block_q, -1)
                axes = tuple(a for a in range(5) if dbias.shape[a] == 1)
                ds_b = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
                starts = (0, 0, 0, i * st.block_q if dbias.shape[3] != 1 else 0,
                          j * st.block_k if dbias.shape[4] != 1 else 0)
                ds_b = ds_b + lax.dynamic_slice(dbias, starts, ds_b.shape)
                dbias = lax.dynamic_update_slice(dbias, ds_b, starts)
            return dq, dk_j, dv_j, dbias

        zeros_k = jnp.zeros(k_j.shape, jnp.float32)
        zeros_v = jnp.zeros(v_j.shape, jnp.float32)
        dq, dk_j, dv_j, dbias = lax.fori_loop(
            _first_q_block(j, st), nq, query_block, (dq, zeros_k, zeros_v, dbias))
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, j * st.block_k, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, j * st.block_k, axis=2)
        return dq, dk, dv, dbias

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32),
            None if bias is None else jnp.zeros(bias.shape, jnp.float32))
    return lax.fori_loop(0, nk, key_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash(q, k, v, bias, mask, kv_lengths, st: _Static):
    return _forward(q, k, v, bias, mask, kv_lengths, st)[0]


def _flash_fwd(q, k, v, bias, mask, kv_lengths, st):
    out, lse = _forward(q, k, v, bias, mask, kv_lengths, st)
    return out, (q, k, v, bias, mask, kv_lengths, out, lse)


def _flash_bwd(st, residuals, do):
    q, k, v, bias, mask, kv_lengths, out, lse = residuals
    dq, dk, dv, dbias = _backward(q, k, v, bias, mask, kv_lengths, out, lse,
                                  do.astype(jnp.float32), st)
    cast = lambda d, x: None if x is None else d.astype(x.dtype)  # noqa: E731
    return cast(dq, q), cast(dk, k), cast(dv, v), cast(dbias, bias), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_axis(x: jax.Array, axis: int, to: int, value=0, *, broadcast: bool = False):
    """`x` zero-padded (or `value`-padded) along `axis` to length `to`; with `broadcast`, an
    axis of size 1 is a broadcast one and stays as is."""
    if x.shape[axis] == to or (broadcast and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _block(length: int, block: int) -> int:
    """Block size for a length: `block`, or the whole length rounded up to 8 if shorter."""
    return block if length > block else _cdiv(length, 8) * 8


class Chunked(AttentionKernel):
    """Blockwise online-softmax in plain JAX; runs everywhere, any mask, GQA, any head dim.

    block_q, block_k: tile sizes (lengths are padded up to a multiple; the padding is masked).
    """

    name = "chunked"
    platforms = ("cpu", "tpu", "cuda")

    def __init__(self, block_q: int = 512, block_k: int = 256):
        if block_q % 8 or block_k % 8 or block_q <= 0 or block_k <= 0:
            raise KernelError(f"block sizes must be positive multiples of 8, got "
                             f"block_q={block_q}, block_k={block_k}")
        self.block_q, self.block_k = block_q, block_k

    def _check(self, site: AttentionSite, features: Features) -> Support:
        return Support.yes()

    def cost(self, site: AttentionSite, *, backward: bool = False) -> KernelCost:
        return flash_cost(site, block_q=_block(site.q_len, self.block_q),
                          block_k=_block(site.kv_len, self.block_k), backward=backward)

    def _attend(self, call: Call) -> jax.Array:
        call = zero_invalid_keys(call)
        b, lq, hq, d = call.q.shape
        lk, hkv = call.k.shape[1], call.k.shape[2]
        g = hq // hkv
        bq, bk = _block(lq, self.block_q), _block(lk, self.block_k)
        lq_p, lk_p = _cdiv(lq, bq) * bq, _cdiv(lk, bk) * bk
        st = _Static(bq, bk, lk, call.causal)
        # Scaling q (L·D) is cheaper than scaling every score tile (L·L).
        q = (call.q * jnp.asarray(call.scale, call.q.dtype)).reshape(b, lq, hkv, g, d)
        q = _pad_axis(jnp.transpose(q, (0, 2, 3, 1, 4)), 3, lq_p)
        k = _pad_axis(jnp.swapaxes(call.k, 1, 2), 2, lk_p)
        v = _pad_axis(jnp.swapaxes(call.v, 1, 2), 2, lk_p)

        def to5(x, fill):
            if x is None:
                return None
            bx, hx, qx, kx = x.shape
            x = x.reshape(bx, hkv if hx == hq else 1, g if hx == hq else 1, qx, kx)
            x = _pad_axis(x, 3, lq_p, fill, broadcast=True)
            return _pad_axis(x, 4, lk_p, fill, broadcast=True)

        # Padded keys sit at positions >= lk, so clamping the lengths masks them too.
        kv_lengths = None if call.kv_lengths is None else jnp.minimum(call.kv_lengths, lk)
        out = _flash(q, k, v, to5(call.bias, 0), to5(call.mask, False), kv_lengths, st)
        out = jnp.transpose(out[:, :, :, :lq], (0, 3, 1, 2, 4)).reshape(b, lq, hq, -1)
        return out.astype(call.q.dtype)
