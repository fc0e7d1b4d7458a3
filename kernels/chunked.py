"""Blockwise online-softmax attention in plain JAX: the portable kernel and the CPU default.

Queries are processed in blocks of `block_q`, keys in blocks of `block_k`; a query block
carries its running max, normalizer and output accumulator across key blocks (FlashAttention),
so memory is O(L·D) plus one [Hq, block_q, block_k] score tile. Under `causal` or a window,
key blocks entirely outside the band are skipped by the loop bounds, not computed and masked,
and the band is applied only on the tiles that cross its edges. The
backward pass (custom VJP) recomputes score tiles from Q, K, V and the saved row max and
normalizer instead of storing probabilities (kept apart, not as one log-sum-exp: beside a
finfo.min bias the max absorbs the log of the normalizer).

Hidden keys get exactly `fill` (see `hlotool.kernels.base`), and every variant there is
implemented: soft-capping on each score tile (its derivative 1 - tanh² in the backward), a
post-softmax mask (or dropout's multiplier) on the numerator only, read per tile or drawn
per tile from jax.random bits (`kernels.drawn.DrawnMask`), sinks as each row's starting
max and normalizer. With a finite fill the keys of skipped blocks still carry weight exp(fill -
max): they enter in closed form, through suffix sums of V over keys (forward) and prefix sums of
w·dO over queries (backward), so skipping stays exact (a post-softmax mask under a finite fill
would zero some of those keys, and a window hides keys on both sides: then no block is skipped
and the band is applied per tile). Keys the kernel itself pads to a block multiple are not in
the program and are always -inf.

Layout: q [B, Lq, Hkv, G, D] with G = Hq / Hkv query heads per K/V head, so GQA never
repeats K/V; k [B, Lk, Hkv, D]; v [B, Lk, Hkv, Dv]; out and dO as q: the caller's layouts.
Query blocks (of q, out, dO) are transposed to [B, Hkv, G·block_q, ..] as they are sliced
and out and dq written back in place; K and V are transposed whole, once, as the tiles
slice them nq/2 times on average (`_key_rows`). Bias and mask [B|1, Hkv|1, G|1, Lq|1,
Lk|1] (post_mask too); sinks [B, Hkv, G, Lq] (f32).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hlotool.hardware import Hardware
from hlotool.kernels.base import (
    EXTRAS,
    AttentionKernel,
    Call,
    Features,
    KernelCost,
    KernelError,
    Support,
    Band,
    cdiv,
    flash_cost,
    key_block_span,
    post_softmax,
    query_block_span,
    axes_varied_over,
    varying,
    zero_invalid_keys,
)
from hlotool.kernels.drawn import DrawnMask, dropped_by
from hlotool.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class _Static:
    """Trace-time constants of one call (hashable: custom_vjp non-differentiable args)."""

    block_q: int
    block_k: int
    kv_len: int  # unpadded; keys at and beyond it are padding, never seen
    band: Band | None  # (left, right): query i sees keys i - left .. i + right
    fill: float  # logit of a hidden key
    scale: float
    # Whether `scale` multiplies q's rows (in q's dtype, as each query block is sliced) rather
    # than each f32 score tile (see `Chunked._attend`).
    scale_q: bool = False
    softcap: float | None = None
    visit_all: bool = False  # a band, but no block skipped (see the module docstring)
    varying: frozenset = frozenset()  # mesh axes the operands vary over (in a shard_map body)
    q_len: int = 0  # unpadded, where the kernel pads the queries to a block multiple; else 0

    def real_rows(self, i, rows: int) -> jax.Array:
        """bool [rows, 1]: which rows of query block i's tiles (G·block_q of them, the G
        query heads of a K/V head stacked) are queries, not the kernel's padding."""
        position = i * self.block_q + lax.iota(jnp.int32, self.block_q)
        return jnp.tile(position < self.q_len, rows // self.block_q)[:, None]

    @property
    def skips(self) -> bool:
        """Whether key blocks outside the band are skipped."""
        return self.band is not None and not self.visit_all

    @property
    def skipped_keys_count(self) -> bool:
        """Whether skipped blocks (right of the band) carry weight that must be added back."""
        return self.skips and math.isfinite(self.fill)


def _tile(x: jax.Array | None, i, j, st: _Static) -> jax.Array | None:
    """The [.., block_q|1, block_k|1] tile (i, j) of a broadcastable bias/mask operand."""
    if x is None:
        return None
    if x.shape[3] != 1:
        x = lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, axis=3)
    if x.shape[4] != 1:
        x = lax.dynamic_slice_in_dim(x, j * st.block_k, st.block_k, axis=4)
    return x


def _scores(q_i, k_j, bias, mask, keys, i, j, st: _Static, banded: bool = True
            ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """f32 [B, Hkv, G·block_q, block_k] logits of tile (i, j) — `fill` where hidden, -inf on
    padding —, whether each key is visible (None when all are) and, under soft-capping, the
    tanh of each capped score (None without).

    q_i: [B, Hkv, G·block_q, D], the G query heads of a K/V head stacked as rows, so each
    tile is one batched matmul per K/V head. keys: (kv_lengths [B], q segment ids [B, Lq],
    kv segment ids [B, Lk], query mask [B|1, Lq]), each None when absent. `banded` False: the tile lies wholly
    inside the band, so the band is not applied.
    """
    kv_lengths, q_segments, kv_segments, query_mask = keys
    s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=jnp.float32)
    if st.scale != 1.0 and not st.scale_q:
        s = s * st.scale
    capped = None
    if st.softcap is not None:
        capped = jnp.tanh(s / st.softcap)
        s = st.softcap * capped
    b, hkv, rows, bk = s.shape
    s = s.reshape(b, hkv, rows // st.block_q, st.block_q, bk)
    if bias is not None:
        s = s + _tile(bias, i, j, st).astype(jnp.float32)
    k_pos = j * st.block_k + lax.iota(jnp.int32, st.block_k)
    visible = None
    if kv_lengths is not None:
        visible = k_pos < kv_lengths[:, None, None, None, None]
    if st.band is not None and banded:
        q_pos = i * st.block_q + lax.iota(jnp.int32, st.block_q)
        left, right = st.band
        offset = k_pos[None, :] - q_pos[:, None]
        inside = None if right is None else offset <= right
        if left is not None:
            inside = offset >= -left if inside is None else inside & (offset >= -left)
        visible = inside if visible is None else visible & inside
    if mask is not None:
        m = _tile(mask, i, j, st)
        visible = m if visible is None else visible & m
    if q_segments is not None:  # packed sequences: a query sees the keys of its own segment
        q_seg = lax.dynamic_slice_in_dim(q_segments, i * st.block_q, st.block_q, axis=1)
        kv_seg = lax.dynamic_slice_in_dim(kv_segments, j * st.block_k, st.block_k, axis=1)
        same = (q_seg[:, :, None] == kv_seg[:, None, :])[:, None, None]
        visible = same if visible is None else visible & same
    if query_mask is not None:  # query padding: a row hides every key
        kept = lax.dynamic_slice_in_dim(query_mask, i * st.block_q, st.block_q, axis=1)
        kept = kept[:, None, None, :, None]
        visible = kept if visible is None else visible & kept
    if visible is not None:
        visible = jnp.broadcast_to(visible, s.shape)
        s = jnp.where(visible, s, st.fill)
    if st.kv_len % st.block_k:
        s = jnp.where(k_pos < st.kv_len, s, -jnp.inf)
    flat = (b, hkv, rows, bk)
    return s.reshape(flat), None if visible is None else visible.reshape(flat), capped


@functools.cache
def _max_by_halves() -> bool:
    """Whether a row max is faster as elementwise maxima of halves: XLA:CPU in jaxlib 0.9
    rewrites a long row max into a reduce-window that took 2.9 ms on an [8, 512, 256] tile
    (by halves 0.27 ms; jax 0.9.0, this 2-core machine), and the forward twice its time.
    Later XLA:CPUs hand the reduction to YNNPACK, where halves cost 3× more (0.13 ms vs
    0.41 ms, jax 0.10.2). Asked of the compiler, not of a version number."""
    if jax.default_backend() != "cpu":
        return False
    try:  # compiled apart: the first use comes while jax traces the kernel
        hlo = jax.jit(lambda s: jnp.max(s, axis=-1)).lower(
            jax.ShapeDtypeStruct((8, 512, 256), jnp.float32)).compile().as_text()
    except Exception:  # noqa: BLE001 - then the plain max, which is never wrong
        return False
    return "reduce-window" in hlo


def _row_max(s: jax.Array) -> jax.Array:
    """max over the last axis (exact either way; see `_max_by_halves`)."""
    if _max_by_halves():
        while s.shape[-1] > 8 and s.shape[-1] % 2 == 0:
            half = s.shape[-1] // 2
            s = jnp.maximum(s[..., :half], s[..., half:])
    return jnp.max(s, axis=-1)


def _keep(post, shape: tuple[int, ...], i, j, st: _Static):
    """Tile (i, j) of the post-softmax mask in a score tile's `shape` [B, Hkv, G·block_q,
    block_k] (None without one): an operand's tile, or one drawn here (`DrawnMask`,
    [B, Hq, ...] in head order). Apply it with `base.post_softmax`."""
    if post is None:
        return None
    b, hkv, rows, bk = shape
    if isinstance(post, DrawnMask):
        keep = post.tile(i * st.block_q, st.block_q, j * st.block_k, st.block_k)
        heads = keep.shape[1] > 1
        keep = keep.reshape(keep.shape[0], hkv if heads else 1, -1 if heads else 1,
                            st.block_q, bk)
        if post.also is not None:
            keep = dropped_by(_tile(post.also, i, j, st), keep)
    else:
        keep = _tile(post, i, j, st)
    keep = jnp.broadcast_to(keep, (b, hkv, rows // st.block_q, st.block_q, bk))
    return keep.reshape(shape)


def _kept(p, keep):
    """`p` after the post-softmax mask tile `keep` (`_keep`; None: no mask)."""
    return p if keep is None else post_softmax(p, keep)


def _rows(x: jax.Array, i, st: _Static) -> jax.Array:
    """Query block i of a [B, Hkv, G, Lq, ...] array as [B, Hkv, G·block_q, ...]."""
    x = lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, axis=3)
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])


def _key_blocks(i, nk: int, st: _Static):
    """[first, end) of the key blocks query block i visits: all, or those the band reaches."""
    return key_block_span(i, nk, st.block_q, st.block_k, st.band if st.skips else None,
                          maximum=jnp.maximum, minimum=jnp.minimum)


def _inside_key_blocks(i, st: _Static):
    """[first, end) of the key blocks whose tile with query block i lies wholly inside the
    band (possibly empty); only the tiles around the band's edges need it applied."""
    left, right = st.band
    bq, bk = st.block_q, st.block_k
    first = 0 if left is None else -((left - i * bq - bq + 1) // bk)  # ⌈(i·bq+bq-1-left)/bk⌉
    end = None if right is None else (i * bq + right + 1) // bk
    return first, end


def _edges_then_inside(first, end, inside, body, init, st: _Static):
    """`body(banded)` over blocks [first, end) as `lax.fori_loop`s: with the band applied on
    the blocks outside `inside` ([first, end) of blocks wholly inside it), without inside."""
    init = varying(init, st.varying)
    if st.band is None:
        return lax.fori_loop(first, end, body(False), init)
    a, b = inside
    a = jnp.clip(a, first, end)
    b = end if b is None else jnp.clip(b, a, end)
    carry = lax.fori_loop(first, a, body(True), init)
    carry = lax.fori_loop(a, b, body(False), carry)
    return lax.fori_loop(b, end, body(True), carry)


def _key_loop(i, nk: int, body, init, st: _Static):
    """`body(banded)` (a `fori_loop` body) over the key blocks query block i visits, the band
    applied only on the tiles that cross its edges; and the end of those key blocks."""
    first, end = _key_blocks(i, nk, st)
    inside = None if st.band is None else _inside_key_blocks(i, st)
    return _edges_then_inside(first, end, inside, body, init, st), end


def _query_rows(x, i, st: _Static) -> jax.Array:
    """Query block i of x [B, Lq, Hkv, G, ...] as [B, Hkv, G·block_q, ...]: one copy per
    block, where transposing the whole of q (or dO, or scaling q) would write a fresh L-sized
    buffer, whose first touch alone costs this machine ~0.5 ms per MiB."""
    b, _, hkv, g = x.shape[:4]
    x = lax.dynamic_slice_in_dim(x, i * st.block_q, st.block_q, axis=1)
    x = jnp.moveaxis(x, 1, 3)
    return x.reshape((b, hkv, g * st.block_q) + x.shape[4:])


def _scaled_q(q_i: jax.Array, st: _Static) -> jax.Array:
    """A block of q with `scale` applied, in q's dtype, under `scale_q`."""
    return q_i * jnp.asarray(st.scale, q_i.dtype) if st.scale_q else q_i


def _key_rows(x_t, j, st: _Static) -> jax.Array:
    """Key block j [B, Hkv, block_k, D] of k or v transposed to [B, Hkv, Lk, D]. Transposed
    whole, once: a transposing slice per tile costs ~3× a plain one, and a causal forward
    slices each key block nq/2 times on average."""
    return lax.dynamic_slice_in_dim(x_t, j * st.block_k, st.block_k, axis=2)


def _forward(q, k_t, v_t, bias, mask, keys, post, sinks, st: _Static):
    """out [B, Lq, Hkv, G, Dv] (f32), each row's max and normalizer [B, Hkv, G, Lq] (0 and 1
    for a row that saw nothing, whose out is then zeros) and its log-sum-exp (-inf for such a
    row: what a caller merging calls over parts of the keys weighs it by). A row's sink
    starts its max and normalizer (weight exp(sink - max), no value).

    q [B, Lq, Hkv, G, D] in the caller's layout, each block transposed as it is sliced, and
    each query block's out written into its place in the one output buffer; k_t [B, Hkv, Lk,
    D], v_t [B, Hkv, Lk, Dv] (`_key_rows`).
    """
    b, lq, hkv, g, _ = q.shape
    dv = v_t.shape[-1]
    nq, nk = lq // st.block_q, k_t.shape[2] // st.block_k
    if st.skipped_keys_count:
        # suffix[j] = sum of v over keys j .. kv_len-1 (v is zero beyond kv_len)
        suffix = jnp.cumsum(v_t[:, :, ::-1].astype(jnp.float32), axis=2)[:, :, ::-1]
        suffix = jnp.concatenate([suffix, jnp.zeros_like(suffix[:, :, :1])], axis=2)

    def query_block(i, results):
        q_i = _scaled_q(_query_rows(q, i, st), st)

        def key_block(banded, j, carry):
            m, l, acc = carry
            k_j, v_j = _key_rows(k_t, j, st), _key_rows(v_t, j, st)
            s, _, _ = _scores(q_i, k_j, bias, mask, keys, i, j, st, banded)
            m_new = jnp.maximum(m, _row_max(s))
            # Rows that have seen no key yet keep m = -inf; shift them by 0 so exp gives 0.
            shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - shift[..., None])
            corr = jnp.exp(m - shift)
            l = l * corr + jnp.sum(p, axis=-1)
            kept = _kept(p, _keep(post, p.shape, i, j, st))
            pv = jnp.einsum("bhqk,bhkd->bhqd", kept.astype(v_j.dtype), v_j,
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        rows = (b, hkv, g * st.block_q)
        if sinks is None:
            m0, l0 = jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32)
        else:
            m0 = _rows(sinks, i, st)
            l0 = jnp.where(m0 > -jnp.inf, 1.0, 0.0)
        init = (m0, l0, jnp.zeros(rows + (dv,), jnp.float32))
        (m, l, acc), end = _key_loop(i, nk, lambda banded: functools.partial(key_block, banded),
                                     init, st)
        if st.skipped_keys_count:
            # The keys of the blocks not visited, each with logit `fill`, in closed form.
            start = jnp.minimum(end * st.block_k, st.kv_len)
            count = (st.kv_len - start).astype(jnp.float32)
            m_new = jnp.where(count > 0, jnp.maximum(m, st.fill), m)
            corr = jnp.exp(m - m_new)
            w = jnp.where(count > 0, jnp.exp(st.fill - m_new), 0.0)
            tail = lax.dynamic_index_in_dim(suffix, start, axis=2, keepdims=False)
            l = l * corr + count * w
            acc = acc * corr[..., None] + w[..., None] * tail[:, :, None, :]
            m = m_new
        empty = l == 0
        out = acc / jnp.where(empty, 1.0, l)[..., None]
        m, l = jnp.where(empty, 0.0, m), jnp.where(empty, 1.0, l)
        lse = jnp.where(empty, -jnp.inf, m + jnp.log(l))
        shape = (b, hkv, g, st.block_q)
        out = jnp.transpose(out.reshape(shape + (dv,)), (0, 3, 1, 2, 4))
        start = i * st.block_q
        parts = (out, m.reshape(shape), l.reshape(shape), lse.reshape(shape))
        return tuple(lax.dynamic_update_slice_in_dim(whole, part, start, axis=axis)
                     for whole, part, axis in zip(results, parts, (1, 3, 3, 3)))

    per_row = jnp.zeros((b, hkv, g, lq), jnp.float32)
    init = (jnp.zeros((b, lq, hkv, g, dv), jnp.float32), per_row, per_row, per_row)
    if nq == 1:
        return query_block(0, init)
    return lax.fori_loop(0, nq, query_block, varying(init, st.varying))


def _skipped_keys_dv(m, inv_l, do, nk: int, st: _Static) -> jax.Array:
    """[B, nk·block_k, Hkv, Dv]: what the query blocks that skip a key block give each of its
    keys under a finite fill, each row its weight w = exp(fill - m) / l times its dO: a sum
    over the rows before the first query block that sees the key block (padding keys get it
    too; the caller cuts them off). m, inv_l [B, Hkv, G, Lq]; do [B, Lq, Hkv, G, Dv]."""
    w = jnp.exp(st.fill - m) * inv_l
    contrib = jnp.einsum("bhgq,bqhgd->bqhd", w, do)  # summed over the G heads
    prefix = jnp.concatenate([jnp.zeros_like(contrib[:, :1]), jnp.cumsum(contrib, axis=1)],
                             axis=1)
    bq, nq = st.block_q, do.shape[1] // st.block_q
    # Computed from an iota, not a list: a list is a constant array, which a shard_map body
    # traced on its own (`passes.tracing`) cannot close over.
    first, _ = query_block_span(jnp.arange(nk), nq, bq, st.block_k, st.band,
                                maximum=jnp.maximum, minimum=jnp.minimum)
    first = jnp.broadcast_to(first * bq, (nk,))
    return jnp.repeat(prefix[:, first], st.block_k, axis=1)  # clamped, as a list indexes


def _add_keys(acc_t: jax.Array, x_t: jax.Array, j, st: _Static) -> jax.Array:
    """[B, Hkv, D, Lk] `acc_t` with [B, Hkv, D, block_k] `x_t` added to key block j."""
    start = j * st.block_k
    x_t = x_t + lax.dynamic_slice_in_dim(acc_t, start, st.block_k, axis=3)
    return lax.dynamic_update_slice_in_dim(acc_t, x_t, start, axis=3)


def _backward(q, k_t, v_t, bias, mask, keys, post, sinks, out, m, l, do, st: _Static):
    """dq, dk, dv, dbias, dsinks (f32, in the layouts of `_flash`'s q, k, v, bias, sinks; None
    without bias, sinks), recomputing each score tile once. do [B, Lq, Hkv, G, Dv] (f32), in
    out's layout; k_t, v_t as `_forward` takes them.

    The tiles come in the forward's order (`_key_loop`): a query block accumulates its dq
    over the key blocks it visits, and each tile adds its contribution into dk and dv. A
    hidden key's logit is the constant fill: it passes no gradient to q, k or bias, only its
    weight to dv. With the query blocks in the outer loop, Q, dO and out (and the
    transposes of Q and dO) are sliced once per query block; per tile only the key block's
    K, V and its columns of dkᵀ, dvᵀ are, block_k rows each (half a query block's at the
    default sizes): measured ~10% faster at L = 4096 than the key blocks in the outer loop.

    dk and dv contract a tile over its queries. Written as tileᵀ·q, XLA's CPU backend hands
    that to a generic matmul (measured at 0.6–0.7 of the rate of the tile's other products);
    as qᵀ·tile, with q and dO transposed once per query block, it stays on the fast path. So
    dk and dv accumulate as dkᵀ, dvᵀ [B, Hkv, D, Lk].
    """
    b, lq, hkv, g, d = q.shape
    lk, dv = k_t.shape[2], v_t.shape[-1]
    bq, nq, nk = st.block_q, lq // st.block_q, lk // st.block_k
    if st.q_len:  # padding rows add nothing, even where their max or sum is NaN
        real = jnp.arange(lq) < st.q_len
        m, l = jnp.where(real, m, 0.0), jnp.where(real, l, 1.0)
        out = jnp.where(real[:, None, None, None], out, 0.0)
    inv_l = 1.0 / l  # one division per row, not per score

    def key_block(i, block, banded, j, carry):
        dq_i, dk_t, dv_t, dbias = carry
        q_i, q_t, do_i, do_t, m_i, inv_l_i, delta_i = block
        k_j, v_j = _key_rows(k_t, j, st), _key_rows(v_t, j, st)
        s, visible, capped = _scores(q_i, k_j, bias, mask, keys, i, j, st, banded)
        e = jnp.exp(s - m_i[..., None])
        if st.q_len:  # a padding row's scores may be NaN (a NaN key no query sees): 0·NaN
            e = jnp.where(st.real_rows(i, e.shape[2]), e, 0.0)
        dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, v_j, preferred_element_type=jnp.float32)
        keep = _keep(post, e.shape, i, j, st)  # once for dP and dV: a drawn one is costly
        p = e * inv_l_i[..., None]
        ds = p * (_kept(dp, keep) - delta_i[..., None])
        if visible is not None:
            ds = jnp.where(visible, ds, 0.0)
        dbias_tile = ds
        if capped is not None:
            ds = ds * (1.0 - jnp.square(capped))  # d(c·tanh(x / c)) / dx
            if visible is not None:  # a hidden key's score may be NaN (a NaN padded key):
                ds = jnp.where(visible, ds, 0.0)  # its tanh' must not reach dq or dk
        if st.scale != 1.0 and not st.scale_q:
            ds = ds * st.scale  # d(scale·q·k) w.r.t. q·k
        # dV from the normalized tile: a post_mask that drops a key's weight (bool, -0.0)
        # drops it NaN or not (a row's normalizer is NaN when it hides a NaN key before the
        # softmax), where exp(S - m)·(dO / l) would be 0·NaN.
        kept = _kept(p, keep)
        dv_t = _add_keys(dv_t, jnp.einsum("bhdq,bhqk->bhdk", do_t, kept), j, st)
        dk_t = _add_keys(dk_t, jnp.einsum("bhdq,bhqk->bhdk", q_t, ds,
                                          preferred_element_type=jnp.float32), j, st)
        dq_i = dq_i + jnp.einsum("bhqk,bhkd->bhqd", ds, k_j, preferred_element_type=jnp.float32)
        if dbias is not None:
            ds_b = dbias_tile.reshape(b, hkv, g, bq, -1)
            axes = tuple(a for a in range(5) if dbias.shape[a] == 1)
            ds_b = jnp.sum(ds_b, axis=axes, keepdims=True) if axes else ds_b
            starts = (0, 0, 0, i * bq if dbias.shape[3] != 1 else 0,
                      j * st.block_k if dbias.shape[4] != 1 else 0)
            ds_b = ds_b + lax.dynamic_slice(dbias, starts, ds_b.shape)
            dbias = lax.dynamic_update_slice(dbias, ds_b, starts)
        return dq_i, dk_t, dv_t, dbias

    def query_block(i, carry):
        dq, dk_t, dv_t, dbias, delta = carry
        q_i, do_i = _scaled_q(_query_rows(q, i, st), st), _query_rows(do, i, st)
        inv_l_i = _rows(inv_l, i, st)
        # As a sum of out * do, XLA's CPU backend reduces ~30x slower.
        delta_i = jnp.einsum("bhqd,bhqd->bhq", _query_rows(out, i, st), do_i)
        block = (q_i, jnp.swapaxes(q_i, 2, 3), do_i, jnp.swapaxes(do_i, 2, 3),
                 _rows(m, i, st), inv_l_i, delta_i)
        init = (jnp.zeros(q_i.shape, jnp.float32), dk_t, dv_t, dbias)
        (dq_i, dk_t, dv_t, dbias), _ = _key_loop(
            i, nk, lambda banded: functools.partial(key_block, i, block, banded), init, st)
        dq_i = jnp.moveaxis(_scaled_q(dq_i, st).reshape(b, hkv, g, bq, d), 3, 1)
        dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, axis=1)
        if delta is not None:  # kept for dsinks only
            delta = lax.dynamic_update_slice_in_dim(delta, delta_i.reshape(b, hkv, g, bq),
                                                    i * bq, axis=3)
        return dq, dk_t, dv_t, dbias, delta

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((b, hkv, d, lk), jnp.float32),
            jnp.zeros((b, hkv, dv, lk), jnp.float32),
            None if bias is None else jnp.zeros(bias.shape, jnp.float32),
            None if sinks is None else jnp.zeros(m.shape, jnp.float32))
    dq, dk_t, dv_t, dbias, delta = lax.fori_loop(0, nq, query_block, varying(init, st.varying))
    dk, dv = jnp.transpose(dk_t, (0, 3, 1, 2)), jnp.transpose(dv_t, (0, 3, 1, 2))
    if st.skipped_keys_count:
        dv = dv + _skipped_keys_dv(m, inv_l, do, nk, st)
    # A sink's logit enters like a key's with value 0: dsink = p_sink · (0 - delta).
    dsinks = None if sinks is None else -jnp.exp(sinks - m) * inv_l * delta
    return dq, dk, dv, dbias, dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, bias, mask, keys, post, sinks, st: _Static):
    """out [B, Lq, Hkv, G, Dv] (f32) of q [B, Lq, Hkv, G, D], k [B, Lk, Hkv, D], v [B, Lk,
    Hkv, Dv]."""
    return _flash_fwd(q, k, v, bias, mask, keys, post, sinks, st)[0]


def _flash_fwd(q, k, v, bias, mask, keys, post, sinks, st):
    k_t, v_t = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    out, m, l, _ = _forward(q, k_t, v_t, bias, mask, keys, post, sinks, st)
    return out, (q, k_t, v_t, bias, mask, keys, post, sinks, out, m, l)


def _flash_bwd(st, residuals, do):
    q, k_t, v_t, bias, mask, keys, post, sinks, out, m, l = residuals
    dq, dk, dv, dbias, dsinks = _backward(q, k_t, v_t, bias, mask, keys, post, sinks, out,
                                          m, l, do.astype(jnp.float32), st)
    cast = lambda d, x: None if x is None else d.astype(x.dtype)  # noqa: E731
    return (cast(dq, q), cast(dk, k_t), cast(dv, v_t), cast(dbias, bias), None,
            (None,) * len(keys), None, cast(dsinks, sinks))


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
    return block if length > block else cdiv(length, 8) * 8


class Chunked(AttentionKernel):
    """Blockwise online-softmax in plain JAX; runs everywhere, any mask and fill, GQA, any
    head dim.

    block_q, block_k: tile sizes (lengths are padded up to a multiple; the padding is masked).
    """

    name = "chunked"
    platforms = ("cpu", "tpu", "cuda")
    typed_for_shard_map = True
    extras = frozenset(EXTRAS)
    draws = True

    def __init__(self, block_q: int = 512, block_k: int = 256):
        if block_q % 8 or block_k % 8 or block_q <= 0 or block_k <= 0:
            raise KernelError(f"block sizes must be positive multiples of 8, got "
                             f"block_q={block_q}, block_k={block_k}")
        self.block_q, self.block_k = block_q, block_k

    def _check(self, site: AttentionSite, features: Features) -> Support:
        return Support.yes()

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        return flash_cost(site, block_q=_block(site.q_len, self.block_q),
                          block_k=_block(site.kv_len, self.block_k), backward=backward)

    def _attend(self, call: Call) -> jax.Array:
        call = zero_invalid_keys(call)
        b, lq, hq, d = call.q.shape
        lk, hkv = call.k.shape[1], call.k.shape[2]
        g = hq // hkv
        bq, bk = _block(lq, self.block_q), _block(lk, self.block_k)
        lq_p, lk_p = cdiv(lq, bq) * bq, cdiv(lk, bk) * bk
        # Skipped keys under a finite fill enter in closed form, which covers those right of
        # the band only (suffix and prefix sums).
        finite = math.isfinite(call.fill)
        # Scaling q (L·D) is cheaper than scaling every score tile (L·L), but in a narrow
        # dtype it rounds q (and a scale of 1e6 is inf in float16): there the f32 tiles are
        # scaled instead, as the naive program scales its scores.
        st = _Static(bq, bk, lk, call.band, call.fill, call.scale,
                     scale_q=jnp.dtype(call.q.dtype).itemsize >= 4,
                     softcap=call.softcap, visit_all=finite and (
                         call.post_mask is not None
                         or (call.band is not None and call.band[0] is not None)),
                     varying=axes_varied_over(call.q, call.k, call.v, call.bias, call.mask,
                                              *jax.tree.leaves(call.post_mask), call.sinks,
                                              call.kv_lengths, call.query_mask,
                                              *(call.segments or ())),
                     q_len=lq if lq_p > lq else 0)
        q = _pad_axis(call.q.reshape(b, lq, hkv, g, d), 1, lq_p)
        k, v = _pad_axis(call.k, 1, lk_p), _pad_axis(call.v, 1, lk_p)

        def to5(x, fill):
            if isinstance(x, DrawnMask):  # drawn per tile in [B, Hq, ...]
                return x.with_also(to5(x.also, fill))
            if x is None:
                return None
            bx, hx, qx, kx = x.shape
            x = x.reshape(bx, hkv if hx == hq else 1, g if hx == hq else 1, qx, kx)
            x = _pad_axis(x, 3, lq_p, fill, broadcast=True)
            return _pad_axis(x, 4, lk_p, fill, broadcast=True)

        # Padded keys sit at positions >= lk, so clamping the lengths masks them too.
        kv_lengths = None if call.kv_lengths is None else jnp.minimum(call.kv_lengths, lk)
        sinks = None
        if call.sinks is not None:
            sinks = to5(call.sinks.astype(jnp.float32), 0)[..., 0]
            sinks = jnp.broadcast_to(sinks, (b, hkv, g, lq_p))
        segments = (None, None)
        if call.segments is not None:  # padded queries and keys get segments of their own
            q_seg, kv_seg = call.segments
            segments = (jnp.pad(q_seg, ((0, 0), (0, lq_p - lq)), constant_values=-1),
                        jnp.pad(kv_seg, ((0, 0), (0, lk_p - lk)), constant_values=-2))
        query_mask = None
        if call.query_mask is not None:  # padded query rows are cut off after the call
            query_mask = jnp.pad(call.query_mask, ((0, 0), (0, lq_p - lq)))
        out = _flash(q, k, v, to5(call.bias, 0), to5(call.mask, False),
                     (kv_lengths, *segments, query_mask), to5(call.post_mask, False), sinks, st)
        return out[:, :lq].reshape(b, lq, hq, -1).astype(call.result_dtype)
