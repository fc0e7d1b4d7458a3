"""Ring attention: a call whose sequence is split over one mesh axis, computed where its blocks
live instead of gathering K and V onto every device.

Inside a `shard_map` body over that axis (n devices, `sharded.on_mesh` sets it up), device r
holds query block r and key/value block r ([B, L/n, H, D] each). The key/value blocks travel
round the ring (`lax.ppermute` to r + 1), one step per device: at step s device r sees block
(r - s) mod n, runs the chunked kernel's forward on it, and merges the step's output into its
own by each row's max and normalizer. Per device, memory is O(L/n) and no [L/n, L] score
block exists.

A causal mask (top-left, Lq = Lk) makes block (r, c) fully visible below the diagonal (c < r),
causal on it and hidden above it: a hidden block is not computed; under a finite fill its keys
still weigh exp(fill - max) each, added in closed form (the mean of its values, with max
fill and normalizer L/n). Key padding and segment ids travel with their block, query padding stays.

The backward runs the same ring: each step's dq, dk, dv come from the chunked backward given
the row statistics of the whole forward (a flash backward is a sum over key blocks once each
row's max, normalizer and out·dO are known), dk and dv travel with their block and are home
after n steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hlotool.kernels import chunked
from hlotool.kernels.base import Call
from hlotool.site import CAUSAL, AttentionSite

FULL, DIAGONAL, HIDDEN = 0, 1, 2
_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Trace-time constants of one ring call (a custom_vjp non-differentiable argument)."""

    axis: str
    n: int
    causal: bool
    fill: float
    scale: float
    softcap: float | None
    block: int  # query and key tile of each step's chunked call


def refusal(site: AttentionSite, n: int) -> str | None:
    """Why the ring cannot take `site` (or a call, as `Call.site` describes it) split n ways
    along its sequence; None when it can."""
    lq, lk = site.q_len, site.kv_len
    if lq != lk:
        return f"query and key lengths differ ({lq} vs {lk}): the ring splits one sequence"
    if lq % n or _block(lq // n) is None:
        return f"length {lq} does not split into {n} blocks of a multiple of 8"
    for name, present in (("an additive bias", site.mask == "additive"),
                          ("a sliding window", site.window is not None),
                          ("sinks", site.sinks),
                          ("a mask after the softmax", site.post_mask or site.dropout)):
        if present:
            return f"{name} (the ring takes causal masks, key and query padding, segments)"
    if site.mask == "boolean" and not set(site.mask_axes or "") <= {"B", "K"}:
        return (f"a boolean mask varying along {site.mask_axes} (the ring takes key and "
                "query padding)")
    return None


def _block(length: int) -> int | None:
    """The largest tile up to 512 dividing a block of `length` keys (a multiple of 8)."""
    block = _BLOCK
    while block >= 8:
        if length % block == 0:
            return block
        block //= 2
    return None


def attend(call: Call, axis: str, n: int) -> jax.Array:
    """[B, L/n, Hq, Dv] for the local blocks of `call` (inside a shard_map body over `axis`,
    `refusal(call.site(), n)` None). Key lengths become key padding; rows that see no key
    are zeros under a -inf fill, as every kernel gives them."""
    lk = call.k.shape[1]
    keys = call.mask
    if call.kv_lengths is not None:  # positions of this device's block of keys
        start = lax.axis_index(axis) * lk
        kept = (start + jnp.arange(lk))[None, :] < call.kv_lengths[:, None]
        kept = kept[:, None, None, :]
        keys = kept if keys is None else keys & kept
    ring = _Ring(axis, n, call.causal, call.fill, call.scale, call.softcap, _block(lk))
    q_ids, kv_ids = call.segments if call.segments is not None else (None, None)
    out = _ring(call.q, call.k, call.v, keys, call.query_mask, q_ids, kv_ids, ring)
    return out.astype(call.result_dtype)


def _static(ring: _Ring, lk: int, band, q):
    """The chunked kernel's constants for one step: the ring's tile, `band` (None or causal)."""
    return chunked._Static(ring.block, ring.block, lk, band, ring.fill, ring.scale,
                   scale_q=jnp.dtype(q.dtype).itemsize >= 4, softcap=ring.softcap)


def _to5(mask):
    return None if mask is None else mask[:, :, None]  # [B|1, 1, 1, 1, Lk]


def _pass_on(x, ring: _Ring):
    """Every array of `x` to the next device of the ring (None stays None)."""
    perm = [(r, (r + 1) % ring.n) for r in range(ring.n)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.axis, perm), x)


def _forward(q, k, v, keys, query_mask, q_ids, kv_ids, ring: _Ring):
    """out [B, L/n, Hkv, G, Dv] (f32, normalized), each row's max and normalizer [B, Hkv, G,
    L/n] (-inf and 0 for a row that saw no key). Merged as (max, normalizer), not as a
    log-sum-exp: at a fill of finfo.min, fill + log(count) rounds back to the fill."""
    b, lq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    q5 = q.reshape(b, lq, hkv, hq // hkv, d)
    out = jnp.zeros((b, lq, hkv, hq // hkv, dv), jnp.float32)
    m = jnp.full((b, hkv, hq // hkv, lq), -jnp.inf, jnp.float32)
    l = jnp.zeros_like(m)
    block = (k, v, keys, kv_ids)
    for s in range(ring.n):
        k_b, v_b, keys_b, kv_ids_b = block
        k_t, v_t = jnp.swapaxes(k_b, 1, 2), jnp.swapaxes(v_b, 1, 2)
        extra = (None, q_ids, kv_ids_b, query_mask)

        def visible(band, operands):
            q5, k_t, v_t, mask = operands
            o, m, l, lse = chunked._forward(q5, k_t, v_t, None, _to5(mask), extra, None, None,
                                            _static(ring, k_t.shape[2], band, q5))
            seen = jnp.isfinite(lse)
            return o, jnp.where(seen, m, -jnp.inf), jnp.where(seen, l, 0.0)

        def hidden(operands):
            _, _, v_t, _ = operands
            if math.isinf(ring.fill):
                return jnp.zeros_like(out), jnp.full_like(m, -jnp.inf), jnp.zeros_like(l)
            # Every key at `fill`: uniform weights, the mean of the block's values.
            mean = jnp.mean(v_t.astype(jnp.float32), axis=2)  # [B, Hkv, Dv]
            o = jnp.broadcast_to(mean[:, None, :, None, :], out.shape)
            return o, jnp.full_like(m, ring.fill), jnp.full_like(l, v_t.shape[2])

        operands = (q5, k_t, v_t, keys_b)
        relation = _relation(s, ring)
        step = lax.switch(relation, [functools.partial(visible, None),
                                     functools.partial(visible, CAUSAL), hidden], operands)
        out, m, l = _merge((out, m, l), step)
        if s < ring.n - 1:
            block = _pass_on(block, ring)
    return out, m, l


def _relation(s: int, ring: _Ring) -> jax.Array:
    """FULL, DIAGONAL or HIDDEN: how this device's queries see the block it holds at step s
    (block (r - s) mod n on device r)."""
    if not ring.causal:
        return jnp.int32(FULL)
    me = lax.axis_index(ring.axis)
    source = (me - s) % ring.n
    return jnp.where(source < me, FULL, jnp.where(source == me, DIAGONAL, HIDDEN))


def _merge(one, other):
    """Two partial results (out normalized over its keys, row max, normalizer) over disjoint
    keys as one."""
    (out, m, l), (o_s, m_s, l_s) = one, other
    top = jnp.maximum(m, m_s)
    w = jnp.where(l > 0, l * jnp.exp(m - top), 0.0)
    w_s = jnp.where(l_s > 0, l_s * jnp.exp(m_s - top), 0.0)
    total = w + w_s
    safe = jnp.where(total > 0, total, 1.0)

    def share(x):  # [B, Hkv, G, L] → [B, L, Hkv, G, 1], as out is laid out
        return jnp.moveaxis(x / safe, 3, 1)[..., None]

    return out * share(w) + o_s * share(w_s), top, total


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ring(q, k, v, keys, query_mask, q_ids, kv_ids, ring: _Ring):
    return _ring_fwd(q, k, v, keys, query_mask, q_ids, kv_ids, ring)[0]


def _ring_fwd(q, k, v, keys, query_mask, q_ids, kv_ids, ring):
    out, m, l = _forward(q, k, v, keys, query_mask, q_ids, kv_ids, ring)
    b, lq, hq, _ = q.shape
    return out.reshape(b, lq, hq, -1), (q, k, v, keys, query_mask, q_ids, kv_ids, out, m, l)


def _ring_bwd(ring, residuals, d_out):
    q, k, v, keys, query_mask, q_ids, kv_ids, out, m, l = residuals
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    q5 = q.reshape(b, lq, hkv, hq // hkv, d)
    do = d_out.astype(jnp.float32).reshape(out.shape)
    # The chunked backward's p = exp(s - m) / l with the whole forward's row max and
    # normalizer; a row that saw no key anywhere has p = 0 at m = 0, l = 1.
    seen = l > 0
    m, l = jnp.where(seen, m, 0.0), jnp.where(seen, l, 1.0)
    dq = jnp.zeros(q5.shape, jnp.float32)
    block = (k, v, keys, kv_ids, jnp.zeros(k.shape, jnp.float32),
             jnp.zeros(v.shape, jnp.float32))
    for s in range(ring.n):
        k_b, v_b, keys_b, kv_ids_b, dk_b, dv_b = block
        extra = (None, q_ids, kv_ids_b, query_mask)

        def visible(band, operands):
            k_b, v_b, mask = operands
            k_t, v_t = jnp.swapaxes(k_b, 1, 2), jnp.swapaxes(v_b, 1, 2)
            dq_s, dk_s, dv_s, _, _ = chunked._backward(
                q5, k_t, v_t, None, _to5(mask), extra, None, None, out, m, l, do,
                _static(ring, k_t.shape[2], band, q5))
            return dq_s, dk_s, dv_s

        def hidden(operands):
            k_b, v_b, _ = operands
            zeros = (jnp.zeros(q5.shape, jnp.float32), jnp.zeros(k_b.shape, jnp.float32))
            if math.isinf(ring.fill):
                return (*zeros, jnp.zeros(v_b.shape, jnp.float32))
            # Each key of the block weighs exp(fill - m) / l in row i: dv_j = Σ_i w_i dO_i.
            w = jnp.where(seen, jnp.exp(ring.fill - m) / l, 0.0)  # [B, Hkv, G, L]
            per_key = jnp.einsum("bhgq,bqhgd->bhd", w, do)
            return (*zeros, jnp.broadcast_to(per_key[:, None], v_b.shape))

        dq_s, dk_s, dv_s = lax.switch(
            _relation(s, ring),
            [functools.partial(visible, None), functools.partial(visible, CAUSAL), hidden],
            (k_b, v_b, keys_b))
        dq = dq + dq_s
        block = _pass_on((k_b, v_b, keys_b, kv_ids_b, dk_b + dk_s, dv_b + dv_s), ring)
    *_, dk, dv = block  # after n steps each block's dk and dv are home
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
