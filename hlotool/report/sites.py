"""Detected sites as `hlotool inspect` shows them: a terminal table and the versioned JSON.

    print(render_sites(sites))
    print(render_near_misses(misses))       # inspect --why-not
    json.dumps(sites_document(sites))       # {"version": 1, "sites": [...]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from hlotool.report.console import Term
from hlotool.report.table import format_table
from hlotool.site import AttentionSite
from hlotool.units import format_bytes

if TYPE_CHECKING:
    from hlotool.passes.near_miss import NearMiss

REPORT_VERSION = 1


def sites_document(sites: Sequence[AttentionSite], **extra: Any) -> dict[str, Any]:
    """The versioned JSON report: `{"version": 1, "sites": [...], **extra}`."""
    return {"version": REPORT_VERSION, "sites": [s.to_json() for s in sites], **extra}


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def _row(i: int, s: AttentionSite) -> list[str]:
    dtype = s.dtype if s.softmax_dtype in (None, s.dtype) else f"{s.dtype}→{s.softmax_dtype}"
    mask = ", ".join((s.mask_text + (_shape(s.mask_shape) if s.mask_shape else ""), *s.variants))
    return [
        str(i), s.function, s.source or "?", s.layout,
        f"{_shape(s.q_shape)} {_shape(s.k_shape)} {_shape(s.v_shape)}", dtype,
        f"{s.num_q_heads}/{s.num_kv_heads}", "none" if s.scale is None else f"{s.scale:.4g}",
        mask, format_bytes(s.score_bytes),
    ]


HEADERS = ("#", "function", "source", "layout", "q k v", "dtype", "heads q/kv", "scale",
           "mask", "scores")


KERNEL_HEADERS = ("#", "function", "source", "target", "already a kernel", "library", "q k v",
                  "dtype", "recognised by")


def render_kernel_calls(calls: Sequence[Any], term: Term | None = None) -> str:
    """Calls a program already makes into an attention kernel
    (`hlotool.passes.kernel_calls.KernelCall`), one row each, fitted to `term`."""
    rows = [[str(i), c.function, c.source or "?", c.target, c.kernel, c.library, c.shapes(),
             c.dtype, c.evidence] for i, c in enumerate(calls, 1)]
    return format_table(KERNEL_HEADERS, rows, right_aligned={0}, wrap={1: 10, 2: 30, 6: 11, 8: 20},
                        optional=(8, 7, 5, 3), term=term)


def render_sites(sites: Sequence[AttentionSite], term: Term | None = None) -> str:
    """An aligned text table, one row per site, fitted to `term`; says so when there are
    none."""
    if not sites:
        return "no attention sites found"
    return format_table(HEADERS, [_row(i, s) for i, s in enumerate(sites, 1)],
                        right_aligned={0, 9},
                        # A source path folds only when nothing else can; q k v wraps a
                        # shape a line.
                        wrap={1: 10, 2: 30, 4: 11}, optional=(3, 7, 6),
                        term=term)


def render_near_misses(misses: Sequence[NearMiss], term: Term | None = None) -> str:
    """One row per near miss: where it is and the first rule it breaks."""
    if not misses:
        return "none: every exp between two dots is a detected site"
    rows = [[str(i), m.function, m.source or "?", m.reason] for i, m in enumerate(misses, 1)]
    return format_table(("#", "function", "source", "why it is not attention"), rows,
                        right_aligned={0}, wrap={1: 10, 2: 30, 3: 30}, term=term)
