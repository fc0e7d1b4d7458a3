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
An additive causal constant (0 on and below the diagonal, very negative above) hides keys only
when its value ends -inf; otherwise C·s + b still depends on the scores there, so it is kept as
what it is, an additive bias.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from hlotool.passes.attention import LogitStep, MaskTerm


@dataclasses.dataclass(frozen=True)
class Logits:
    """A logits chain in kernel terms.

    scale: C, the product of the chain's scale steps (pre-scaling of q and k excluded).
    biases: (term, multiplier): the kernel's bias is the sum of multiplier · operand.
    masks: the select terms hiding keys, in program order (boolean operands, causal selects)
    and additive causal constants that end -inf.
    causal: some term hides the keys above the diagonal.
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
    refusal: str | None = None


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


def _fmt(x: float) -> str:
    return f"{x:g}"


def replay(steps: Sequence[LogitStep]) -> Logits:
    """Replay the chain's steps in program order; see the module docstring."""
    scale = 1.0
    cap = None  # the product of the scale steps after the tanh
    biases: list[list] = []  # [term, multiplier, replayed value of an additive causal]
    hides: list[list] = []  # [term, replayed fill]
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
            scale = scale * c if step.op == "mul" else scale / c
            if cap is not None:
                cap = cap * c if step.op == "mul" else cap / c
            for entry in hides:
                entry[1] = _apply(step.dtype, step.op, entry[1], c)
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
        elif step.kind == "bias":
            soft = [entry[1] for entry in hides if math.isfinite(entry[1])]
            if soft:
                return _refused(f"a bias is added after a mask whose hidden keys keep the "
                                f"finite logit {_fmt(soft[0])}: their logits would differ per key")
            term = step.term
            causal_value = None
            if term.kind == "causal":
                causal_value = _in(step.dtype, term.fill)
            biases.append([term, term.sign, causal_value])
    kept = []
    for term, multiplier, causal_value in biases:
        if causal_value is not None and causal_value == -math.inf:
            hides.append([term, -math.inf])
        else:
            kept.append((dataclasses.replace(term, kind="additive") if term.kind == "causal"
                         else term, multiplier))
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
    return Logits(scale=scale, biases=tuple(kept), masks=tuple(t for t, _ in hides),
                  causal=any(t.kind == "causal" for t, _ in hides),
                  fill=fills.pop() if fills else -math.inf,
                  softcap=None if cap is None else abs(cap))


def _refused(reason: str) -> Logits:
    return Logits(scale=math.nan, biases=(), masks=(), causal=False, fill=math.nan,
                  refusal=reason)
