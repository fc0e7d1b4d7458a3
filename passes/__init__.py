"""Passes over captured programs: detection, rewrite, diff (installed as hlotool.passes).

Detection (one attention pattern, `passes/attention.py`; two front ends):
  detect_jaxpr(closed_jaxpr)   -> [JaxprSite]      the rewrite's view: vars, layouts, masks
  detect_hlo(module_or_text)   -> [AttentionSite]  pre-optimization HLO, calls inlined
  detect_captured(functions)   -> [AttentionSite]  every captured function, from its HLO
"""

from hlotool.passes.from_hlo import detect_captured, detect_hlo
from hlotool.passes.from_jaxpr import JaxprSite, detect_jaxpr

__all__ = [
    "JaxprSite", "detect_captured", "detect_hlo", "detect_jaxpr",
]
