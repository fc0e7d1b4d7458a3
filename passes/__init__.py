"""Passes over captured programs: detection, rewrite, diff (installed as hlotool.passes).

Detection (one attention pattern, `passes/attention.py`; two front ends):
  detect_jaxpr(closed_jaxpr)   -> [JaxprSite]      the rewrite's view: vars, layouts, masks
  detect_function(fn, *args)   -> [JaxprSite]      make_jaxpr, then detect_jaxpr
  detect_hlo(module_or_text)   -> [AttentionSite]  pre-optimization HLO, calls inlined
Reports: detect_captured, render_sites, sites_document (`passes/report.py`).
"""

from hlotool.passes.from_hlo import detect_hlo
from hlotool.passes.from_jaxpr import JaxprSite, detect_function, detect_jaxpr
from hlotool.passes.report import detect_captured, render_sites, sites_document

__all__ = [
    "JaxprSite", "detect_captured", "detect_function", "detect_hlo", "detect_jaxpr",
    "render_sites", "sites_document",
]
