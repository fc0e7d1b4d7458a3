"""Detection results for `hlotool inspect`: per-function detection, a terminal table, JSON.

    sites = detect_captured(captured)       # HLO front end, one list for all functions
    print(render_sites(sites))
    json.dumps(sites_document(sites))       # {"version": 1, "sites": [...]}
"""

from __future__ import annotations

from typing import Any, Iterable, Protocol, Sequence

from hlotool.passes.from_hlo import detect_hlo
from hlotool.site import AttentionSite
from hlotool.table import format_table

REPORT_VERSION = 1


class _Captured(Protocol):
    name: str

    def hlo(self, debug_info: bool = True) -> str: ...


def detect_captured(functions: Iterable[_Captured]) -> list[AttentionSite]:
    """Sites of every captured function, from its pre-optimization HLO with debug info."""
    sites: list[AttentionSite] = []
    for f in functions:
        sites.extend(detect_hlo(f.hlo(debug_info=True), f.name))
    return sites


def sites_document(sites: Sequence[AttentionSite], **extra: Any) -> dict[str, Any]:
    """The versioned JSON report: `{"version": 1, "sites": [...], **extra}`."""
    return {"version": REPORT_VERSION, "sites": [s.to_json() for s in sites], **extra}


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(n) for n in shape) + "]"


def _row(i: int, s: AttentionSite) -> list[str]:
    dtype = s.dtype if s.softmax_dtype in (None, s.dtype) else f"{s.dtype}→{s.softmax_dtype}"
    mask = s.mask + (_shape(s.mask_shape) if s.mask_shape else "")
    return [
        str(i), s.function, s.source or "?", s.layout,
        f"{_shape(s.q_shape)} {_shape(s.k_shape)} {_shape(s.v_shape)}", dtype,
        f"{s.num_q_heads}/{s.num_kv_heads}", "none" if s.scale is None else f"{s.scale:.4g}",
        mask, _bytes(s.score_bytes),
    ]


HEADERS = ("#", "function", "source", "layout", "q k v", "dtype", "heads q/kv", "scale",
           "mask", "scores")


def render_sites(sites: Sequence[AttentionSite]) -> str:
    """An aligned text table, one row per site; says so when there are none."""
    if not sites:
        return "no attention sites found"
    return format_table(HEADERS, [_row(i, s) for i, s in enumerate(sites, 1)],
                        right_aligned={0, 9})
