"""hlotool's own Pallas TPU flash attention, for the sites upstream's TPU kernels refuse:
dropout on the probabilities.

Neither splash nor flash (nor tokamax's Mosaic kernel) takes dropout. A training step draws
dropout's keep mask from `jax.random` over the whole [B, H, Lq, Lk] score shape; this kernel
draws each tile of it in the kernel body instead (`drawn.DrawnMask.block`: jax's threefry
bits at the tile's positions, in uint32 arithmetic, then the program's own equations from
bits to multiplier), so the mask is never in memory and the result is the program's, bit for
bit in the mask. A mask that cannot be drawn (`cannot_draw` says why), and Keras' dropout
beside its attention mask after the softmax, are read tile by tile from the dense operand
instead.

    out = (softmax(where(visible, scale · q·kᵀ, -inf)) ⊙ Z) · v,   Z = keep / keep_prob

Layout: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (transposed from the
interface's [B, L, H, D]); grouped K/V heads are indexed, never repeated. Lengths are padded
up to lanes of 128; tiles as the chip's (`_upstream.tiles`). Masks in kernel terms: a key
row [B, 1, Lk] (kv lengths, key padding, the kernel's own padding) and the causal flag (top-
left); blocks wholly above the diagonal or past a batch row's length are skipped. Hidden keys
get -inf, exactly; a row that sees no key is 0. Under a finite fill (flax's and Hugging
Face's `finfo.min`) the call runs here only where `hiding_is_exact` holds and every row sees
a key (such a row weighs all keys, each times its multiplier); else in the chunked kernel.

Forward: grid (B, Hq, q blocks, k blocks), an online softmax in VMEM scratch; it writes the
output and each row's log-sum-exp. Backward, from the log-sum-exp (P = exp(S - lse)):
  - dK, dV: grid (B, Hkv, k blocks, G·q blocks), the G query heads of a K/V head in turn;
    dV += (P⊙Z)ᵀ·dO, dS = P ⊙ (dO·Vᵀ ⊙ Z - δ), dK += scale · dSᵀ·Q, with δ = rowsum(dO ⊙ O);
  - dQ: grid (B, Hq, q blocks, k blocks), dQ += scale · dS·K.
A boolean mask after the softmax is the multiplier 0 or 1 (Keras' dropout and masked softmax
write `where(keep, p, 0)`): drawn where it comes from random bits, else read as f32 tiles.
It takes no bias, masks beyond key padding, window, segment ids, soft-cap or sinks (dropout
with those runs in the chunked kernel), and no site without dropout or a mask after the
softmax (splash and flash take those).

Off a TPU it runs in Pallas' interpret mode (`interpret=True`, what the tests use); staged for
a TPU it is traced through `jaxcompat.for_tpu` like the upstream kernels. Checked here: its
numerics in interpret mode, and libtpu compiling it for v5e, v5p and v6e without a chip. Not
yet timed on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hlotool import jaxcompat
from hlotool.hardware import Hardware
from hlotool.kernels import drawn
from hlotool.kernels._upstream import padded_length, tiles
from hlotool.kernels.base import (
    AttentionKernel,
    Call,
    Features,
    KernelCost,
    Support,
    flash_cost,
    row_has_key,
    soft_fill_refusal,
    visible_fraction,
    zero_invalid_keys,
)
from hlotool.kernels.chunked import Chunked
from hlotool.kernels.drawn import DrawnMask
from hlotool.site import AttentionSite

# uint32 operations per drawn element: threefry's 20 rounds of add, shifts, or, xor (100),
# its key injections (15), the flat position's 64-bit arithmetic (~20). Counted as flops in
# the cost: they run on the vector unit, beside the matmuls.
DRAW_OPS = 135


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the kernels are specialized on."""

    block_q: int
    block_k: int
    groups: int  # query heads per K/V head
    scale: float
    causal: bool
    drawn: DrawnMask | None  # the mask's cone (its boundary values travel as operands)
    boundary: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each boundary value
    interpret: bool
    visited_scores: int  # scores in the tiles the kernels visit, for their cost estimates


def _visible(keys_ref, i, j, st: _Static) -> jax.Array:
    """bool [block_q, block_k]: which keys of tile (i, j) each query sees (`keys_ref`: the
    tile's [1, block_k] of the key row)."""
    shape = (st.block_q, st.block_k)
    visible = jnp.broadcast_to(keys_ref[0] != 0, shape)
    if st.causal:
        k_pos = j * st.block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
        visible &= k_pos <= i * st.block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    return visible


def _tile_needed(lengths_ref, b, i, j, st: _Static) -> jax.Array:
    """Whether tile (i, j) may hold a visible key: not past the batch row's last key
    (`lengths_ref`), not above the diagonal."""
    needed = j * st.block_k < lengths_ref[b]
    if st.causal:
        needed &= j * st.block_k <= i * st.block_q + st.block_q - 1
    return needed


def _multiplier(post_ref, scalar_refs, b, h, i, j, st: _Static) -> jax.Array:
    """f32 [block_q, block_k]: Z of tile (i, j) for query head h, drawn or read."""
    if st.drawn is None:
        return post_ref[0, 0].astype(jnp.float32)
    boundary = [_from_smem(ref, shape, dtype)
                for ref, (shape, dtype) in zip(scalar_refs, st.boundary)]
    return st.drawn.block(boundary, b, h, i * st.block_q, st.block_q, j * st.block_k,
                          st.block_k).astype(jnp.float32)


def _scores(q, k, visible, st: _Static) -> jax.Array:
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.where(visible, s * st.scale, -jnp.inf)


def _split(refs, n_scalars: int, has_post: bool):
    """(lengths, boundary refs, the rest) of a kernel's refs; the rest starts with the dense
    multiplier's ref (None when the mask is drawn), then the key row's."""
    lengths, scalars, rest = refs[0], refs[1:1 + n_scalars], refs[1 + n_scalars:]
    return lengths, scalars, (rest if has_post else (None, *rest))


def _forward_kernel(*refs, st: _Static, n_scalars: int, has_post: bool):
    lengths, scalars, rest = _split(refs, n_scalars, has_post)
    post_ref, keys_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    b, h, i, j = (pl.program_id(n) for n in range(4))

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_tile_needed(lengths, b, i, j, st))
    def _():
        s = _scores(q_ref[0, 0], k_ref[0, 0], _visible(keys_ref, i, j, st), st)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp gives 0.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - shift)
        corr = jnp.exp(m_prev - shift)
        l_sc[...] = l_sc[...] * corr + jnp.sum(p, axis=1, keepdims=True)
        pz = p * _multiplier(post_ref, scalars, b, h, i, j, st)
        v = v_ref[0, 0]
        acc_sc[...] = acc_sc[...] * corr + jnp.dot(pz.astype(v.dtype), v,
                                                   preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        l = l_sc[...]
        empty = l == 0.0
        o_ref[0, 0] = acc_sc[...] / jnp.where(empty, 1.0, l)
        # +inf for a row that saw nothing: the backward's exp(S - lse) is 0 there.
        lse_ref[0, 0] = jnp.where(empty, jnp.inf, m_sc[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _tile_gradient(refs, b, h, i, j, st: _Static):
    """P (from the saved log-sum-exp), Z and dS = P ⊙ (dO·Vᵀ ⊙ Z - δ) of tile (i, j) for
    query head h; `refs`: (post, scalars, keys, q, k, v, dO, lse, δ)."""
    post_ref, scalars, keys_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs
    s = _scores(q_ref[0, 0], k_ref[0, 0], _visible(keys_ref, i, j, st), st)
    p = jnp.exp(s - lse_ref[0, 0])
    z = _multiplier(post_ref, scalars, b, h, i, j, st)
    dp = lax.dot_general(do_ref[0, 0], v_ref[0, 0], (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return p, z, p * (dp * z - delta_ref[0, 0])


def _dkv_kernel(*refs, st: _Static, n_scalars: int, has_post: bool, nq: int):
    lengths, scalars, rest = _split(refs, n_scalars, has_post)
    post_ref, q_ref, do_ref = rest[0], rest[2], rest[5]
    tile = (post_ref, scalars, *rest[1:8])
    dk_ref, dv_ref, dk_sc, dv_sc = rest[8:]
    b, hkv, j, t = (pl.program_id(n) for n in range(4))
    i = t % nq
    h = hkv * st.groups + t // nq

    @pl.when(t == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_tile_needed(lengths, b, i, j, st))
    def _():
        q, do = q_ref[0, 0], do_ref[0, 0]
        p, z, ds = _tile_gradient(tile, b, h, i, j, st)
        transposed = (((0,), (0,)), ((), ()))  # xᵀ·y over the tile's query rows
        dv_sc[...] += lax.dot_general((p * z).astype(do.dtype), do, transposed,
                                      preferred_element_type=jnp.float32)
        dk_sc[...] += st.scale * lax.dot_general(ds.astype(q.dtype), q, transposed,
                                                 preferred_element_type=jnp.float32)

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dk_ref[0, 0] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, st: _Static, n_scalars: int, has_post: bool):
    lengths, scalars, rest = _split(refs, n_scalars, has_post)
    post_ref, k_ref, dq_ref, dq_sc = rest[0], rest[3], rest[8], rest[9]
    tile = (post_ref, scalars, *rest[1:8])
    b, h, i, j = (pl.program_id(n) for n in range(4))

    @pl.when(j == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_tile_needed(lengths, b, i, j, st))
    def _():
        k = k_ref[0, 0]
        _, _, ds = _tile_gradient(tile, b, h, i, j, st)
        dq_sc[...] += st.scale * jnp.dot(ds.astype(k.dtype), k,
                                         preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        dq_ref[0, 0] = dq_sc[...].astype(dq_ref.dtype)


def _call(kernel, st: _Static, grid, in_specs, out_specs, out_shape, scratch, scalars,
          operands, matmul_dims: int, **params):
    """One pallas_call: `scalars` (kv lengths, then the boundary values) in SMEM (scalar
    prefetch), `operands` tiled by `in_specs` (index maps over the grid, then the scalar
    refs). Its cost estimate: `matmul_dims` (the sum of each tile matmul's inner or outer
    head dim) multiply-adds and one exp per visited score, and the draw where drawn."""
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars), grid=grid, in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=[pltpu.VMEM(s, jnp.float32) for s in scratch])
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    visited = st.visited_scores
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                 for x in (*operands, *out_shape))
    estimate = pl.CostEstimate(
        flops=int(2 * visited * matmul_dims + (DRAW_OPS * visited if st.drawn is not None else 0)),
        transcendentals=int(visited), bytes_accessed=int(nbytes))
    return pl.pallas_call(
        functools.partial(kernel, st=st, n_scalars=len(scalars) - 1, has_post=st.drawn is None,
                          **params),
        grid_spec=spec, out_shape=out_shape, interpret=st.interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        cost_estimate=estimate, name=f"dropout_tpu_{kernel.__name__.split('_')[1]}",
    )(*scalars, *operands)


def _post_spec(post, st: _Static, index):
    """The dense multiplier's tiles (broadcast axes read at 0), or nothing when drawn."""
    if st.drawn is not None:
        return []
    nb, nh = post.shape[:2]

    def at(*ids):
        b, h, i, j = index(*ids)
        return (b if nb > 1 else 0, h if nh > 1 else 0, i, j)

    return [pl.BlockSpec((1, 1, st.block_q, st.block_k), at)]


def _diagonal_clamped(j, i, st: _Static):
    """Key block j, or under causal the last one query block i sees: blocks the kernel
    skips repeat the previous index, so Pallas fetches nothing for them."""
    return jnp.minimum(j, ((i + 1) * st.block_q - 1) // st.block_k) if st.causal else j


def _row_specs(post, st: _Static, index, key_block):
    """Specs of the operands every kernel reads first: the dense multiplier's tile at
    `index` (b, query head, q block, k block) unless it is drawn, then the key row's tile at
    (b, 0, `key_block`)."""
    key_row = pl.BlockSpec((1, 1, st.block_k), lambda *ids: (ids[0], 0, key_block(*ids)))
    return [*_post_spec(post, st, index), key_row]


def _by_query_block(st: _Static):
    """Index maps over a (B, Hq, q blocks, k blocks) grid (forward, dQ): query rows, K/V rows
    (a skipped block repeats the last one seen), the key block, the multiplier's tile."""
    def key_block(b, h, i, j, *_):
        return _diagonal_clamped(j, i, st)

    def rows(b, h, i, j, *_):
        return (b, h, i, 0)

    def kv(b, h, i, j, *_):
        return (b, h // st.groups, key_block(b, h, i, j), 0)

    def tile(b, h, i, j, *_):
        return (b, h, i, j)

    return rows, kv, key_block, tile


def _in_specs(post, st: _Static, d: int, dv: int, maps, backward: bool) -> list:
    """Specs of [multiplier], key row, q, k, v and, for a backward kernel, dO, lse and δ,
    from index `maps` (query rows, K/V rows, key block, multiplier tile)."""
    rows, kv, key_block, tile = maps
    specs = [*_row_specs(post, st, tile, key_block),
             pl.BlockSpec((1, 1, st.block_q, d), rows),
             pl.BlockSpec((1, 1, st.block_k, d), kv), pl.BlockSpec((1, 1, st.block_k, dv), kv)]
    if backward:
        specs += [pl.BlockSpec((1, 1, st.block_q, dv), rows),
                  pl.BlockSpec((1, 1, st.block_q, 1), rows),
                  pl.BlockSpec((1, 1, st.block_q, 1), rows)]
    return specs


def _forward(q, k, v, lengths, keys, post, scalars, st: _Static):
    """out [B, Hq, Lq, Dv] (f32) and each row's log-sum-exp [B, Hq, Lq, 1]."""
    b, hq, lq, d = q.shape
    dv = v.shape[3]
    grid = (b, hq, lq // st.block_q, k.shape[2] // st.block_k)
    maps = _by_query_block(st)
    rows = maps[0]
    out_specs = [pl.BlockSpec((1, 1, st.block_q, dv), rows),
                 pl.BlockSpec((1, 1, st.block_q, 1), rows)]
    out_shape = [jax.ShapeDtypeStruct((b, hq, lq, dv), jnp.float32),
                 jax.ShapeDtypeStruct((b, hq, lq, 1), jnp.float32)]
    scratch = [(st.block_q, 1), (st.block_q, 1), (st.block_q, dv)]
    return _call(_forward_kernel, st, grid, _in_specs(post, st, d, dv, maps, False), out_specs,
                 out_shape, scratch, [lengths, *scalars], _dense(post, st) + [keys, q, k, v],
                 d + dv)


def _dense(post, st: _Static) -> list:
    return [] if st.drawn is not None else [post]


def _backward(q, k, v, lengths, keys, post, scalars, out, lse, do, st: _Static):
    """dq, dk, dv for the output cotangent `do` [B, Hq, Lq, Dv]."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    nq, nk, g = lq // st.block_q, lk // st.block_k, st.groups
    delta = jnp.sum(do.astype(jnp.float32) * out, axis=-1, keepdims=True)
    operands = _dense(post, st) + [keys, q, k, v, do, lse, delta]

    # dK, dV: a K/V head's key block meets each query block of each of its query heads.
    def q_rows(b, hk, j, t, *_):
        return (b, hk * g + t // nq, t % nq, 0)

    def kv_rows(b, hk, j, t, *_):
        return (b, hk, j, 0)

    def key_block(b, hk, j, t, *_):
        return j

    def tile(b, hk, j, t, *_):
        return (b, hk * g + t // nq, t % nq, j)

    dk, dv_ = _call(
        _dkv_kernel, st, (b, hkv, nk, g * nq),
        _in_specs(post, st, d, dv, (q_rows, kv_rows, key_block, tile), True),
        [pl.BlockSpec((1, 1, st.block_k, d), kv_rows),
         pl.BlockSpec((1, 1, st.block_k, dv), kv_rows)],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        [(st.block_k, d), (st.block_k, dv)], [lengths, *scalars], operands, 2 * (d + dv),
        nq=nq)

    # dQ: a query block meets each key block it sees.
    maps = _by_query_block(st)
    (dq,) = _call(_dq_kernel, st, (b, hq, nq, nk), _in_specs(post, st, d, dv, maps, True),
                  [pl.BlockSpec((1, 1, st.block_q, d), maps[0])],
                  [jax.ShapeDtypeStruct(q.shape, q.dtype)], [(st.block_q, d)],
                  [lengths, *scalars], operands, 2 * d + dv)
    return dq, dk, dv_


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, lengths, keys, post, scalars, st: _Static):
    return _forward(q, k, v, lengths, keys, post, scalars, st)[0]


def _flash_fwd(q, k, v, lengths, keys, post, scalars, st):
    out, lse = _forward(q, k, v, lengths, keys, post, scalars, st)
    return out, (q, k, v, lengths, keys, post, scalars, out, lse)


def _flash_bwd(st, residuals, do):
    q, k, v, lengths, keys, post, scalars, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, lengths, keys, post, scalars, out, lse, do, st)
    return dq, dk, dv, None, None, None, jax.tree.map(lambda _: None, scalars)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _in_smem(x: jax.Array) -> bool:
    """Whether a boundary value (`DrawnMask.boundary`) goes to SMEM: key data (two words) or
    one 32-bit or bool value. SMEM loads scalars of 32 bits only; any other value makes the
    mask read instead of drawn."""
    key_data = x.shape == (2,) and x.dtype == jnp.uint32
    return key_data or (x.size == 1 and (x.dtype == jnp.bool_ or x.dtype.itemsize == 4))


def _to_smem(x: jax.Array) -> jax.Array:
    """A boundary value as SMEM holds it: 1-D, bool as int32 (`_from_smem` undoes it)."""
    x = jnp.ravel(x)
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _from_smem(ref, shape: tuple[int, ...], dtype: str):
    """A boundary value in a kernel body, from its SMEM ref: key data as its two scalar
    words (what `drawn.position_bits` indexes), one value as a scalar (the tile equations
    only spread it over the tile)."""
    if shape == (2,) and dtype == "uint32":
        return ref[0], ref[1]
    return ref[0] != 0 if dtype == "bool" else ref[0]


class DropoutTpu(AttentionKernel):
    """Flash attention with dropout drawn in the kernel, on TPU (see the module docstring).

    interpret: run in Pallas' interpret mode (any platform, slowly): for tests.
    """

    name = "dropout_tpu"
    platforms = ("tpu",)
    # A boolean mask after the softmax is a multiplier of 0 and 1: Keras writes its dropout
    # so (`where(keep, p / keep_prob, 0)`), and its masked softmax.
    extras = frozenset({"dropout", "post_mask"})
    draws = True
    # It gives hidden keys -inf: exact under the default fill; under a finite one only where
    # `_exact` shows the difference is below float32 resolution.
    hidden_logit = -math.inf
    exact = Chunked

    def __init__(self, interpret: bool = False) -> None:
        self.interpret = interpret

    def _check(self, site: AttentionSite, features: Features) -> Support:
        if not (features.dropout or features.post_mask):
            return Support.no("neither dropout nor a mask after the softmax (this kernel "
                              "exists for those; splash and flash take the rest)")
        if site.dtype not in ("float32", "bfloat16"):
            return Support.no(f"dtype {site.dtype} unsupported (takes float32, bfloat16)")
        if features.bias:
            return Support.no("additive bias unsupported (takes causal masks and key padding)")
        if features.mask and not set(site.mask_axes or "") <= {"B", "K"}:
            return Support.no(f"a boolean mask varying along {site.mask_axes} (takes causal "
                              "masks and key padding)")
        return soft_fill_refusal(site, features)

    def cannot_draw(self) -> str | None:
        return super().cannot_draw() or drawn.unavailable(in_kernel=True)

    def _exact(self, call: Call) -> jax.Array:
        # Under a finite fill a row with no visible key weighs every key equally, each times
        # its dropout multiplier: this kernel has no such row (it gives zeros), chunked has.
        exact = super()._exact(call)
        has_key = row_has_key(call)
        if math.isfinite(call.fill) and has_key is not None:
            exact &= jnp.all(has_key)
        return exact

    def cost(self, site: AttentionSite, *, backward: bool = False,
             hardware: Hardware | None = None) -> KernelCost:
        bq, bk = tiles(site.q_len, site.kv_len, hardware)
        cost = flash_cost(site, block_q=bq, block_k=bk, backward=backward)
        passes = 3 if backward else 1  # forward, then dK/dV and dQ
        if site.post_mask:  # read tile by tile, as f32, by each pass
            return cost + KernelCost(0, 0, passes * 4 * site.batch * site.num_q_heads
                                     * site.q_len * site.kv_len, 0)
        # Each visited score's multiplier is drawn by each pass.
        visited = cost.transcendentals // 2 if backward else cost.transcendentals
        return cost + KernelCost(DRAW_OPS * visited * passes, 0, 0, 0)

    def _attend(self, call: Call) -> jax.Array:
        call = zero_invalid_keys(call)
        b, lq, hq, d = call.q.shape
        lk, hkv = call.k.shape[1], call.k.shape[2]
        lq_p, lk_p = padded_length(lq), padded_length(lk)
        bq, bk = tiles(lq, lk)

        def prep(x, length):  # [B, L, H, D] -> [B, H, L_padded, D]
            x = jnp.swapaxes(x, 1, 2)
            return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

        q, k, v = prep(call.q, lq_p), prep(call.k, lk_p), prep(call.v, lk_p)
        # Blocks past a batch row's length are skipped; the key row hides single keys: the
        # padding, those past the length, those the key padding mask drops.
        lengths = jnp.full((b,), lk, jnp.int32)
        if call.kv_lengths is not None:
            lengths = jnp.minimum(call.kv_lengths.astype(jnp.int32), lk)
        keys = jnp.arange(lk_p)[None, :] < lengths[:, None]
        if call.mask is not None:  # [B|1, 1, 1, Lk]: `_check` admits key padding only
            keys = keys & jnp.pad(call.mask[:, 0, 0, :], ((0, 0), (0, lk_p - lk)))
        keys = keys.astype(jnp.int32)[:, None, :]  # [B, 1, Lk]: Mosaic tiles its last 2 axes
        post, cone, boundary = call.post_mask, None, []
        if isinstance(post, DrawnMask) and post.also is None and self.cannot_draw() is None:
            boundary = post.boundary()
            if all(_in_smem(x) for x in boundary):
                # The cone alone: the kernels are specialized on it, its inputs are traced.
                cone = DrawnMask(post.cone, (None,) * len(post.inputs), post.keys, post.full,
                                 post.dtype, post.keep_when)
            else:
                boundary = []
        if cone is None:
            post = post.dense() if isinstance(post, DrawnMask) else post
            nb, nh = post.shape[:2]
            post = jnp.broadcast_to(post.astype(jnp.float32), (nb, nh, lq, lk))
            post = jnp.pad(post, ((0, 0), (0, 0), (0, lq_p - lq), (0, lk_p - lk)))
        else:
            post = None
        visited = b * hq * lq_p * lk_p * visible_fraction(lq_p, lk_p, bq, bk, call.band)
        st = _Static(bq, bk, hq // hkv, call.scale, call.causal, cone,
                     tuple((tuple(x.shape), str(x.dtype)) for x in boundary), self.interpret,
                     int(visited))

        def run(q, k, v, lengths, keys, post, *scalars):
            return _flash(q, k, v, lengths, keys, post, list(scalars), st)

        out = (run if self.interpret else jaxcompat.for_tpu(run))(
            q, k, v, lengths, keys, post, *(_to_smem(x) for x in boundary))
        return jnp.swapaxes(out[:, :, :lq], 1, 2)
