"""Generated attention programs: a small grammar, its hypothesis strategy, and the check that
a rewrite keeps each program's meaning.

A `Program` is softmax(chain(Q·Kᵀ))·V written the plain way, where the chain is a random
sequence of steps: scale (mul/div by 1e-6 … 1e3), masks (`where(m, s, fill)` or its mirror,
fill -inf / finfo.min / -1e9 / -1e4 / -5; causal top-left or bottom-right, sliding window,
random boolean, key padding from lengths, rows with no visible key, `tril & padding`
built in the program as gemma and Hugging Face combine them, query padding alone and flax's
outer AND of query and key padding with tril, the `gemma` library's sliding window compared
on positions `cumsum(input_mask) - 1` of a left-, right- or un-padded batch), additive biases
of every
broadcast shape (some with -inf / finfo.min entries), additive causal constants and tanh
soft-capping (`tanh(s / c) * c`); in f32, bf16 or f16, BLHD / BHLD / merged-heads layouts, GQA
by repeat, Lq = 1 and Lk = 1 included. A sink logit per head may be concatenated as one more
column (then dropped after the softmax), the logits may be shifted by their row max first
(`s - stop_gradient(max(s))`, GPT-OSS), and after the softmax `where(m, p, 0)` (Keras' masked
softmax: with the chain's own mask or another) and head masks (`einsum("...hqk,h->...hqk", p,
m)`, all ones or data) apply.
Look-alikes (softmax over the query axis, `softmax(where=)`, a multiplicative mask, a scale
after the softmax, a squared softmax) are not attention and must come back untouched.

What a careful adversary writes next (issue 35), each rare so that most programs keep few:
ops that change values or derivatives on an operand, on the logits or on the probabilities
(`stop_gradient`, fp8 `reduce_precision`, int8 fake quantization, a narrower float round
trip, a widening cast: `VALUE_OPS`); q in bfloat16 against float32 k and v or the other way;
masks whose arithmetic is not what it looks like (a window over uint32 or float positions, a
traced bound, `tril(k=±1)`, lengths as an argument, int32 masks made boolean in the program:
`TRICKY_MASKS`, `int_mask`); traced and per-head scales; biases per query, per head, or
computed from q or k; `1/√d` on q, k or both before the dot; exp(s) / sum without the max
and exp(log_softmax); heads last and no batch axis; D in {1, 3, 80, 256}, lengths 2 and 129,
and 1000 with the kernel's own tiles (and `kernel="auto"`); a NaN key hidden by padding; the
attention under `lax.cond`, in a `fori_loop`, vmapped over heads, inside a custom_vjp, with
a custom_vjp softmax, or over one sequence cut into blocks that are the batch (`WRAPS`).

`check(program)` runs the naive program under `jax.jit` and under `hlotool.flash_jit` (the
chunked kernel with small blocks, so tiles, skipping and padding are exercised) and returns
"native" (no site rewritten; each site has a reason), "rewritten" (outputs and the gradients
of a random projection w.r.t. q, k, v and the bias within the dtype's tolerance of the naive
program's, no non-finite value where the naive one is finite) or "wrong".

How "within tolerance" is measured:
  - per value (output, each gradient): max |rewritten - naive| over the larger of max |naive|
    and the magnitude of the terms that value sums (|v| for the output; |dO|·|v| times |C|·|k|
    for dq, |C|·|q| for dk, the scales after it for a bias, 1 for a head mask; |dO| for dv),
    so a gradient that is exactly zero (one visible key: dq = 0) is judged against its
    terms' size, not its own rounding noise;
  - the naive program has rounding errors of its own: in bf16 and f16 always, in f32 where a
    large constant absorbs the data (s + b - 1e9 rounds to a multiple of 64). A rewrite that
    misses the naive values also passes when it is within the tolerance, or within twice the
    naive program's own error, of the same program computed in float64 (fills and constants
    rounded to the program's dtype first, results rounded to it last, so that a gradient
    beyond the dtype's range is inf), the naive one's error being finite; or within what
    rounding each logit twice in float32 at its magnitude can move it (`_logit_rounding`:
    a row the program leaves only logits s - 1e4 is known to 1e-3 of its value, in any
    order of sums);
  - data magnitudes follow the scale steps so that every term reaches the softmax at
    |logit| ≲ 8: the tolerance measures the rewrite, not float32's conditioning of exp at
    large logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from hlotool.flash import Rewritten
from hlotool.kernels import get

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
FILLS = ("-inf", "finfo.min", "-1e9", "-1e4", "-5")
MASKS = ("causal", "causal_bottom_right", "window", "boolean", "key_padding",
         "causal_and_padding", "band", "band_and_padding", "segments", "segments_and_causal",
         "keras_merged", "nnx_combined", "ones_and_padding", "transposed_and_causal",
         "query_padding", "query_and_key_padding", "positions_window")
# Masks whose arithmetic is not what it looks like, or has a traced part: built in the
# program, each must be read as the values it computes or keep the site native.
#   window_uint32: `(i - j) < 3` over uint32 positions, which wraps for j > i (hidden)
#   window_float: a window over float positions `arange * 0.1` (rounding moves its edge)
#   window_traced: `(i - j) < 3 * c` with c an argument of the program
#   tril_k: jnp.tril(ones, k) with k = `offset` (±1)
#   lengths: key padding `arange(Lk) < lengths[b]` from a lengths argument
TRICKY_MASKS = ("window_uint32", "window_float", "window_traced", "tril_k", "lengths")
# Biases: of a shape, or computed from q or k inside the program.
BIAS_SHAPES = ("k", "qk", "b11k", "1hqk", "bhqk", "q1", "h11", "from_q", "from_k")
LOOKALIKES = ("softmax_over_queries", "softmax_where", "multiplicative_mask",
              "scale_after_softmax", "squared_softmax")
# Ops on an operand (q, k or v), on the logits (a step "op") or on the probabilities that
# change values or derivatives: a rewrite must keep each or stay native.
#   stop_gradient, reduce_precision (to 3 mantissa bits, fp8 emulation), fake_quant
#   ((x * 16) clipped, cast to int8 and back, / 16), roundtrip (a cast to a narrower
#   float and back), widen (a cast to float32 from a narrower program dtype)
VALUE_OPS = ("stop_gradient", "reduce_precision", "fake_quant", "roundtrip", "widen")
# Where the attention sits: under lax.cond, in a fori_loop body, vmapped over heads, inside
# a custom_vjp whose backward is half the true one (so a rewrite that replaced it shows),
# or with its softmax such a custom_vjp (a site only partly inside: must stay native).
WRAPS = ("cond", "fori", "vmap_heads", "custom_vjp", "custom_vjp_softmax", "blocks")


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # "scale" | "mask" | "select_bias" | "bias" | "causal_bias" | "softcap" | "op"
    op: str = "mul"  # scale: mul/div/traced/per_head; op: one of VALUE_OPS
    value: float = 1.0  # scale: the constant; causal_bias: the value above the diagonal;
    # softcap: c of tanh(s / c) * c
    mask: str = ""  # mask kind
    fill: str = "-inf"
    mirrored: bool = False  # where(~m, fill, s) instead of where(m, s, fill)
    empty_row: bool = False  # one query row sees no key
    shape: str = "qk"  # bias shape
    extreme: str = ""  # bias: "" | "-inf" | "finfo.min" entries
    # mask "band" / "band_and_padding": (left, right), query i sees keys i - left .. i + right
    # (None: unbounded), built in the program from iotas (abs(i - j) <= w when left == right);
    # mask "positions_window": (w,), keys whose positions are within w - 1 of the query's
    window: tuple = ()
    # mask "positions_window": where the input mask pads its tokens, "left" | "right" | "none"
    padding: str = ""
    # mask: its value closed over as a constant of the program (a key padding mask then keeps
    # its [B, 1, 1, Lk] shape), not an argument
    constant: bool = False
    # mask / select_bias: the mask an int32 argument of 0s and 1s, made boolean in the
    # program (`m == 1` for a mask, Hugging Face's `select(m > 0, 0, fill)` for a bias)
    int_mask: bool = False
    offset: int = 0  # mask "tril_k": the diagonal k of jnp.tril
    # scale: "traced" multiplies by a scalar argument, "per_head" by a constant per head


@dataclasses.dataclass(frozen=True)
class Program:
    dtype: str
    layout: str  # "BLHD" | "BHLD" | "merged"
    b: int
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    steps: tuple[Step, ...]
    manual_softmax: bool = False
    lookalike: str = ""
    head_mask: str = ""  # "" | "ones" (a constant) | "data" (an argument): einsum(p, m[h])
    # "" | "same" (the first mask step's operand) | "data" | "mirrored" | "repeat" (the
    # predicate the last mask step selects with, as it did: Keras' masked softmax)
    post_mask: str = ""
    sinks: bool = False  # a sink logit per head, concatenated, dropped after the softmax
    shift: bool = False  # s - stop_gradient(max(s)) before the softmax
    dropout: bool = False  # p * bernoulli(key, 0.8).astype / 0.8 after the softmax (HF, flax)
    seed: int = 0
    # float32 programs only: "q_bf16" (q in bfloat16, k and v in float32, promoted by the
    # program) or "kv_bf16" (the other way)
    mixed: str = ""
    operand_op: tuple[str, str] = ()  # (which of "q", "k", "v", one of VALUE_OPS)
    probs_op: str = ""  # one of VALUE_OPS on the probabilities, after the softmax
    # "" (jax.nn.softmax or `manual_softmax`), "no_max" (exp(s) / sum(exp(s))),
    # "log_softmax" (exp(log_softmax(s)))
    softmax: str = ""
    prescale: str = ""  # "q" | "k" | "both": 1/√d (or its root) on the operands before the dot
    wrap: str = ""  # one of WRAPS
    nan_key: bool = False  # k NaN at a key the first key-padding mask hides
    kernel_blocks: bool = False  # the chunked kernel's own block sizes, not 8 x 8
    kernel: str = "chunked"  # or "auto": the cost model's choice per platform

    @property
    def features(self) -> list[str]:
        """Labels for the fuzz table: one per trait of the program."""
        out = [self.dtype, self.layout]
        if self.hkv != self.hq:
            out.append("gqa")
        if self.lq == 1:
            out.append("lq=1")
        if self.lk == 1:
            out.append("lk=1")
        if self.lookalike:
            out.append(f"lookalike:{self.lookalike}")
        if self.head_mask:
            out.append(f"head_mask:{self.head_mask}")
        if self.post_mask:
            out.append(f"post_mask:{self.post_mask}")
        if self.sinks:
            out.append("sinks")
        if self.shift:
            out.append("shift")
        if self.dropout:
            out.append("dropout")
        if self.mixed:
            out.append(f"mixed:{self.mixed}")
        if self.operand_op:
            out.append(f"operand_op:{self.operand_op[1]}")
        if self.probs_op:
            out.append(f"probs_op:{self.probs_op}")
        for flag in ("softmax", "prescale", "wrap"):
            if getattr(self, flag):
                out.append(f"{flag}:{getattr(self, flag)}")
        if self.nan_key:
            out.append("nan_key")
        if self.kernel_blocks:
            out.append("kernel_blocks")
        if self.kernel != "chunked":
            out.append(f"kernel:{self.kernel}")
        if self.lq != self.lk:
            out.append("lq!=lk")
        out.append(f"d={self.d}")
        for s in self.steps:
            if s.kind == "scale":
                out.append("scale" if s.op in ("mul", "div") else f"scale:{s.op}")
            elif s.kind == "op":
                out.append(f"logits_op:{s.op}")
            elif s.kind == "softcap":
                out.append("softcap")
            elif s.kind in ("mask", "select_bias"):
                prefix = "mask" if s.kind == "mask" else "select_bias"
                out += [f"{prefix}:{s.mask}", f"fill:{s.fill}"]
                if s.window:
                    out.append("window:" + ",".join(str(w) for w in s.window))
                if s.padding:
                    out.append(f"padding:{s.padding}")
                if s.empty_row:
                    out.append("empty_row")
                if s.constant:
                    out.append("constant_mask")
                if s.int_mask:
                    out.append("int_mask")
            elif s.kind == "bias":
                out.append(f"bias:{s.shape}" + (f"+{s.extreme}" if s.extreme else ""))
            else:
                out.append("causal_bias")
        return out


def _fill(name: str, dtype) -> float:
    """The fill as the program holds it in `dtype` (-1e9 is -inf in float16)."""
    if name == "finfo.min":
        value = float(jnp.finfo(dtype).min)
    else:
        value = {"-inf": -math.inf, "-1e9": -1e9, "-1e4": -1e4, "-5": -5.0}[name]
    with np.errstate(over="ignore"):
        return float(np.asarray(value, np.float64).astype(jnp.dtype(dtype)))


def _rounded(x: float, dtype) -> float:
    with np.errstate(over="ignore"):  # 1e6 is inf in float16, as in the program
        return float(np.asarray(x, np.float64).astype(jnp.dtype(dtype)))


def _mask(step: Step, p: Program, rng: np.random.Generator) -> np.ndarray | None:
    """bool [B, 1, Lq, Lk] (True = attend; int32 0/1 for an `int_mask`); for segment masks
    int32 [B, Lq + Lk], the ids of the queries then of the keys (runs of packed sequences);
    for the tricky masks their argument (lengths [B], the window's factor c) or None where
    the program builds them from iotas alone."""
    if step.mask in ("window_uint32", "window_float", "tril_k"):
        return None
    if step.mask == "window_traced":
        return np.int32(1)
    if step.mask.startswith("segments"):
        return np.concatenate([np.sort(rng.integers(0, 3, (p.b, n)), axis=1)
                               for n in (p.lq, p.lk)], axis=1).astype(np.int32)
    if step.mask == "query_padding":  # [B, 1, Lq, 1]: whole query rows hidden
        return rng.random((p.b, 1, p.lq, 1)) < 0.75
    if step.mask == "query_and_key_padding":  # bool [B, Lq + Lk]: queries' then keys' padding
        return rng.random((p.b, p.lq + p.lk)) < 0.8
    if step.mask == "positions_window":  # bool [B, L]: the input mask, n tokens of L (n ≥ 0)
        tokens = rng.integers(0, p.lk + 1, size=p.b)[:, None]
        index = np.arange(p.lk)[None]
        return {"left": index >= p.lk - tokens, "right": index < tokens,
                "none": np.ones((p.b, p.lk), bool)}[step.padding]
    i = np.arange(p.lq)[:, None]
    j = np.arange(p.lk)[None, :]
    if step.mask == "causal":
        m = j <= i
    elif step.mask == "causal_bottom_right":
        m = j <= i + (p.lk - p.lq)
    elif step.mask == "window":
        m = (j <= i + (p.lk - p.lq)) & (j > i + (p.lk - p.lq) - 3)
    elif step.mask in ("boolean", "transposed_and_causal"):
        m = rng.random((p.b, 1, p.lq, p.lk)) < 0.7
    else:  # key padding (alone, or ANDed with tril in the program): lengths in [1, Lk], or 0
        lengths = rng.integers(1, p.lk + 1, size=p.b)
        if p.nan_key:
            lengths[0] = p.lk - 1  # the last key of row 0 is hidden, and NaN (`build`)
        if step.empty_row:
            lengths[0] = 0
        if step.mask == "lengths":
            return lengths.astype(np.int32)
        m = (j < lengths[:, None, None, None])
    m = np.broadcast_to(m, (p.b, 1, p.lq, p.lk)).copy()
    if step.mask in ("causal_and_padding", "band_and_padding", "band", "keras_merged",
                     "nnx_combined", "ones_and_padding") or (
            step.mask == "key_padding" and step.constant):
        m = m[:, :, :1, :]  # [B, 1, 1, Lk]: the program ANDs it with its own tril or band
    elif step.empty_row and step.mask != "key_padding":
        m[0, 0, p.lq // 2] = False
    return m.astype(np.int32) if step.int_mask else m


def _tricky_mask(step: Step, p: Program, arg):
    """The masks of TRICKY_MASKS as the program builds them (True = attend)."""
    if step.mask == "window_uint32":  # j > i wraps to a huge i - j: hidden
        i = jnp.arange(p.lq, dtype=jnp.uint32)[:, None]
        j = jnp.arange(p.lk, dtype=jnp.uint32)[None, :]
        return (i - j) < 3
    if step.mask == "window_float":
        i = (jnp.arange(p.lq, dtype=jnp.float32) * 0.1)[:, None]
        j = (jnp.arange(p.lk, dtype=jnp.float32) * 0.1)[None, :]
        return ((i - j) < 0.3) & (j <= i)
    if step.mask == "window_traced":
        i, j = jnp.arange(p.lq)[:, None], jnp.arange(p.lk)[None, :]
        return ((i - j) < 3 * arg) & (j <= i)
    if step.mask == "tril_k":
        return jnp.tril(jnp.ones((p.lq, p.lk), bool), step.offset)
    return (jnp.arange(p.lk)[None, :] < arg[:, None])[:, None, None, :]  # lengths


def _positions_window(input_mask, window: int, p: Program):
    """The `gemma` library's local mask from its input mask [B, L] (Lq == Lk == L):
    positions 0, 1, ... of the tokens (a padded one repeats its neighbour's), key padding ANDed
    with tril, times keys whose positions are within `window` - 1 of the query's; [B, 1, L, L]."""
    counted = jnp.cumsum(input_mask, axis=-1)
    positions = counted - (counted >= 1)
    keys, queries = positions[:, None, :], positions[:, :, None]
    mask = input_mask[:, None, :] * jnp.tril(jnp.ones((p.lq, p.lk), bool))[None]
    sliding = (keys > queries - window) * (keys < queries + window)
    return (mask * sliding)[:, None]


def _keras_merged(padding, p: Program):
    """KerasHub's Gemma mask from key padding [B, 1, 1, Lk]: its int32 cast and a causal
    mask of float positions merged by `minimum`, then a window of `triu * tril` sliced at
    the cache index (0) ANDed in."""
    i = jnp.arange(p.lq, dtype=jnp.float32)[:, None]
    j = jnp.arange(p.lk, dtype=jnp.float32)[None, :]
    merged = jnp.minimum(padding.astype(jnp.int32), (i >= j).astype(jnp.int32))
    ones = jnp.ones((max(p.lq, p.lk), p.lk), bool)
    sliding = jax.lax.dynamic_slice(jnp.triu(ones, -3) * jnp.tril(ones, 3), (0, 0),
                                    (p.lq, p.lk))
    return jnp.logical_and(merged, sliding)


def _nnx_combined(padding, p: Program):
    """flax nnx's `combine_masks(make_causal_mask(tokens), padding)` from key padding
    [B, 1, 1, Lk]: a causal mask of positions broadcast per batch row, cast to float32, ANDed
    with the padding and cast to float32 again; `dot_product_attention` casts it back to
    bool."""
    i = jnp.broadcast_to(jnp.arange(p.lq), (p.b, p.lq))[:, None, :, None]
    j = jnp.broadcast_to(jnp.arange(p.lk), (p.b, p.lk))[:, None, None, :]
    causal = (i >= j).astype(jnp.float32)
    return jnp.logical_and(causal, padding.astype(jnp.float32)).astype(jnp.float32).astype(bool)


def _value_op(x, op: str, wide, dt):
    """One of VALUE_OPS applied to `x` as the program applies it to its `dt` values; `wide`
    is the dtype "widen" casts to. In the float64 reference `x` is first rounded to `dt`:
    a rounding op is discontinuous, and one bf16 step of an operand can move a soft-capped
    logit from saturated to not (a float16 program's k / size rounds to float16 before
    bfloat16; rounding the exact quotient to bfloat16 gave 274 of 4128 values another step)."""
    if op == "stop_gradient":
        return jax.lax.stop_gradient(x)
    if op != "widen" and x.dtype != dt:
        x = x.astype(dt).astype(x.dtype)
    # fp8's 3 mantissa bits, with an exponent wide enough that the generator's data (scaled
    # up behind tiny scale steps) does not overflow: a NaN output is no silent error.
    if op == "reduce_precision":
        return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=3)
    if op == "fake_quant":
        return jnp.clip(x * 16, -127, 127).astype(jnp.int8).astype(x.dtype) / 16
    if op == "roundtrip":
        narrow = jnp.float8_e4m3fn if dt == jnp.bfloat16 else jnp.bfloat16
        return x.astype(narrow).astype(x.dtype)
    return x.astype(wide)  # widen


@jax.custom_vjp
def _half_softmax(s):
    """jax.nn.softmax whose backward is half the true one: a derivative rule of the user's
    that a rewrite must keep."""
    return jax.nn.softmax(s, axis=-1)


def _half_softmax_fwd(s):
    return _half_softmax(s), s


def _half_softmax_bwd(s, g):
    _, vjp = jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), s)
    return (vjp(g)[0] * 0.5,)


_half_softmax.defvjp(_half_softmax_fwd, _half_softmax_bwd)


def _half_gradient(fn):
    """`fn` under a custom_vjp whose backward is half of jax's: the rewrite may replace the
    forward inside it, never the rule."""
    @jax.custom_vjp
    def wrapped(*args):
        return fn(*args)

    def fwd(*args):
        return fn(*args), args

    def bwd(args, g):
        _, vjp = jax.vjp(fn, *args)
        return tuple(c * 0.5 if jnp.issubdtype(c.dtype, jnp.floating) else c
                     for c in vjp(g))

    wrapped.defvjp(fwd, bwd)
    return wrapped


def _band(window: tuple, p: Program):
    """bool [Lq, Lk] built from iotas: i - left <= j <= i + right."""
    i, j = jnp.arange(p.lq)[:, None], jnp.arange(p.lk)[None, :]
    left, right = window
    if left is not None and left == right:
        return jnp.abs(i - j) <= left
    m = jnp.ones((p.lq, p.lk), bool)
    if right is not None:
        m = m & (j <= i + right)
    if left is not None:
        m = m & (i - j <= left)
    return m


def _bias_shape(name: str, p: Program) -> tuple[int, ...] | None:
    """The shape of a bias argument; None for one computed from q or k."""
    return {"k": (p.lk,), "qk": (p.lq, p.lk), "b11k": (p.b, 1, 1, p.lk),
            "1hqk": (1, p.hq, p.lq, p.lk), "bhqk": (p.b, p.hq, p.lq, p.lk), "q1": (p.lq, 1),
            "h11": (p.hq, 1, 1)}.get(name)


def _after(steps: tuple[Step, ...], at: int) -> float:
    """The product of the scale steps after step `at` (a per-head scale counted as its first
    head's)."""
    c = 1.0
    for s in steps[at + 1:]:
        if s.kind == "scale":
            c = c / s.value if s.op == "div" else c * s.value
    return c


def _prescale(p: Program) -> tuple[float, float]:
    """The constants q and k are multiplied by before the dot."""
    root = 1.0 / math.sqrt(p.d)
    return {"": (1.0, 1.0), "q": (root, 1.0), "k": (1.0, root),
            "both": (math.sqrt(root), math.sqrt(root))}[p.prescale]


def build(p: Program, compute: str | None = None, logits: bool = False
          ) -> tuple[Any, tuple, tuple[int, ...]]:
    """(naive function, its arguments, the positions of the arguments to differentiate).

    compute: the dtype to compute in (default: the program's); constants keep the values
    they have in the program's dtype, and values the program rounds (a mixed-dtype operand,
    the value ops) are rounded as it rounds them.
    logits: the function returns the softmax's input [B, H, Lq, Lk (+1 with sinks)] instead
    of the output, outside any wrap (`_logit_rounding`)."""
    rng = np.random.default_rng(p.seed)
    dt = jnp.dtype(p.dtype)
    ct = jnp.dtype(compute or p.dtype)
    wide = jnp.dtype(compute or "float32")  # what "widen" casts to
    pre_q, pre_k = _prescale(p)
    total = _after(p.steps, -1) * pre_q * pre_k
    # |q·k| ~ sqrt(d)·r²: make the scores reach the softmax at about 3 after all scales.
    r = math.sqrt(3.0 / (math.sqrt(p.d) * max(abs(total), 1e-30)))
    q = rng.standard_normal((p.b, p.lq, p.hq, p.d)) * r
    k = rng.standard_normal((p.b, p.lk, p.hkv, p.d)) * r
    v = rng.standard_normal((p.b, p.lk, p.hkv, p.d))
    # Finite in the program's dtype, as a model's activations are: float16 data behind
    # 1e-10 of scales would be inf, and inf·0 in a dot is NaN or not by XLA's blocking.
    top = float(jnp.finfo(dt).max) / 8
    q, k = np.clip(q, -top, top), np.clip(k, -top, top)
    if p.nan_key:
        k[0, p.lk - 1] = np.nan  # a key the first key-padding mask hides (`_mask`)
    held = {"q_bf16": (jnp.bfloat16, dt, dt), "kv_bf16": (dt, jnp.bfloat16, jnp.bfloat16)}.get(
        p.mixed, (dt, dt, dt))
    args = [jnp.asarray(jnp.asarray(x, h), ct if compute else h) for x, h in zip((q, k, v), held)]
    extra, constants = [], {}
    for at, step in enumerate(p.steps):
        if step.kind in ("mask", "select_bias"):
            value = _mask(step, p, rng)
            if value is None:
                continue
            if step.constant:
                constants[at] = value
                continue
            extra.append(("mask", at, len(args)))
            args.append(jnp.asarray(value))
        elif step.kind == "bias" and _bias_shape(step.shape, p) is not None:
            bias = rng.standard_normal(_bias_shape(step.shape, p)) * 2.0 / abs(_after(p.steps, at))
            # finite in the program's dtype (float16 behind a 1e-6 scale would be inf)
            bias = np.clip(bias, -float(jnp.finfo(dt).max) / 8, float(jnp.finfo(dt).max) / 8)
            if step.extreme:
                bias = np.where(rng.random(bias.shape) < 0.2, _fill(step.extreme, dt), bias)
            extra.append(("bias", at, len(args)))
            args.append(jnp.asarray(jnp.asarray(bias, dt), ct))
        elif step.kind == "scale" and step.op == "traced":
            extra.append(("scale", at, len(args)))
            args.append(jnp.asarray(jnp.asarray(step.value, dt), ct))
    if p.head_mask == "data":
        extra.append(("head_mask", -1, len(args)))
        args.append(jnp.asarray(jnp.asarray(rng.random(p.hq) + 0.5, dt), ct))
    if p.sinks:
        extra.append(("sinks", -2, len(args)))
        args.append(jnp.asarray(jnp.asarray(rng.standard_normal(p.hq) * 2.0, dt), ct))
    if p.dropout:  # the key an argument, so that a scan over layers scans it (`over_layers`)
        extra.append(("key", -4, len(args)))
        args.append(jax.random.PRNGKey(p.seed))
    first_mask = next((i for kind, at, i in extra if kind == "mask"
                       and p.steps[at].mask in MASKS and not p.steps[at].int_mask
                       and not p.steps[at].mask.startswith("segments")
                       and p.steps[at].mask not in ("query_and_key_padding",
                                                    "positions_window")), None)
    repeated = next((at for at in reversed(range(len(p.steps)))
                     if p.steps[at].kind == "mask"), None)
    if p.post_mask in ("data", "mirrored") or (p.post_mask == "same" and first_mask is None) \
            or (p.post_mask == "repeat" and repeated is None):
        extra.append(("post_mask", -3, len(args)))
        args.append(jnp.asarray(rng.random((p.b, 1, p.lq, p.lk)) < 0.8))
    operand = {at: i for _, at, i in extra}
    if p.post_mask == "same" and first_mask is not None:
        operand[-3] = first_mask
    group = p.hq // p.hkv

    def attention(q, k, v, *ops):
        if p.operand_op:  # on the data at unit scale, then scaled back (dequantized)
            which, op = p.operand_op
            named = {"q": q, "k": k, "v": v}
            size = _rounded(r if which != "v" else 1.0, dt)
            unit = named[which] / size
            if compute:  # the quotient the op rounds, as the program's XLA divides (on CPU
                # not correctly rounded: 20% of float16 quotients differ by a step)
                held_as = held["qkv".index(which)]
                unit = (named[which].astype(held_as) / size).astype(ct)
            named[which] = _value_op(unit, op, wide, dt) * size
            q, k, v = named["q"], named["k"], named["v"]
        if pre_q != 1.0:
            q = q * _rounded(pre_q, dt)
        if pre_k != 1.0:
            k = k * _rounded(pre_k, dt)
        if group > 1:
            k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        if p.layout == "BLHD":
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        elif p.layout == "BHLD":
            s = q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)
        elif p.layout == "BLDH":  # heads last
            s = jnp.einsum("bqdh,bkdh->bhqk", q.transpose(0, 1, 3, 2), k.transpose(0, 1, 3, 2))
        elif p.layout == "LHD":  # no batch axis (B = 1)
            s = jnp.einsum("qhd,khd->hqk", q[0], k[0])[None]
        else:
            qm = q.transpose(0, 2, 1, 3).reshape(p.b * p.hq, p.lq, p.d)
            km = k.transpose(0, 2, 1, 3).reshape(p.b * p.hq, p.lk, p.d)
            s = jnp.einsum("nqd,nkd->nqk", qm, km).reshape(p.b, p.hq, p.lq, p.lk)
            q, k = qm, km  # a bias from q or k reads them folded, as ViTDet's does
        selected = None  # (predicate, mirrored) of the last mask step
        for at, step in enumerate(p.steps):
            if step.kind == "scale":
                if step.op == "traced":
                    s = s * ops[operand[at] - 3]
                elif step.op == "per_head":  # no softmax scale: a constant varying by head
                    per = np.asarray([step.value * (1 + 0.25 * h) for h in range(p.hq)])
                    s = s * jnp.asarray(per, dt).reshape(1, p.hq, 1, 1)
                else:
                    c = _rounded(step.value, dt)
                    s = s * c if step.op == "mul" else s / c
            elif step.kind == "op":
                s = _value_op(s, step.op, wide, dt)
            elif step.kind in ("mask", "select_bias"):
                m = jnp.asarray(constants[at]) if at in constants else (
                    ops[operand[at] - 3] if at in operand else None)
                if step.int_mask:
                    m = (m > 0) if step.kind == "select_bias" else (m == 1)
                if step.mask in TRICKY_MASKS:
                    m = _tricky_mask(step, p, m)
                elif step.mask == "causal_and_padding":
                    m = jnp.tril(jnp.ones((p.lq, p.lk), bool)) & m
                elif step.mask == "keras_merged":
                    m = _keras_merged(m, p)
                elif step.mask == "nnx_combined":
                    m = _nnx_combined(m, p)
                elif step.mask == "ones_and_padding":  # jax.nn.dot_product_attention's
                    m = jnp.logical_and(jnp.ones(s.shape, bool), m)
                elif step.mask == "transposed_and_causal":  # `x > 0` of a transposed cast
                    m = (jnp.swapaxes(jnp.swapaxes(m, -1, -2).astype(jnp.float32), -1, -2) > 0
                         ) & jnp.tril(jnp.ones((p.lq, p.lk), bool))
                elif step.mask == "band":
                    m = _band(step.window, p)
                elif step.mask == "band_and_padding":
                    m = _band(step.window, p) & m
                elif step.mask == "positions_window":
                    m = _positions_window(m, step.window[0], p)
                elif step.mask == "query_and_key_padding":  # flax's make_attention_mask(pad,
                    # pad) with its causal mask: an outer AND of the two paddings, then tril
                    m = (m[:, None, :p.lq, None] & m[:, None, None, p.lq:]
                         & jnp.tril(jnp.ones((p.lq, p.lk), bool)))
                elif step.mask.startswith("segments"):  # q ids == kv ids, per batch row
                    m = m[:, None, :p.lq, None] == m[:, None, None, p.lq:]
                    if step.mask == "segments_and_causal":
                        m = m & jnp.tril(jnp.ones((p.lq, p.lk), bool))
                fill = _fill(step.fill, dt)
                if step.kind == "select_bias":  # HF: s + select(m > 0, 0, finfo.min)
                    bias = (jnp.where(~m, fill, 0.0) if step.mirrored
                            else jnp.where(m, 0.0, fill))
                    s = s + bias.astype(s.dtype)
                else:
                    s = jnp.where(~m, fill, s) if step.mirrored else jnp.where(m, s, fill)
                    selected = (m, step.mirrored)
            elif step.kind == "bias":
                s = s + _bias_value(step, at, ops, q, k)
            elif step.kind == "softcap":
                c = _rounded(step.value, dt)
                s = jnp.tanh(s / c) * c
            else:
                tri = jnp.tril(jnp.ones((p.lq, p.lk), bool))
                s = s + jnp.where(tri, 0.0, _rounded(step.value, dt)).astype(s.dtype)
        if p.sinks:
            sink = jnp.broadcast_to(ops[operand[-2] - 3].reshape(1, p.hq, 1, 1),
                                    (p.b, p.hq, p.lq, 1))
            s = jnp.concatenate([s, sink.astype(s.dtype)], axis=-1)
        if p.shift:
            s = s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        if logits:
            return s
        if p.lookalike == "softmax_over_queries":
            w = jax.nn.softmax(s, axis=-2)
        elif p.lookalike == "softmax_where":
            w = jax.nn.softmax(s, axis=-1, where=jnp.ones(s.shape, bool).at[..., 0].set(False))
        elif p.lookalike == "multiplicative_mask":
            w = jax.nn.softmax(s * jnp.tril(jnp.ones(s.shape[-2:], s.dtype)), axis=-1)
        elif p.wrap == "custom_vjp_softmax":
            w = _half_softmax(s)
        elif p.softmax == "no_max":
            e = jnp.exp(s)
            w = e / jnp.sum(e, axis=-1, keepdims=True)
        elif p.softmax == "log_softmax":
            w = jnp.exp(jax.nn.log_softmax(s, axis=-1))
        elif p.manual_softmax:
            e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
            w = e / jnp.sum(e, axis=-1, keepdims=True)
        else:
            w = jax.nn.softmax(s, axis=-1)
        if p.sinks:
            w = w[..., :-1]
        if p.probs_op:
            w = _value_op(w, p.probs_op, wide, dt)
        if p.dropout:
            keep = jax.random.bernoulli(ops[operand[-4] - 3], 0.8, w.shape)
            w = w * (keep.astype(w.dtype) / jnp.asarray(0.8, w.dtype))
        if p.post_mask == "repeat" and selected is not None:
            m, mirrored = selected
            w = jnp.where(~m, 0.0, w) if mirrored else jnp.where(m, w, 0.0)
        elif p.post_mask:
            m = ops[operand[-3] - 3]
            w = jnp.where(~m, 0.0, w) if p.post_mask == "mirrored" else jnp.where(m, w, 0.0)
        if p.head_mask:
            m = ops[operand[-1] - 3] if p.head_mask == "data" else jnp.ones(p.hq, w.dtype)
            w = jnp.einsum("...hqk,h->...hqk", w, m)
        if p.lookalike == "scale_after_softmax":
            w = w * 2.0
        elif p.lookalike == "squared_softmax":
            w = w * w
        if p.layout == "merged":
            vm = v.transpose(0, 2, 1, 3).reshape(p.b * p.hq, p.lk, p.d)
            out = jnp.einsum("nqk,nkd->nqd", w.reshape(p.b * p.hq, p.lq, p.lk), vm)
            return out.reshape(p.b, p.hq, p.lq, p.d).transpose(0, 2, 1, 3)
        if p.layout == "BLDH":
            return jnp.einsum("bhqk,bkdh->bqdh", w, v.transpose(0, 1, 3, 2))
        if p.layout == "LHD":
            return jnp.einsum("hqk,khd->qhd", w[0], v[0])
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    def _bias_value(step: Step, at: int, ops, q, k):
        """A bias argument, or one computed from q ([B, H, Lq, 1]) or from k ([B, H, 1, Lk]),
        of about the size of the others."""
        if step.shape not in ("from_q", "from_k"):
            return ops[operand[at] - 3]
        size = 2.0 / abs(_after(p.steps, at)) / (r * math.sqrt(p.d) + 1e-30)
        # q [B, Lq, H, D], or [B·H, Lq, D] with the heads folded into the batch (k alike)
        x = q if step.shape == "from_q" else k
        sums = x.sum(-1).reshape(p.b, p.hq, -1) if x.ndim == 3 else jnp.swapaxes(
            x.sum(-1), 1, 2)
        return (sums[..., None] if step.shape == "from_q" else sums[:, :, None, :]) * _rounded(
            size, dt)

    diff = tuple([0, 1, 2] + [i for kind, _, i in extra
                              if kind in ("bias", "head_mask", "sinks")])
    if p.wrap == "blocks" and not logits:  # one sequence, cut into the batch's B blocks
        args[:3] = [x.reshape(1, p.b * x.shape[1], *x.shape[2:]) for x in args[:3]]
    return attention if logits else _wrapped(p, attention), tuple(args), diff


def _wrapped(p: Program, attention):
    """The program's attention where `p.wrap` puts it."""
    def zeros(args):
        """Zeros of the attention's output, computed from q: in a shard_map body they then
        vary over its axes as the attention's output does."""
        shape = jax.eval_shape(attention, *args)
        return jnp.zeros(shape.shape, shape.dtype) * jnp.sum(args[0]).astype(shape.dtype)

    if p.wrap == "cond":  # the other branch: zeros (the predicate is True at run time)
        def under_cond(*args):
            return jax.lax.cond(jnp.sum(args[0]) == jnp.sum(args[0]),
                                lambda xs: attention(*xs), zeros, args)
        return under_cond
    if p.wrap == "fori":
        def in_loop(*args):
            return jax.lax.fori_loop(0, 2, lambda i, acc: acc + attention(*args) * 0.5,
                                     zeros(args))
        return in_loop
    if p.wrap == "vmap_heads":  # one head at a time: `programs` keeps H out of the rest
        def per_head(q, k, v, *ops):
            def one(qh, kh, vh):
                out = attention(qh[:, :, None], kh[:, :, None], vh[:, :, None], *ops)
                return out[:, :, 0]
            return jax.vmap(one, in_axes=(2, 2, 2), out_axes=2)(q, k, v)
        return per_head
    if p.wrap == "custom_vjp":
        return _half_gradient(attention)
    if p.wrap == "blocks":  # blocked local attention (LongT5): the blocks are the batch
        def in_blocks(q, k, v, *ops):
            q, k, v = (x.reshape(p.b, x.shape[1] // p.b, *x.shape[2:]) for x in (q, k, v))
            out = attention(q, k, v, *ops)
            return out.reshape(1, p.b * out.shape[1], *out.shape[2:])
        return in_blocks
    return attention


# ----------------------------------------------------------------------------------------
# The strategy


@st.composite
def programs(draw, masks: tuple[str, ...] = ()) -> Program:
    """A program; `masks`: the mask kinds its mask steps draw from (default: all)."""
    dtype = draw(st.sampled_from(("float32", "float32", "bfloat16", "float16")))
    hq = draw(st.sampled_from((1, 2, 4)))
    hkv = draw(st.sampled_from([h for h in (1, 2, 4) if hq % h == 0]))
    kernel_blocks = draw(st.sampled_from((False,) * 9 + (True,)))
    if kernel_blocks:  # the kernel's own tiles: lengths around and past them, ragged
        lq = draw(st.sampled_from((1, 7, 129, 1000)))
        lk = draw(st.sampled_from((2, 129, 1000)))
    else:
        lq = draw(st.sampled_from((1, 5, 16, 33) * 2 + (2, 129)))
        lk = draw(st.sampled_from((1, 7, 16, 40) * 2 + (2, 129)))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(("scale", "scale", "mask", "mask", "bias", "causal_bias",
                                     "softcap", "select_bias") * 2 + ("op",)))
        if masks and not steps:
            kind = "mask"  # a program of the masks asked for has one
        if kind == "softcap":
            steps.append(Step("softcap", value=draw(st.sampled_from((1.0, 5.0, 30.0)))))
        elif kind == "scale":
            steps.append(Step("scale", op=draw(st.sampled_from(
                ("mul", "div") * 4 + ("traced", "per_head"))),
                value=10.0 ** draw(st.sampled_from((-6, -4, -3, -1, 0, 1, 3)))
                * draw(st.sampled_from((1.0, 0.5, 0.125)))))
        elif kind == "op":
            steps.append(Step("op", op=draw(st.sampled_from(
                tuple(o for o in VALUE_OPS if o != "fake_quant")))))
        elif kind in ("mask", "select_bias"):
            mask = draw(st.sampled_from(masks or MASKS * 3 + TRICKY_MASKS))
            if mask.startswith("causal") and lq > lk and mask == "causal_bottom_right":
                mask = "causal"
            if mask == "positions_window":  # queries and keys: one sequence, of two or more
                lq = lk = max(lk, 2)
            window, padding = (), ""
            if mask == "positions_window":
                window = (draw(st.sampled_from((1, 3, 8, 200))),)
                padding = draw(st.sampled_from(("left", "right", "none")))
            if mask.startswith("band"):
                left = draw(st.sampled_from((None, 0, 2, 5)))
                right = draw(st.sampled_from((None, -1, 0, 2, 5)))
                if left is not None and right is not None and left + right < 0:
                    right = None
                window = (left, right)
            steps.append(Step(kind, mask=mask, fill=draw(st.sampled_from(FILLS)),
                              mirrored=draw(st.booleans()), window=window, padding=padding,
                              empty_row=draw(st.booleans()) and mask in (
                                  "boolean", "key_padding", "causal_and_padding", "lengths"),
                              constant=draw(st.booleans()) and mask not in TRICKY_MASKS,
                              int_mask=draw(st.sampled_from((False,) * 4 + (True,))) and mask in (
                                  "boolean", "key_padding", "causal_and_padding"),
                              offset=draw(st.sampled_from((-1, 1)))))
        elif kind == "bias":
            steps.append(Step("bias", shape=draw(st.sampled_from(BIAS_SHAPES)),
                              extreme=draw(st.sampled_from(("", "", "-inf", "finfo.min")))))
        else:
            steps.append(Step("causal_bias", value=draw(st.sampled_from(
                (-math.inf, -1e9, -1e4)))))
    layout = draw(st.sampled_from(("BLHD", "BHLD", "merged") * 3 + ("BLDH", "LHD")))
    b = 1 if layout == "LHD" else draw(st.sampled_from((1, 2)))
    padded = any(s.mask in ("key_padding", "lengths") and not s.constant for s in steps)
    program = Program(
        dtype=dtype, layout=layout, b=b, hq=hq, hkv=hkv, lq=lq, lk=lk,
        d=draw(st.sampled_from((8, 16) * 8 + (1, 3, 80, 256))), steps=tuple(steps),
        manual_softmax=draw(st.booleans()),
        lookalike=draw(st.sampled_from(("",) * 8 + LOOKALIKES)),
        head_mask=draw(st.sampled_from(("",) * 6 + ("ones", "data"))),
        post_mask=draw(st.sampled_from(("",) * 5 + ("same", "data", "mirrored", "repeat"))),
        sinks=draw(st.sampled_from((False,) * 3 + (True,))),
        shift=draw(st.sampled_from((False,) * 3 + (True,))),
        dropout=draw(st.sampled_from((False,) * 4 + (True,))),
        seed=draw(st.integers(0, 2**16)),
        mixed=_rarely(draw, ("q_bf16", "kv_bf16"), 8) if dtype == "float32" else "",
        operand_op=_rarely(draw, tuple((w, o) for w in "qkv" for o in VALUE_OPS), 8, ()),
        probs_op=_rarely(draw, VALUE_OPS, 12),
        softmax=_rarely(draw, ("no_max", "log_softmax"), 10),
        prescale=_rarely(draw, ("q", "k", "both"), 6),
        wrap=_rarely(draw, WRAPS, 10),
        nan_key=padded and lk >= 2 and draw(st.sampled_from((False,) * 3 + (True,))),
        kernel_blocks=kernel_blocks,
        # auto keeps short sequences native on the CPU: it is drawn where it may rewrite
        kernel=draw(st.sampled_from(("chunked", "auto"))) if kernel_blocks else "chunked",
    )
    return _compatible(program)


def _rarely(draw, options: tuple, one_in: int, none: Any = ""):
    """One of `options` once in `one_in` draws, else `none`: the grammar's newer features
    each stay rare, so most programs keep few of them and many still rewrite."""
    if draw(st.integers(1, one_in)) != one_in:  # hypothesis's simplest draw leaves it out
        return none
    return draw(st.sampled_from(options))


def _compatible(p: Program) -> Program:
    """`p` without the wraps its other features rule out: vmap over heads runs the program
    one head at a time (nothing may refer to H), a custom_vjp cannot take a PRNG key, blocks
    need a batch of several to cut the sequence into."""
    if p.wrap == "vmap_heads" and (
            p.hq != p.hkv or p.layout not in ("BLHD", "BHLD") or p.sinks or p.head_mask
            or any(s.shape in ("1hqk", "bhqk", "h11") or s.op == "per_head"
                   for s in p.steps)):
        return dataclasses.replace(p, wrap="")
    if p.wrap in ("custom_vjp", "custom_vjp_softmax") and p.dropout:
        return dataclasses.replace(p, wrap="")
    if p.wrap == "blocks" and (p.b == 1 or p.layout == "LHD"):
        return dataclasses.replace(p, wrap="")
    return p


# ----------------------------------------------------------------------------------------
# The check


def _error(got: np.ndarray, want: np.ndarray, terms: float,
           overflowed: np.ndarray | None = None) -> float:
    """max |got - want| over max(max |want|, terms), on positions where the naive value is
    finite; inf where the kernel is non-finite and the naive program is not.

    overflowed: where `want` is the exact value, the positions at which the naive program
    itself is non-finite in its dtype. A non-finite kernel value there is the naive program's
    own result, kept (a train step's native backward under jax.checkpoint overflows as the
    naive program does); a finite one must still be close to the exact value."""
    fine = np.isfinite(want)
    if overflowed is not None:
        fine &= ~(overflowed & ~np.isfinite(got))
    if np.any(~np.isfinite(got) & fine):
        return math.inf
    if not np.any(fine):
        return 0.0
    scale = max(float(np.max(np.abs(want[fine]))), terms, 1e-30)
    return float(np.max(np.abs(got[fine] - want[fine])) / scale)


def value_and_grads(fn, diff):
    """A function of the program's arguments returning its output and the gradients of a
    fixed random projection of it w.r.t. the `diff` arguments: one program, one compile."""
    def both(*args):
        def loss(*xs):
            full = list(args)
            for i, x in zip(diff, xs):
                full[i] = x
            out = fn(*full)
            weights = jax.random.normal(jax.random.PRNGKey(1), out.shape, jnp.float32)
            return jnp.sum(out.astype(jnp.float32) * weights), out
        grads, out = jax.grad(loss, argnums=tuple(range(len(diff))), has_aux=True)(
            *[args[i] for i in diff])
        return out, grads
    return both


def data_parallel(step, args):
    """`step` as a data-parallel train step on a one-device mesh: every array argument split
    over the "data" axis along its leading dimension, the results averaged over it (exact on
    one device), so inside the shard_map every value varies over "data" as on a real mesh."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = tuple(P("data") if np.ndim(a) else P() for a in args)

    def per_device(*xs):
        return jax.lax.pmean(step(*xs), "data")

    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P())


RING_DEVICES = 3  # divides no generated batch or head count: the mesh axis is left over
RING_LENGTH = 48  # L/3 = 16: a multiple of 8, the ring's least block


def on_a_ring(p: Program) -> Program:
    """`p` at the length a sequence split 3 ways runs as ring attention: Lq = Lk = 48 (its
    masks, biases and data are drawn for the program's own lengths)."""
    return dataclasses.replace(p, lq=RING_LENGTH, lk=RING_LENGTH)


def ring_mesh():
    """The mesh `check(ring=True)` splits kernel calls over: 3 host devices on one axis,
    which neither the batch nor the heads take, so the sequence goes round a ring. Needs
    `--xla_force_host_platform_device_count=3` (or more) set before jax starts."""
    if len(jax.devices()) < RING_DEVICES:
        raise RuntimeError(f"the ring mode needs {RING_DEVICES} devices; set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={RING_DEVICES}")
    return jax.make_mesh((RING_DEVICES,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:RING_DEVICES])


def over_layers(fn):
    """`fn` as the body of a two-step `lax.scan` without jax.checkpoint, as a scan over
    layers: its gradient is a forward loop that saves residuals and a backward loop that
    reads them. The second step reads q, k and v reversed along the sequence, and another
    dropout key, so a recompute that read the other step's inputs would differ; the output
    is the steps' mean."""
    def other(i, a):
        if i < 3:
            return jnp.flip(a, 1)
        return a + 1 if a.dtype == jnp.uint32 else a

    def scanned(*args):
        xs = [jnp.stack([a, other(i, a)]) for i, a in enumerate(args)]
        _, ys = jax.lax.scan(lambda carry, x: (carry, fn(*x)), None, xs)
        return ((ys[0] + ys[1]) / 2).astype(ys.dtype)
    return scanned


def _arrays(out_and_grads) -> list[np.ndarray]:
    out, grads = out_and_grads
    return [np.asarray(x, np.float64) for x in (out, *grads)]


def _terms(p: Program, args, count: int) -> list[float]:
    """The magnitude of the terms each checked value sums (see the module docstring)."""
    big = [float(np.max(np.abs(x[np.isfinite(x)]), initial=0.0))  # a NaN key: its peers'
           for x in (np.asarray(a, np.float64) for a in args[:3])]
    q, k, v = big
    c = abs(_after(p.steps, -1))
    do = 3.0  # the projection's weights are standard normal
    # A bias added before scale steps has their product in its gradient, as q and k have C.
    # One computed from q or k is no argument: it has no gradient of its own to check.
    biases = [do * v * abs(_after(p.steps, at)) for at, step in enumerate(p.steps)
              if step.kind == "bias" and step.shape not in ("from_q", "from_k")]
    head_mask = [do * v] if p.head_mask == "data" else []
    sinks = [do * v] if p.sinks else []
    terms = [v, do * v * c * k, do * v * c * q, do] + biases + head_mask + sinks
    return terms[:count]


def _rounded_gradient(p: Program) -> tuple[int, float] | None:
    """(index of the checked value, its relative step) of the gradient jax rounds to a narrow
    type: an operand's through `reduce_precision` (linear: its cotangent is rounded too) or a
    round trip through a narrow dtype (a cast's transpose casts). A sum taken in any other
    order may round one step away, so one step of its largest value is its tolerance: 2^-3
    in fp8 (3 mantissa bits), 2^-7 in bfloat16."""
    if not p.operand_op or p.operand_op[1] not in ("reduce_precision", "roundtrip"):
        return None
    which, op = p.operand_op
    step = 2.0 ** -3 if op == "reduce_precision" or p.dtype == "bfloat16" else 2.0 ** -7
    return 1 + "qkv".index(which), step


def _logit_rounding(p: Program) -> float:
    """The largest, over rows, of Σ_j w_j · u(s_j): the softmax weights w of the exact
    program times half a float32 step at each of its logits s_j.

    Kernels compute logits in float32, and a logit at magnitude M is known there to half a
    step at M, whatever order sums it: s + b - 1e4 to 4.9e-4, and a row whose every
    visible key a -inf bias hides is left with just such logits. Moving each logit by δ_j
    moves the output row by Σ_j w_j δ_j (v_j - out), at most 2·max|v|·Σ_j w_j |δ_j|; so a
    rewrite that rounds each logit up to twice (the kernel adds the program's biases
    summed, the program one by one) is within 4× this of the exact value, in units of the
    values' terms. Rows at |logit| ≲ 8 make it 5e-7, below every dtype's tolerance: it
    bounds only rows the program computes at large logits. 0 where the bare attention
    cannot be computed apart from its wrap."""
    try:
        with _x64():
            fn, args, _ = build(p, compute="float64", logits=True)
            s = np.asarray(jax.jit(fn)(*args), np.float64)
    except Exception:
        return 0.0
    finite = np.isfinite(s)
    top = np.max(np.where(finite, s, -np.inf), axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(finite, np.exp(s - top), 0.0)
        w = w / np.sum(w, axis=-1, keepdims=True)
    size = np.maximum(np.abs(np.where(finite, s, 0.0)), float(np.finfo(np.float32).tiny))
    step = 2.0 ** (np.floor(np.log2(size)) - np.finfo(np.float32).nmant) / 2
    rows = np.sum(np.where(finite, w * step, 0.0), axis=-1)
    return float(np.max(rows[np.isfinite(rows)], initial=0.0))


def _worst(got, want, terms, overflowed=None) -> tuple[float, int]:
    overflowed = overflowed or [None] * len(got)
    return max((_error(g, w, t, o), i)
               for i, (g, w, t, o) in enumerate(zip(got, want, terms, overflowed)))


NAMES = ("out", "dq", "dk", "dv")


def _x64():
    """float64 enabled for a block (jax.enable_x64 on newer jax, experimental before)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64

    return enable_x64()


def _compiled(fn, args, options):
    return jax.jit(fn).trace(*args).lower().compile(compiler_options=options)(*args)


# XLA's optimization level 0 compiles the chunked kernel's loops about twice as fast; both
# sides of a comparison are compiled alike. CI uses it; the fuzz benchmark does not.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


_LAST_REPORT: list = [None]


def last_report():
    """The rewrite report of the last program `check` rewrote (or left native)."""
    return _LAST_REPORT[0]


def check(p: Program, blocks: tuple[int, int] = (8, 8),
          compiler_options: dict | None = None, train: bool = False,
          checkpoint: bool = False, sharded: bool = False, layers: bool = False,
          ring: bool = False) -> tuple[str, str]:
    """("native" | "rewritten" | "overflowed" | "wrong", detail) for one program (see the
    module docstring; "overflowed": the naive output itself is not finite where the float64
    program's is, so there is nothing to keep).

    train: rewrite the program with its gradient inside (a train step: `flash_jit` of
    `value_and_grads(fn)`), not `value_and_grads` of the rewritten program.
    checkpoint: the program under `jax.checkpoint` (its backward recomputes it); a rewrite
    that replaced the recompute too has the detail "recomputed".
    sharded: the train step inside a shard_map (`data_parallel`), compared with the plain
    program's.
    layers: the program as the body of a scan over layers (`over_layers`); a rewrite that
    recomputed it in the backward loop has the detail "recomputed".
    ring: kernel calls split over `ring_mesh()`: where the ring takes the call (`on_a_ring`
    gives the lengths it splits), its sequence goes round the 3 devices."""
    fn, args, diff = build(p)
    if checkpoint:
        fn = jax.checkpoint(fn)
    if layers:
        fn = over_layers(fn)
    kernel = get("chunked")
    saved = (kernel.block_q, kernel.block_k)
    if not p.kernel_blocks:
        kernel.block_q, kernel.block_k = blocks
    try:
        if train:
            step = value_and_grads(fn, diff)
            rewritten = Rewritten(data_parallel(step, args) if sharded else step, p.kernel)
            traced = jax.jit(rewritten).trace(*args)
        else:
            # flash_jit(fn, kernel=p.kernel) is its jit
            rewritten = Rewritten(fn, p.kernel, mesh=ring_mesh() if ring else None)
            traced = jax.jit(value_and_grads(rewritten, diff)).trace(*args)
        report = rewritten.report
        _LAST_REPORT[0] = report
        for site in report.sites:
            if not site.rewritten and not site.reason:
                return "wrong", "a site stays native without a reason"
        if report.rewritten == 0:
            return "native", "; ".join(s.reason for s in report.sites) or "no site"
        got = _arrays(traced.lower().compile(compiler_options=compiler_options)(*args))
        want = _arrays(_compiled(value_and_grads(fn, diff), args, compiler_options))
    finally:
        kernel.block_q, kernel.block_k = saved
    tol = TOLERANCE[p.dtype]
    terms = _terms(p, args, len(want))
    if (rounded := _rounded_gradient(p)) is not None:
        at, step = rounded
        top = float(np.max(np.abs(want[at][np.isfinite(want[at])]), initial=0.0))
        terms[at] = max(terms[at], top) * step / tol
    err, at = _worst(got, want, terms)
    if err > tol:
        with _x64():
            precise_fn, precise_args, _ = build(p, compute="float64")
            if layers:
                precise_fn = over_layers(precise_fn)
            precise = _arrays(_compiled(value_and_grads(precise_fn, diff), precise_args,
                                        compiler_options))
        # Rounded to the program's dtype: a value beyond its range is inf there, as the
        # rewrite then rightly returns.
        with np.errstate(over="ignore"):
            precise = [np.asarray(jnp.asarray(x, p.dtype), np.float64) for x in precise]
        overflowed = [~np.isfinite(w) for w in want]
        if np.any(overflowed[0] & np.isfinite(precise[0])):
            # The naive program's own output is NaN or inf where the exact one is finite
            # (float16 data behind a 1e-6 scale overflows the dot): its result is already
            # lost, loudly, and no rewrite can be judged against it.
            return "overflowed", "the naive output is not finite where the exact one is"
        naive_err, _ = _worst(want, precise, terms, overflowed)
        err, at = _worst(got, precise, terms, overflowed)
        if math.isfinite(naive_err):
            tol = max(tol, 2 * naive_err)
        tol = max(tol, 4 * _logit_rounding(p))
    if err > tol:
        name = NAMES[at] if at < len(NAMES) else f"dbias{at - len(NAMES)}"
        return "wrong", f"{name} differs by {err:.3g} (tolerance {tol:.3g})"
    recomputed = any("recomputes it in the kernel" in s.reason
                     or "recomputed in the backward loop" in s.reason for s in report.sites)
    return "rewritten", "recomputed" if recomputed else ""
