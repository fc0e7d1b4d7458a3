"""Ring attention: a call whose sequence is split over one mesh axis, computed where its blocks
live instead of gathering K and V onto every device.

Inside a `shard_map` body over that axis (n devices, `sharded.on_mesh` sets it up), device r
holds query block r and key/value block r ([B, L/n, H, D] each). The key/value blocks travel
round the ring (`lax.ppermute` to r + 1), one step per device: at step s device r sees block
(r - s) mod n, runs the chunked kernel's forward on it, and merges the step's output into its
own by each row's max and normalizer. Per device, memory is O(L/n) and no [L/n, L] score
block exists.

A band (a causal mask, top-left as Lq = Lk; a sliding window; both) makes each pair of chunks
(query chunk c, key chunk c', each of C positions) seen whole, through the band shifted by
(c - c')·C, or not at all (`_pair_band`): a causal mask shows the pairs below the diagonal
whole, those on it causal and hides those above it. A hidden pair is not computed; under a
finite fill its keys still weigh exp(fill - max) each, added in closed form (the mean of its
values, with max fill and normalizer its length). Contiguous blocks would leave device n - 1
computing a whole block at every step while device 0 skips all but one, so under a causal
mask the sequence is first dealt out zig-zag (`deal`): of 2n chunks device r holds r and
2n - 1 - r, and at every step each device computes one chunk pair in full and one
more in full or causal, half a block, the same on every device. Key padding and segment ids
travel with their block, query padding stays.

The backward runs the same ring: each step's dq, dk, dv come from the chunked backward given
the row statistics of the whole forward (a flash backward is a sum over key blocks once each
row's max, normalizer and out·dO are known), dk and dv travel with their block and go home
after the last step. Under a sliding window and a -inf fill the ring stops after the last step
whose pairs the window reaches (`pair_bands`). Steps after the first are one `fori_loop`
(`_steps`), so the program holds two steps whatever n.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlotool.kernels import chunked
from hlotool.kernels.base import Call
from hlotool.site import CAUSAL, AttentionSite, Band

HIDDEN = "hidden"  # a pair of chunks the band shows no key of
_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Trace-time constants of one ring call (a custom_vjp non-differentiable argument)."""

    axis: str
    n: int
    band: Band | None  # (left, right) over the whole sequence (`site.band_of`)
    fill: float
    scale: float
    softcap: float | None
    block: int  # query and key tile of each step's chunked call
    zigzag: bool = False  # two chunks per device, r and 2n - 1 - r (`deal`)
    steps: int | None = None  # steps run: after the last one whose pairs the band shows, none

    def chunks(self, device) -> tuple:
        return _chunks(device, self.n, self.zigzag)


def _chunks(device, n: int, zigzag: bool) -> tuple:
    """The sequence chunks `device` holds, in its order: of n (contiguous) or of 2n dealt
    zig-zag (r and 2n - 1 - r)."""
    return (device, 2 * n - 1 - device) if zigzag else (device,)


def refusal(site: AttentionSite, n: int) -> str | None:
    """Why the ring cannot take `site` (or a call, as `Call.site` describes it) split n ways
    along its sequence; None when it can."""
    lq, lk = site.q_len, site.kv_len
    if lq != lk:
        return f"query and key lengths differ ({lq} vs {lk}): the ring splits one sequence"
    if lq % n or _block(lq // n) is None:
        return f"length {lq} does not split into {n} blocks of a multiple of 8"
    for name, present in (("an additive bias", site.mask == "additive"),
                          ("sinks", site.sinks),
                          ("a mask after the softmax", site.post_mask or site.dropout)):
        if present:
            return (f"{name} (the ring takes causal masks, sliding windows, key and query "
                    "padding, segments)")
    if site.mask == "boolean" and not set(site.mask_axes or "") <= {"B", "K"}:
        return (f"a boolean mask varying along {site.mask_axes} (the ring takes key and "
                "query padding)")
    return None


def dealt_zigzag(band: Band | None, length: int) -> bool:
    """Whether a ring over blocks of `length` deals its sequence zig-zag (`deal`): under a
    causal mask alone, where contiguous blocks differ in work, and a block halves into whole
    tiles. (Under a sliding window contiguous blocks each see their neighbours alike.)"""
    return band == CAUSAL and length % 2 == 0 and _block(length // 2) is not None


def _pair_band(band: Band | None, distance: int, length: int) -> Band | None | str:
    """How the queries of a chunk of `length` positions see the keys of the chunk `distance`
    chunks before it, under `band` over the whole sequence: None (every key), HIDDEN (no key)
    or the band local to the pair. Query i, key j of the pair are positions distance·length
    apart more than j - i, so the band shifts by that."""
    if band is None:
        return None
    shift = distance * length
    left, right = (None if band[0] is None else band[0] - shift,
                   None if band[1] is None else band[1] + shift)
    edge = length - 1  # j - i spans [-edge, edge] in a pair
    if (left is not None and left < -edge) or (right is not None and right < -edge):
        return HIDDEN
    if (left is None or left >= edge) and (right is None or right >= edge):
        return None
    return left, right


def pair_bands(band: Band | None, n: int, length: int, fill: float) -> list[list[tuple]]:
    """Per step the ring runs, per device of n, how each of its chunk pairs is seen
    (`_pair_band`) in a ring over a sequence of `length`, as `attend` deals it. Under a -inf
    fill the steps end with the last that shows some device a key: the K/V blocks beyond a
    window's reach need not come round. (Under a finite fill a row that sees no key weighs
    every key alike, so every block comes round.)"""
    zigzag = n > 1 and dealt_zigzag(band, length // n)
    chunk = length // (n * len(_chunks(0, n, zigzag)))
    steps = [[tuple(_pair_band(band, mine - theirs, chunk) for mine in _chunks(me, n, zigzag)
                    for theirs in _chunks((me - s) % n, n, zigzag)) for me in range(n)]
             for s in range(n)]
    while (math.isinf(fill) and len(steps) > 1
           and all(way == HIDDEN for ways in steps[-1] for way in ways)):
        steps.pop()
    return steps


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
    zigzag = n > 1 and dealt_zigzag(call.band, lk)
    steps = len(pair_bands(call.band, n, n * lk, call.fill))
    ring = _Ring(axis, n, call.band, call.fill, call.scale, call.softcap,
                 _block(lk // 2 if zigzag else lk), zigzag, steps)
    q_ids, kv_ids = call.segments if call.segments is not None else (None, None)
    # The sequence axis of each: q, k, v [B, L, H, D]; keys [B|1, 1, 1, Lk]; the query mask
    # [B|1, Lq]; segment ids [B, L].
    args = tuple(zip((call.q, call.k, call.v, keys, call.query_mask, q_ids, kv_ids),
                     (1, 1, 1, 3, 1, 1, 1)))
    if zigzag:
        args = tuple((deal(x, seq, axis, n), seq) for x, seq in args)
    out = _ring(*(x for x, _ in args), ring)
    if zigzag:
        out = collect(out, 1, axis, n)
    return out.astype(call.result_dtype)


def _owner(chunk: int, n: int) -> int:
    """The device holding `chunk` of 2n in zig-zag order."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def deal(x, axis: int, ring_axis: str, n: int):
    """x's block along `axis` (chunks 2r and 2r + 1 of 2n on device r of the n along mesh axis
    `ring_axis`) dealt zig-zag: device r gets chunks r and 2n - 1 - r, in that order. Of the
    two one is even (their sum is odd): it comes by the permute of first halves, the odd one
    by that of second halves."""
    if x is None or x.shape[axis] == 1:  # broadcast along the sequence
        return x
    halves = jnp.split(x, 2, axis=axis)
    got = [lax.ppermute(h, ring_axis, [(r, _owner(2 * r + i, n)) for r in range(n)])
           for i, h in enumerate(halves)]
    even = lax.axis_index(ring_axis) % 2 == 0
    return jnp.concatenate([jnp.where(even, got[0], got[1]), jnp.where(even, got[1], got[0])],
                           axis=axis)


def collect(x, axis: int, ring_axis: str, n: int):
    """`deal` undone: device r's chunks 2r and 2r + 1 back, in order."""
    low, high = jnp.split(x, 2, axis=axis)
    even = lax.axis_index(ring_axis) % 2 == 0
    sent = (jnp.where(even, low, high), jnp.where(even, high, low))  # the even chunk first
    return jnp.concatenate([lax.ppermute(h, ring_axis, [(_owner(2 * r + i, n), r)
                                                        for r in range(n)])
                            for i, h in enumerate(sent)], axis=axis)


def dealt_positions(n: int, length: int, zigzag: bool) -> np.ndarray:
    """int [length]: the sequence position each place of a ring's blocks holds, device by
    device, as `attend` deals a sequence of `length` over n devices (`deal`, `_chunks`)."""
    chunk = length // (n * len(_chunks(0, n, zigzag)))
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk)
                           for r in range(n) for c in _chunks(r, n, zigzag)])


def _part(x, i: int, parts: int, axis: int):
    """Chunk i of `parts` of x along `axis` (None, or an axis of 1, as it is)."""
    if x is None or parts == 1 or x.shape[axis] == 1:
        return x
    size = x.shape[axis] // parts
    return lax.slice_in_dim(x, i * size, (i + 1) * size, axis=axis)


def _static(ring: _Ring, lk: int, band, q):
    """The chunked kernel's constants for one step: the ring's tile, `band` local to the pair.
    Under a finite fill a band with a left edge visits every block: the keys left of it weigh
    exp(fill - max) too, and only those right of it are added back in closed form."""
    visit_all = band is not None and band[0] is not None and math.isfinite(ring.fill)
    return chunked._Static(ring.block, ring.block, lk, band, ring.fill, ring.scale,
                           scale_q=jnp.dtype(q.dtype).itemsize >= 4, softcap=ring.softcap,
                           visit_all=visit_all)


def _to5(mask):
    return None if mask is None else mask[:, :, None]  # [B|1, 1, 1, 1, Lk]


def _pass_on(x, ring: _Ring, hops: int = 1):
    """Every array of `x` `hops` devices on round the ring (None stays None)."""
    perm = [(r, (r + hops) % ring.n) for r in range(ring.n)]
    return jax.tree.map(lambda a: lax.ppermute(a, ring.axis, perm), x)


def _forward(q, k, v, keys, query_mask, q_ids, kv_ids, ring: _Ring):
    """out [B, L/n, Hkv, G, Dv] (f32, normalized), each row's max and normalizer [B, Hkv, G,
    L/n] (-inf and 0 for a row that saw no key). Merged as (max, normalizer), not as a
    log-sum-exp: at a fill of finfo.min, fill + log(count) rounds back to the fill."""
    b, lq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    parts, rows = len(ring.chunks(0)), lq // len(ring.chunks(0))
    q5 = q.reshape(b, lq, hkv, hq // hkv, d)
    me = lax.axis_index(ring.axis)
    start = jnp.full((b, hkv, hq // hkv, rows), -jnp.inf, jnp.float32)
    acc = [(jnp.zeros((b, rows, hkv, hq // hkv, dv), jnp.float32), start, jnp.zeros_like(start))
           for _ in range(parts)]

    def step(s, block, acc):
        acc = list(acc)
        source = (me - s) % ring.n
        for i, mine in enumerate(ring.chunks(me)):
            extra_q = (_part(q_ids, i, parts, 1), _part(query_mask, i, parts, 1))
            for j, theirs in enumerate(ring.chunks(source)):
                k_j, v_j, keys_j, ids_j = (_part(x, j, parts, axis)
                                           for x, axis in zip(block, (1, 1, 3, 1)))
                seen = _step(_part(q5, i, parts, 1), k_j, v_j, keys_j,
                             (None, extra_q[0], ids_j, extra_q[1]),
                             _relation(mine, theirs, ring, rows), ring)
                acc[i] = _merge(acc[i], seen)
        return block, tuple(acc)

    _, acc = _steps(ring, step, (k, v, keys, kv_ids), tuple(acc))
    return tuple(jnp.concatenate(x, axis=axis) for x, axis in zip(zip(*acc), (1, 3, 3)))


def _steps(ring: _Ring, step, block, carry):
    """`step(s, block, carry) -> (block, carry)` for s = 0 .. ring.steps - 1, the block passed
    on between steps: step 0 unrolled, the rest one `fori_loop` (the program holds two steps
    whatever n; the loop's carry already varies over the ring's axis, as step 0 leaves it)."""
    block, carry = step(0, block, carry)

    def body(s, state):
        return step(s, _pass_on(state[0], ring), state[1])

    return lax.fori_loop(1, ring.steps, body, (block, carry))


def _step(q5, k, v, keys, extra, relation, ring: _Ring):
    """One pair of chunks: queries q5 [B, Lc, Hkv, G, D] against keys k, v [B, Lc', Hkv, D]
    seen as `relation` says; (out normalized over these keys, row max, normalizer)."""
    b, rows, hkv, g, _ = q5.shape
    stats = jnp.zeros((b, hkv, g, rows), jnp.float32)

    def visible(band, operands):
        q5, k_t, v_t, mask = operands
        o, m, l, lse = chunked._forward(q5, k_t, v_t, None, _to5(mask), extra, None, None,
                                        _static(ring, k_t.shape[2], band, q5))
        seen = jnp.isfinite(lse)
        return o, jnp.where(seen, m, -jnp.inf), jnp.where(seen, l, 0.0)

    def hidden(operands):
        _, _, v_t, _ = operands
        shape = (b, rows, hkv, g, v_t.shape[-1])
        if math.isinf(ring.fill):
            return jnp.zeros(shape, jnp.float32), stats - jnp.inf, stats
        # Every key at `fill`: uniform weights, the mean of the chunk's values.
        mean = jnp.mean(v_t.astype(jnp.float32), axis=2)  # [B, Hkv, Dv]
        return (jnp.broadcast_to(mean[:, None, :, None, :], shape), stats + ring.fill,
                stats + v_t.shape[2])

    operands = (q5, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), keys)
    return lax.switch(relation, _branches(ring, rows, visible, hidden), operands)


def _ways(ring: _Ring, length: int) -> tuple[tuple, list[int]]:
    """The distinct ways (`_pair_band`) two chunks of `length` see each other in this ring,
    and for each distance mine - theirs (from 1 - N to N - 1, N chunks) the index of its
    way: the branches of a step's `lax.switch`."""
    total = ring.n * len(ring.chunks(0))
    per_distance = [_pair_band(ring.band, d, length) for d in range(1 - total, total)]
    ways = tuple(dict.fromkeys(per_distance))
    return ways, [ways.index(w) for w in per_distance]


def _relation(mine, theirs, ring: _Ring, length: int) -> jax.Array:
    """The index in `_ways` of how queries of chunk `mine` see the keys of chunk `theirs`."""
    _, index = _ways(ring, length)
    return jnp.asarray(index, jnp.int32)[mine - theirs + (len(index) - 1) // 2]


def _branches(ring: _Ring, length: int, visible, hidden) -> list:
    """`visible(band)` or `hidden` per way of `_ways`, in its order."""
    return [hidden if way == HIDDEN else functools.partial(visible, way)
            for way in _ways(ring, length)[0]]


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
    parts = len(ring.chunks(0))
    q5 = q.reshape(b, lq, hkv, hq // hkv, d)
    do = d_out.astype(jnp.float32).reshape(out.shape)
    # The chunked backward's p = exp(s - m) / l with the whole forward's row max and
    # normalizer; a row that saw no key anywhere has p = 0 at m = 0, l = 1.
    seen = l > 0
    m, l = jnp.where(seen, m, 0.0), jnp.where(seen, l, 1.0)
    # Per chunk of queries: q, out, m, l, dO, seen, as `_step_grads` takes them.
    rows = [tuple(_part(x, i, parts, axis) for x, axis in
                  ((q5, 1), (out, 1), (m, 3), (l, 3), (do, 1), (seen, 3)))
            for i in range(parts)]
    dq = [jnp.zeros(r[0].shape, jnp.float32) for r in rows]
    block = (k, v, keys, kv_ids, jnp.zeros(k.shape, jnp.float32),
             jnp.zeros(v.shape, jnp.float32))
    me = lax.axis_index(ring.axis)

    def step(s, block, dq):
        dq = list(dq)
        k_b, v_b, keys_b, ids_b, dk_b, dv_b = block
        source = (me - s) % ring.n
        dk = [_part(dk_b, j, parts, 1) for j in range(parts)]
        dv = [_part(dv_b, j, parts, 1) for j in range(parts)]
        for i, mine in enumerate(ring.chunks(me)):
            for j, theirs in enumerate(ring.chunks(source)):
                extra = (None, _part(q_ids, i, parts, 1), _part(ids_b, j, parts, 1),
                         _part(query_mask, i, parts, 1))
                dq_s, dk_s, dv_s = _step_grads(
                    rows[i], _part(k_b, j, parts, 1), _part(v_b, j, parts, 1),
                    _part(keys_b, j, parts, 3), extra,
                    _relation(mine, theirs, ring, lq // parts), ring)
                dq[i], dk[j], dv[j] = dq[i] + dq_s, dk[j] + dk_s, dv[j] + dv_s
        return ((k_b, v_b, keys_b, ids_b, jnp.concatenate(dk, axis=1),
                 jnp.concatenate(dv, axis=1)), tuple(dq))

    block, dq = _steps(ring, step, block, tuple(dq))
    # Each block's dk and dv home, from the device the last step left them on.
    *_, dk, dv = block
    home = (ring.n - ring.steps + 1) % ring.n
    if home:
        dk, dv = _pass_on((dk, dv), ring, home)
    dq = jnp.concatenate(dq, axis=1)
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None)


def _step_grads(rows, k, v, keys, extra, relation, ring: _Ring):
    """dq, dk, dv (f32) of one pair of chunks, seen as `relation` says. rows: the query
    chunk's q, out, max, normalizer, dO and whether each row saw a key."""
    q5, out, m, l, do, seen = rows

    def visible(band, operands):
        k, v, mask = operands
        k_t, v_t = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        dq, dk, dv, _, _ = chunked._backward(
            q5, k_t, v_t, None, _to5(mask), extra, None, None, out, m, l, do,
            _static(ring, k_t.shape[2], band, q5))
        return dq, dk, dv

    def hidden(operands):
        k, v, _ = operands
        zeros = (jnp.zeros(q5.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32))
        if math.isinf(ring.fill):
            return (*zeros, jnp.zeros(v.shape, jnp.float32))
        # Each key of the chunk weighs exp(fill - m) / l in row i: dv_j = Σ_i w_i dO_i.
        w = jnp.where(seen, jnp.exp(ring.fill - m) / l, 0.0)  # [B, Hkv, G, Lc]
        per_key = jnp.einsum("bhgq,bqhgd->bhd", w, do)
        return (*zeros, jnp.broadcast_to(per_key[:, None], v.shape))

    return lax.switch(relation, _branches(ring, q5.shape[1], visible, hidden), (k, v, keys))


_ring.defvjp(_ring_fwd, _ring_bwd)
