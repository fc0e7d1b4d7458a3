"""What a site's logits chain computes, in the kernel's terms — or why it has none.

The chain between Q·Kᵀ and the softmax is a sequence of steps (`attention.LogitStep`): scale
by a constant, add a bias, mask with `where(mask, x, fill)`, cast, and at most one tanh
(soft-capping, `tanh(x / c) * c`). Whatever their order, the softmax input is

    logits = where(visible, cap(C · scores) + B, F)

with C the product of the scale steps, cap the identity or, after a tanh, c·tanh(x / c) with
c the product of the scale steps after it (only its size matters: tanh is odd), B each bias
times the scale steps after it, `visible`
the AND of the masks, and F the logit of a hidden key: the mask's fill carried through every
step after the mask, in the dtypes the program computes them in. That last part is why a fill
is not simply "a mask": `where(m, s, -1e4) * 1e-4` gives hidden keys logit -1, which is no
mask at all, and -1e9 in float16 is -inf. `replay` replays the steps, so F is what the program
computes; kernels then implement F exactly (`hlotool.kernels.base`).

Where the chain has no such form, `replay` says why, and the site stays native:
  - a bias added after a mask whose hidden keys keep a finite logit (F would differ per key);
  - masks whose hidden keys end with different logits;
  - a hidden logit that ends +inf or NaN (a negative scale after a -inf fill);
  - a bias before the tanh (the kernel caps the scores alone), or a second tanh.
A mask before the tanh is replayed through it: its hidden keys end with the finite logit
c·tanh(fill·…), a soft mask the kernels implement exactly.
An additive causal constant (0 on and below the diagonal, very negative above; or 0 inside any
band, a sliding window) hides keys only when its value ends -inf; otherwise C·s + b still
depends on the scores there, so it is kept as what it is, an additive bias.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from hlotool.passes.attention import LogitStep, MaskTerm

# Mask terms read from their structure, applied as a select or as an additive constant.
STRUCTURAL = ("causal", "window")


@dataclasses.dataclass(frozen=True)
class Logits:
    """A logits chain in kernel terms.

    scale: C, the product of the chain's scale steps (pre-scaling of q and k excluded).
    biases: (term, multiplier): the kernel's bias is the sum of multiplier · operand.
    masks: the select terms hiding keys, in program order (boolean operands, causal selects)
    and additive causal constants that end -inf.
    causal: some term hides the keys above the diagonal.
    window: (left, right) of the band the "window" terms leave visible (their intersection;
    None for an unbounded side), or None without one.
    fill: F, the logit of a hidden key; -inf when there is no mask.
    softcap: c of the soft-cap c·tanh(x / c) (positive), or None without a tanh.
    refusal: why the chain has no kernel form (then the rest is meaningless), or None.
    """

    scale: float
    biases: tuple[tuple[MaskTerm, float], ...]
    masks: tuple[MaskTerm, ...]
    causal: bool
    fill: float
    softcap: float | None = None
    window: tuple[int | None, int | None] | None = None
    # For masks read from an additive select(m, 0, F) (`MaskTerm.rounds_to_fill`): (F as the
    # program adds it, that add's dtype, the chain's scale before it); the reading is exact
    # when C·|q·k| stays below half F's ulp (C: that scale times q's and k's pre-scaling).
    checks: tuple[tuple[float, str, float], ...] = ()
    exact: Logits | None = None  # the chain as the program writes it, without the readings
    # a run-time check guards (`checks`, `positions`), or why it has no kernel form; None
    # when there are no checks
    refusal: str | None = None
    # A mask's band is read from positions the program computes at run time, as if each
    # were its index (`MaskTerm.from_positions`): exact where the program's mask equals the
    # reading, which `lower` checks per call.
    positions: bool = False


def _np_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        import ml_dtypes  # installed with jax

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _in(dtype: str, x: float) -> float:
    """`x` as the program holds it in `dtype` (overflow to ±inf included)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.asarray(x, np.float64).astype(_np_dtype(dtype)))


def _apply(dtype: str, op: str, x: float, c: float) -> float:
    """One scale step on a scalar, computed in `dtype` as XLA does (operands rounded first)."""
    a, b = _in(dtype, x), _in(dtype, c)
    with np.errstate(all="ignore"):
        y = np.float64(a) * np.float64(b) if op == "mul" else np.float64(a) / np.float64(b)
    return _in(dtype, float(y))


def half_ulp(x: float, dtype: str) -> float:
    """Half the spacing of `dtype`'s values just below |x| (a normal number; the binade under
    it when |x| is a power of two): any y smaller in size leaves x + y = x under
    round-to-nearest."""
    import ml_dtypes  # installed with jax; numpy's finfo does not know bfloat16

    mantissa = ml_dtypes.finfo(_np_dtype(dtype)).nmant
    return 2.0 ** (math.floor(math.log2(abs(x))) - 1 - mantissa) / 2


def _fmt(x: float) -> str:
    return f"{x:g}"


def replay(steps: Sequence[LogitStep]) -> Logits:
    """Replay the chain's steps in program order; see the module docstring."""
    scale = 1.0
    cap = None  # the product of the scale steps after the tanh
    biases: list[list] = []  # [term, multiplier, replayed value of an additive causal]
    hides: list[list] = []  # [term, replayed fill]
    checks: set[tuple[float, str, float]] = set()
    positions = False
    lost = None  # (a finite fill, how a scale step lost it)
    for step in steps:
        if step.kind == "softcap":
            if cap is not None:
                return _refused("two tanh soft-caps on the logits")
            if biases:
                return _refused("a bias is added before the tanh soft-cap: kernels cap the "
                                "scaled scores, then add the bias")
            cap = 1.0
            for entry in hides:
                entry[1] = _in(step.dtype, math.tanh(entry[1]))
        elif step.kind == "scale":
            c = float(step.value)
            if lost is not None:
                # XLA folds consecutive constant scalings ((x / c) * c' → x * (c' / c)), so
                # whether the fill overflowed is the compiler's choice, not the program's.
                return _refused(f"the fill {_fmt(lost[0])} {lost[1]} at a scale step that "
                                "another follows; XLA may fold the two and keep it, so the "
                                "logit of a hidden key is the compiler's choice")
            scale = scale * c if step.op == "mul" else scale / c
            if cap is not None:
                cap = cap * c if step.op == "mul" else cap / c
            for entry in hides:
                before, entry[1] = entry[1], _apply(step.dtype, step.op, entry[1], c)
                if math.isfinite(before) and before != 0 and (
                        not math.isfinite(entry[1]) or entry[1] == 0):
                    lost = (before, "overflows" if entry[1] else "underflows to 0")
            for entry in biases:
                entry[1] = entry[1] * c if step.op == "mul" else entry[1] / c
                if entry[2] is not None:
                    entry[2] = _apply(step.dtype, step.op, entry[2], c)
        elif step.kind == "cast":
            for entry in hides:
                entry[1] = _in(step.dtype, entry[1])
            for entry in biases:
                if entry[2] is not None:
                    entry[2] = _in(step.dtype, entry[2])
        elif step.kind == "mask":
            hides.append([step.term, _in(step.dtype, step.term.fill)])
            positions = positions or step.term.from_positions
            if step.term.rounds_to_fill and math.isfinite(step.term.fill):
                # s + -inf is -inf for any finite s: only a finite F needs the check.
                checks.add((_in(step.dtype, step.term.fill), step.dtype, scale))
        elif step.kind == "bias":
            soft = [entry[1] for entry in hides if math.isfinite(entry[1])]
            if soft:
                return _refused(f"a bias is added after a mask whose hidden keys keep the "
                                f"finite logit {_fmt(soft[0])}: their logits would differ per key")
            term = step.term
            causal_value = None
            if term.kind in STRUCTURAL:
                causal_value = _in(step.dtype, term.fill)
            biases.append([term, term.sign, causal_value])
    kept = []
    for term, multiplier, causal_value in biases:
        if causal_value is not None and causal_value == -math.inf:
            hides.append([term, -math.inf])
        else:
            kept.append((dataclasses.replace(term, kind="additive", window=None)
                         if term.kind in STRUCTURAL else term, multiplier))
    fills = {entry[1] for entry in hides}
    bad = [f for f in fills if math.isnan(f) or f == math.inf]
    if bad:
        return _refused(f"hidden keys end with logit {_fmt(bad[0])} after the scale steps "
                        "that follow the mask: every row would be NaN")
    if len(fills) > 1:
        values = ", ".join(_fmt(f) for f in sorted(fills))
        return _refused(f"the masks leave hidden keys different logits ({values}) after the "
                        "steps that follow them")
    if not math.isfinite(scale):
        return _refused(f"the scores are scaled by {_fmt(scale)}")
    if cap is not None and not (math.isfinite(cap) and cap != 0):
        return _refused(f"the tanh soft-cap is scaled by {_fmt(cap)}")
    window = _intersection([t.window for t, _ in hides if t.kind == "window"]
                           + [(None, 0)] * any(t.kind == "causal" for t, _ in hides))
    causal = window == (None, 0) or (window is not None and window[1] == 0)
    return Logits(scale=scale, biases=tuple(kept), masks=tuple(t for t, _ in hides),
                  causal=causal,
                  fill=fills.pop() if fills else -math.inf,
                  softcap=None if cap is None else abs(cap),
                  window=None if window == (None, 0) else window,
                  checks=tuple(sorted(checks)), positions=positions)


def _intersection(windows: list[tuple[int | None, int | None]]
                  ) -> tuple[int | None, int | None] | None:
    """The band every window leaves visible; None when there is none, or it is unbounded."""
    if not windows:
        return None
    sides = [min((w[s] for w in windows if w[s] is not None), default=None) for s in (0, 1)]
    return None if sides == [None, None] else (sides[0], sides[1])


def _refused(reason: str) -> Logits:
    return Logits(scale=math.nan, biases=(), masks=(), causal=False, fill=math.nan,
                  refusal=reason)
