"""A post-softmax operand drawn tile by tile: dropout's keep mask, never [B, H, Lq, Lk] at once.

A program in training draws dropout's keep mask from `jax.random` over the whole score shape,
then works on each element alone: random bits, then arithmetic on each bit pattern
(`bernoulli`: shift, or, bitcast, compare with keep_prob; then `/ keep_prob`). jax's threefry
(with `jax_threefry_partitionable`, its default) draws the bits at flat position n from the
key and n alone: threefry2x32(key, (n >> 32, n mod 2³²)), the two output words xor-ed. So the
bits of a tile are the whole array's bits at the tile's positions: `DrawnMask.tile` computes
them and runs the program's own equations from the bits to the mask on them. That gives the
values the program has there, bit for bit, while a kernel holds one tile at a time.

`unavailable()` checks the installed jax against that formula once, on a small array both
ways; where it says why not, the caller reads the program's mask from memory as before.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlotool import jaxcompat

# Equations a cone may hold on full-shape values: each output element is a function of the
# same element of its operands (and of values with one element, broadcast).
ELEMENTWISE = frozenset({
    "shift_right_logical", "shift_right_arithmetic", "shift_left", "or", "and", "xor", "not",
    "bitcast_convert_type", "convert_element_type", "add", "sub", "mul", "div", "max", "min",
    "neg", "abs", "floor", "ceil", "lt", "le", "gt", "ge", "eq", "ne", "select_n",
})
CALLS = frozenset({"jit", "pjit", "closed_call"})  # jax.jit's call ("pjit" in older jax)
THREEFRY = "key<fry>"


def dropped_by(keep: jax.Array, weights: jax.Array) -> jax.Array:
    """Float `weights` where the boolean `keep` holds, else -0.0: the float post_mask of a
    boolean mask beside dropout's multipliers (`kernels.base`'s module doc)."""
    if weights.dtype == jnp.bool_:
        return keep & weights
    return jnp.where(keep, weights, jnp.asarray(-0.0, weights.dtype))


def _threefry():
    """jax's threefry2x32 primitive, or None where jax.extend does not export it."""
    try:
        from jax.extend import random as extend_random
    except ImportError:
        return None
    return getattr(extend_random, "threefry2x32_p", None)


def _mul_wide(a: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(high, low) 32-bit words of a · c for uint32 `a` and 0 ≤ c < 2³², in uint32 only (jax
    without x64 has no uint64), from 16-bit halves."""
    u32 = jnp.uint32
    a0, a1 = a & u32(0xFFFF), a >> u32(16)
    c0, c1 = u32(c & 0xFFFF), u32(c >> 16)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1
    mid = p01 + p10
    mid_carry = jnp.where(mid < p01, u32(1), u32(0))
    low = p00 + (mid << u32(16))
    low_carry = jnp.where(low < p00, u32(1), u32(0))
    return p11 + (mid >> u32(16)) + (mid_carry << u32(16)) + low_carry, low


def threefry2x32(k0, k1, x0, x1) -> tuple[jax.Array, jax.Array]:
    """jax's threefry2x32 (Salmon et al.'s 20 rounds, five key injections) in uint32
    arithmetic alone: a Pallas TPU kernel body has no lowering of `threefry2x32_p`.
    `unavailable()` checks it against jax's bits."""
    u32 = jnp.uint32
    ks = (k0, k1, k0 ^ k1 ^ u32(0x1BD11BDA))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in ((13, 15, 26, 6), (17, 29, 16, 24))[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << u32(r)) | (x1 >> u32(32 - r)))
        x0, x1 = x0 + ks[(i + 1) % 3], x1 + ks[(i + 2) % 3] + u32(i + 1)
    return x0, x1


def position_bits(key_data, rows: jax.Array, cols: jax.Array, lk: int,
                  in_kernel: bool = False) -> jax.Array:
    """uint32 bits jax draws at flat positions rows·lk + cols (uint32 `rows` and `cols`,
    broadcasting), from threefry key data [2]: with `in_kernel`, by `threefry2x32` (a kernel
    body), else by jax's primitive."""
    u32 = jnp.uint32
    high, low = _mul_wide(rows, lk)
    flat_low = low + cols
    flat_high = high + jnp.where(flat_low < low, u32(1), u32(0))
    fry = threefry2x32 if in_kernel else _threefry().bind
    x1, x2 = fry(key_data[0], key_data[1], flat_high, flat_low)
    return x1 ^ x2


def tile_bits(key_data: jax.Array, full: tuple[int, ...], q_start, q_size: int, k_start,
              k_size: int) -> jax.Array:
    """uint32 [B, H, q_size, k_size]: `jax.random.bits(key, full)` ([B, H, Lq, Lk]) at queries
    q_start.. and keys k_start.. (ints or traced int32). Positions past the array's end get
    bits of their own (a kernel's padding: never read as the program's)."""
    b, h, lq, lk = full
    u32 = jnp.uint32
    rows = (lax.broadcasted_iota(u32, (b, h, q_size, 1), 0) * u32(h)
            + lax.broadcasted_iota(u32, (b, h, q_size, 1), 1)) * u32(lq) \
        + (jnp.asarray(q_start).astype(u32) + lax.broadcasted_iota(u32, (b, h, q_size, 1), 2))
    return position_bits(key_data, rows, jnp.asarray(k_start).astype(u32)
                         + lax.iota(u32, k_size), lk)


@functools.cache
def unavailable(in_kernel: bool = False) -> str | None:
    """Why tiles of jax's random bits cannot be drawn here (`in_kernel`: by `threefry2x32`,
    as a kernel body draws them); None when they can."""
    if _threefry() is None and not in_kernel:
        return "jax.extend.random has no threefry2x32_p"
    shape = (2, 3, 5, 7)

    def both(data):
        key = jax.random.wrap_key_data(data, impl="threefry2x32")
        rows = (lax.broadcasted_iota(jnp.uint32, (6, 3, 1), 0) * jnp.uint32(5)
                + 1 + lax.broadcasted_iota(jnp.uint32, (6, 3, 1), 1))
        cols = 2 + lax.iota(jnp.uint32, 4)
        return jax.random.bits(key, shape), position_bits(data, rows, cols, 7, in_kernel)

    try:  # compiled and run apart: the first use may come while jax traces a program
        compiled = jax.jit(both).lower(jax.ShapeDtypeStruct((2,), jnp.uint32)).compile()
        want, got = (np.asarray(x) for x in compiled(np.array([7, 1234], np.uint32)))
    except Exception as err:  # noqa: BLE001 - any failure means: read the mask instead
        return f"drawing a tile of random bits failed ({type(err).__name__}: {err})"
    if not np.array_equal(got.reshape(2, 3, 3, 4), want[:, :, 1:4, 2:6]):
        return "jax.random.bits is not threefry2x32 of each element's flat position"
    return None


def usable() -> str | None:
    """Why a mask cannot be drawn in tiles now (the probe, or the config); None when it can."""
    if not jax.config.jax_threefry_partitionable:
        return "jax_threefry_partitionable is off (bits depend on the whole array's shape)"
    return unavailable()


def _small(aval: Any) -> bool:
    return math.prod(aval.shape) == 1


def check(jaxpr: jaxcompat.Jaxpr, full: tuple[int, ...]) -> str | None:
    """Why the cone `jaxpr` (inputs: one-element values, keys among them; one output of shape
    `full`, the scores' in the program, keys last) cannot be computed tile by tile; None
    when it can. Values of shape `full` are the ones `_evaluate` holds as tiles: each must
    come from random bits, from elementwise equations, or from a broadcast of one value."""
    if math.prod(full[:-1]) >= 2 ** 32 or full[-1] >= 2 ** 32:
        return f"the mask's shape {full} is beyond 32-bit rows"
    if tuple(jaxpr.outvars[0].aval.shape) != tuple(full):
        return "the mask is not of the scores' shape"
    found = _check(jaxpr, tuple(full))
    if found is None:
        return "the mask draws no random bits of its shape"
    return None if found is True else found


def _check(jaxpr: jaxcompat.Jaxpr, full: tuple) -> str | bool | None:
    """Why not (str), or whether random bits are drawn (True; None: not)."""
    def is_full(v) -> bool:
        return not isinstance(v, jaxcompat.Literal) and tuple(v.aval.shape) == full

    drawn = None
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.effects:
            return f"`{name}` has effects"
        if name == "random_bits":
            key = eqn.invars[0].aval
            if str(key.dtype) != THREEFRY or key.shape != ():
                return f"random bits from a {key.str_short()} key (not one threefry key)"
            if tuple(eqn.params["shape"]) != full or eqn.params["bit_width"] != 32:
                return f"random bits of shape {tuple(eqn.params['shape'])} (not the scores')"
            drawn = True
        elif name in CALLS:
            inner = _check(eqn.params["jaxpr"].jaxpr, full)
            if isinstance(inner, str):
                return inner
            drawn = drawn or inner
        elif any(is_full(v) for v in eqn.invars):
            if name not in ELEMENTWISE:
                return f"`{name}` on the mask's values is not elementwise"
            if any(not is_full(v) and not _small(v.aval) for v in eqn.invars):
                return f"`{name}` mixes the mask with a value of another shape"
        elif any(is_full(v) for v in eqn.outvars):
            if name != "broadcast_in_dim":
                return f"`{name}` makes a value of the mask's shape"
            if not _small(eqn.invars[0].aval):
                return "a broadcast of more than one value into the mask"
    return drawn


@jax.tree_util.register_pytree_node_class
class DrawnMask:
    """A [B, Hq, Lq, Lk] post-softmax operand computed from jax.random bits per tile.

    cone: a jaxpr from its inputs (threefry keys, one-element values) to the program's mask,
    as `check` accepts it, of shape [B|1, Hq|1, Lq, Lk] (`full`); inputs: their values, keys
    as key data (uint32, `keys` says which), so that the operand passes through
    `jax.custom_vjp` as integers; keep_when: for a bool mask, the value that keeps a key (the
    kernel's True); dtype: the operand's (bool: keep, float: multiplier); also: None, or a
    bool operand read as it is (the caller's other masks after the softmax, in the caller's
    layout) that zeroes the operand where it is False (Keras applies its attention mask
    after the softmax beside dropout's)."""

    def __init__(self, cone: jaxcompat.Jaxpr, inputs: tuple, keys: tuple[bool, ...],
                 full: tuple[int, ...], dtype: Any, keep_when: bool = True,
                 also: jax.Array | None = None):
        self.cone, self.inputs, self.keys = cone, tuple(inputs), tuple(keys)
        self.full, self.dtype, self.keep_when = tuple(full), jnp.dtype(dtype), keep_when
        self.also = also

    @classmethod
    def of(cls, cone: jaxcompat.Jaxpr, values: tuple, dtype: Any, keep_when: bool = True,
           also: jax.Array | None = None) -> DrawnMask:
        """The operand for the cone's input `values` (keys typed, as the program has them)."""
        keys = tuple(jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)
                     for x in values)
        inputs = tuple(jax.random.key_data(x) if k else x for x, k in zip(values, keys))
        return cls(cone, inputs, keys, tuple(cone.outvars[0].aval.shape), dtype, keep_when,
                   also)

    def with_also(self, also: jax.Array | None) -> DrawnMask:
        """The same draw with `also` in another layout (a kernel's own)."""
        return DrawnMask(self.cone, self.inputs, self.keys, self.full, self.dtype,
                         self.keep_when, also)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.full

    @property
    def ndim(self) -> int:
        return 4

    def tree_flatten(self):
        return (self.inputs, self.also), (self.cone, self.keys, self.full, str(self.dtype),
                                          self.keep_when)

    @classmethod
    def tree_unflatten(cls, aux, children):
        cone, keys, full, dtype, keep_when = aux
        inputs, also = children
        return cls(cone, tuple(inputs), keys, full, dtype, keep_when, also)

    def _values(self) -> list:
        """The cone's inputs as the program has them (keys typed)."""
        return [jax.random.wrap_key_data(x, impl="threefry2x32") if k else x
                for x, k in zip(self.inputs, self.keys)]

    def tile(self, q_start, q_size: int, k_start, k_size: int) -> jax.Array:
        """[B, Hq, q_size, k_size] of the drawn operand at queries q_start.., keys
        k_start.. (without `also`, which the caller applies in its own layout)."""
        shape = (*self.full[:2], q_size, k_size)
        values = self._values()

        def draw(key_data):
            return tile_bits(key_data, self.full, q_start, q_size, k_start, k_size)

        (out,) = _evaluate(self.cone, (), values, self.full, shape, draw)
        return self._finish(out, q_start, q_size, k_start, k_size)

    def boundary(self) -> list:
        """What the cone's tile equations read from its other equations (keys as key data),
        computed here, outside a kernel body; `block` takes it in one."""
        found = _Boundary(inner=False)
        _evaluate(self.cone, (), self._values(), self.full, (1, 1), None, found)
        return found.values

    def block(self, boundary: list, b, h, q_start, q_size: int, k_start, k_size: int
              ) -> jax.Array:
        """[q_size, k_size] of the operand for batch b and head h at queries q_start.., keys
        k_start.. (int32 scalars: a kernel's program ids), in a kernel body: the tile
        equations alone, on `boundary` (`DrawnMask.boundary`), the bits by `threefry2x32`."""
        u32 = jnp.uint32
        nb, nh, lq, lk = self.full
        b = jnp.zeros((), u32) if nb == 1 else jnp.asarray(b).astype(u32)
        h = jnp.zeros((), u32) if nh == 1 else jnp.asarray(h).astype(u32)
        shape = (q_size, k_size)
        rows = ((b * u32(nh) + h) * u32(lq) + jnp.asarray(q_start).astype(u32)
                + lax.broadcasted_iota(jnp.int32, shape, 0).astype(u32))
        cols = jnp.asarray(k_start).astype(u32) + lax.broadcasted_iota(jnp.int32, shape, 1
                                                                      ).astype(u32)

        def draw(key_data):
            return position_bits(key_data, rows, cols, lk, in_kernel=True)

        (out,) = _evaluate(self.cone, (), [None] * len(self.inputs), self.full, shape, draw,
                           _Boundary(inner=True, values=boundary))
        return self._finish(out, q_start, q_size, k_start, k_size)

    def _finish(self, out: jax.Array, q_start, q_size: int, k_start, k_size: int) -> jax.Array:
        """A tile of the cone's output as the operand: the kernel's keep value, its dtype,
        and 0 past the end (a kernel's padding: the program has no value there, and the inf
        or NaN a multiplier could take would reach the padding's zeros)."""
        out = out if self.keep_when or out.dtype != jnp.bool_ else ~out
        shape = (q_size, k_size)
        inside = ((jnp.asarray(q_start) + lax.broadcasted_iota(jnp.int32, shape, 0)
                   < self.full[2])
                  & (jnp.asarray(k_start) + lax.broadcasted_iota(jnp.int32, shape, 1)
                     < self.full[3]))
        return jnp.where(inside, out.astype(self.dtype), jnp.zeros((), self.dtype))

    def dense(self) -> jax.Array:
        """The whole operand, as the program computes it (`also` applied)."""
        out = self.tile(0, self.full[2], 0, self.full[3])
        return out if self.also is None else dropped_by(self.also, out)


class _Boundary:
    """The one-element values (and keys, as key data) a cone's tile equations read from its
    other equations, in the order a walk reads them: `outer` walks record them (run outside
    a kernel), `inner` walks take them back (in a kernel body, which runs the tile
    equations alone)."""

    def __init__(self, inner: bool, values: list | None = None):
        self.inner, self.values = inner, list(values or [])
        self._next = 0

    def take(self):
        value = self.values[self._next]
        self._next += 1
        return value


def _evaluate(jaxpr: jaxcompat.Jaxpr, consts, args, full: tuple, tile: tuple, draw,
              boundary: _Boundary | None = None) -> list:
    """`jaxpr` (a cone `check` accepts) on one tile: values of the program's `full` shape are
    held as their `tile`, random bits drawn there by `draw` (from key data), the rest as
    they are. With a `boundary`, one side only (see `_Boundary`); the other side's values
    are None."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jaxcompat.Literal) else env[v]

    def is_full(v) -> bool:
        return not isinstance(v, jaxcompat.Literal) and tuple(v.aval.shape) == full

    def spread(x):  # a one-element value over the tile (a kernel body holds it as a scalar)
        return jnp.broadcast_to(x if jnp.ndim(x) == 0 else jnp.reshape(x, ()), tile)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        on_tile = name == "random_bits" or any(is_full(v) for v in eqn.outvars)
        ins = [read(v) for v in eqn.invars]
        if boundary is not None and on_tile and name not in CALLS:
            for n, v in enumerate(eqn.invars):
                if is_full(v) or isinstance(v, jaxcompat.Literal):
                    continue
                if not boundary.inner:
                    boundary.values.append(jax.random.key_data(ins[n])
                                           if name == "random_bits" else ins[n])
                else:
                    ins[n] = boundary.take()
            if not boundary.inner:
                env.update((v, None) for v in eqn.outvars)
                continue
        elif boundary is not None and boundary.inner and name not in CALLS:
            env.update((v, None) for v in eqn.outvars)
            continue
        if name == "random_bits":
            outs = [draw(ins[0] if boundary is not None else jax.random.key_data(ins[0]))]
        elif name in CALLS:
            inner = eqn.params["jaxpr"]
            outs = _evaluate(inner.jaxpr, inner.consts, ins, full, tile, draw, boundary)
        elif any(is_full(v) for v in eqn.outvars):
            if name == "broadcast_in_dim":
                outs = [spread(ins[0])]
            else:
                outs = eqn.primitive.bind(*(x if is_full(v) else spread(x)
                                            for x, v in zip(ins, eqn.invars)), **eqn.params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
        else:
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
