"""Which nodes of a matched site a kernel call reproduces: a whitelist, not a blacklist.

A rewrite drops every node between the site's inputs (q, k, v where `attention._trace`
stopped, the mask and bias operands) and its output, and computes the output with a kernel
call instead. That is only sound when each dropped node's effect is one the call has:

  - the ops the pattern gives a role (the two dots, the scale, mask, bias, soft-cap and sink
    steps, the softmax, the factors after it), whose meaning `attention.describe` checked;
  - ops that only move data (broadcast, reshape, transpose, copy);
  - casts that keep every value, or that round to a float dtype holding the kernel's own
    compute dtype (a bfloat16 program's softmax computed in float32 and cast back).

Anything else (`stop_gradient` on the scores or the probabilities, `reduce_precision`, a
cast to an integer or to a float narrower than the kernel computes in, any op a future jax
adds) keeps the site native, naming the op. The one place other ops are harmless is the
value the logits are shifted by before `exp` (`x - stop_gradient(max(x))`): softmax does not
depend on it, so what computes it (casts, a stop_gradient) does not matter.
"""

from __future__ import annotations

from hlotool.passes.graph import Node, covers, fold

# Ops `attention.describe` gives a role and checks along the axes.
ROLES = frozenset({"dot_general", "mul", "div", "add", "sub", "select", "exp", "tanh",
                   "reduce_sum", "reduce_max", "max", "concatenate", "slice"})
# Ops that move values without changing them, and values that enter from outside.
MOVES = frozenset({"broadcast", "reshape", "transpose", "copy", "constant", "iota",
                   "parameter"})
FLOATS = ("float16", "bfloat16", "float32", "float64")

_WHERE = {"stop_gradient": "lax.stop_gradient (its derivative is zero; the kernel's is not)",
          "reduce_precision": "lax.reduce_precision (a rounding no kernel applies)"}


def refusal(out: Node, stops: set[int], shifts: set[int], compute: str) -> str | None:
    """Why the nodes computing `out` from `stops` are not all reproduced by a kernel call
    computing in `compute`, or None. `shifts`: the `x - shift` nodes whose second operand
    only shifts the softmax (not followed)."""
    if compute not in FLOATS:
        return f"q·kᵀ is computed in {compute}: the kernels compute in floating point"
    seen: set[int] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        why = _why_not(node, compute)
        if why is not None:
            return f"{why} inside the attention, which a kernel call would not reproduce"
        if node.op != "constant":
            stack.extend(node.inputs[:1] if id(node) in shifts else node.inputs)
    return None


def _why_not(node: Node, compute: str) -> str | None:
    if node.op in ROLES or node.op in MOVES:
        return None
    if fold(node) is not None:  # a constant (1 / sqrt(d) computed in the program), read as one
        return None
    if node.op == "convert" and node.inputs:
        source = node.inputs[0].dtype
        if covers(node.dtype, source) or (node.dtype in FLOATS and covers(node.dtype, compute)):
            return None
        return f"a cast from {source} to {node.dtype}"
    return _WHERE.get(node.op, f"the op {node.op}")
