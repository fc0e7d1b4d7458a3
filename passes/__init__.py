"""Passes over captured programs: detection, lowering, rewrite, diff (as hlotool.passes).

Detection (one attention pattern, `passes/attention.py`; two front ends):
  detect_jaxpr(closed_jaxpr)   -> [JaxprSite]      the rewrite's view: vars, layouts, masks
  detect_hlo(module_or_text)   -> [AttentionSite]  pre-optimization HLO, calls inlined
  detect_captured(functions)   -> [AttentionSite]  every captured function, from its HLO
  near_misses_jaxpr / near_misses_hlo              almost-attention, and the rule it breaks
Lowering: `logits.replay` (what the chain before the softmax computes, in the program's
dtypes), `lower.lower` / `lower.operands` (a JaxprSite as a kernel call, or why none).
Rewrite: `rewrite.rewrite(closed, replacements)`. Diff: `diff.diff_modules`. What XLA does
natively with each site: `native.native_fates`.
"""

from hlotool.passes.from_hlo import detect_captured, detect_hlo
from hlotool.passes.from_jaxpr import JaxprSite, detect_jaxpr

__all__ = [
    "JaxprSite", "detect_captured", "detect_hlo", "detect_jaxpr",
]
