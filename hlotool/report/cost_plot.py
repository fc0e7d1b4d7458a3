"""`hlotool cost --plot`: predicted time and HBM bytes against sequence length, native and
kernel per chip, the crossover marked; a small hand-written SVG (log-log axes)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from hlotool.cost.model import analytic
from hlotool.site import AttentionSite

LENGTHS = tuple(2**p for p in range(7, 16))  # 128 .. 32768
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
_W, _H, _PAD = 460, 300, 56


@dataclasses.dataclass(frozen=True)
class Series:
    """One chip's predicted native and kernel curves over `lengths`."""

    target: str
    lengths: tuple[int, ...]
    native_seconds: tuple[float, ...]
    kernel_seconds: tuple[float, ...]
    native_bytes: tuple[int, ...]
    kernel_bytes: tuple[int, ...]

    @property
    def crossover(self) -> int | None:
        """First length at which the kernel's predicted time is below native's."""
        return next((n for n, a, b in zip(self.lengths, self.native_seconds,
                                          self.kernel_seconds) if b < a), None)


def series(site: AttentionSite, target: str, lengths: Sequence[int] = LENGTHS) -> Series:
    """`site` with Lq = Lk = each length, priced on `target`."""
    rows = []
    for n in lengths:
        s = dataclasses.replace(site, q_len=n, kv_len=n, mask_shape=None)
        rows.append((analytic(s, target, "native"), analytic(s, target, "kernel")))
    return Series(target, tuple(lengths), tuple(a.seconds for a, _ in rows),
                  tuple(b.seconds for _, b in rows), tuple(a.hbm_bytes for a, _ in rows),
                  tuple(b.hbm_bytes for _, b in rows))


def svg(all_series: Sequence[Series], title: str) -> str:
    """Two panels (time, HBM bytes) side by side; solid = native, dashed = kernel."""
    panels = [
        _panel(all_series, "predicted time (s)", "seconds", 0),
        _panel(all_series, "HBM traffic (bytes)", "bytes", _W),
    ]
    legend = []
    for i, s in enumerate(all_series):
        y = _H + 18 + 16 * i
        c = _COLORS[i % len(_COLORS)]
        cross = f"crossover L={s.crossover}" if s.crossover else "no crossover in range"
        legend.append(
            f'<line x1="{_PAD}" y1="{y - 4}" x2="{_PAD + 24}" y2="{y - 4}" stroke="{c}"/>'
            f'<line x1="{_PAD + 30}" y1="{y - 4}" x2="{_PAD + 54}" y2="{y - 4}" stroke="{c}" '
            f'stroke-dasharray="5,3"/><text x="{_PAD + 60}" y="{y}">{escape(s.target)}: native '
            f"(solid), kernel (dashed); {cross}</text>")
    height = _H + 24 + 16 * len(all_series)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * _W}" height="{height}" '
            f'font-family="sans-serif" font-size="11">'
            f'<text x="{_PAD}" y="16" font-size="13">{escape(title)}</text>'
            + "".join(panels) + "".join(legend) + "</svg>\n")


def _panel(all_series: Sequence[Series], label: str, what: str, x0: int) -> str:
    values = [v for s in all_series for v in (getattr(s, f"native_{what}")
                                              + getattr(s, f"kernel_{what}")) if v > 0]
    lengths = [n for s in all_series for n in s.lengths]
    lx0, lx1 = math.log10(min(lengths)), math.log10(max(lengths))
    ly0, ly1 = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    left, right, top, bottom = x0 + _PAD, x0 + _W - 12, 28, _H - 30

    def px(n: float) -> float:
        return left + (math.log10(n) - lx0) / max(lx1 - lx0, 1e-9) * (right - left)

    def py(v: float) -> float:
        return bottom - (math.log10(v) - ly0) / max(ly1 - ly0, 1e-9) * (bottom - top)

    out = [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
           f'fill="none" stroke="#999"/>',
           f'<text x="{left}" y="{top - 6}">{label} vs sequence length</text>']
    for n in sorted(set(lengths)):
        out.append(f'<text x="{px(n):.1f}" y="{bottom + 14}" text-anchor="middle">'
                   f"{n if n < 1024 else f'{n // 1024}K'}</text>")
    for e in range(ly0, ly1 + 1):
        out.append(f'<text x="{left - 4}" y="{py(10**e) + 4:.1f}" text-anchor="end">1e{e}</text>'
                   f'<line x1="{left}" y1="{py(10**e):.1f}" x2="{right}" y2="{py(10**e):.1f}" '
                   f'stroke="#eee"/>')
    for i, s in enumerate(all_series):
        c = _COLORS[i % len(_COLORS)]
        for side, dash in (("native", ""), ("kernel", ' stroke-dasharray="5,3"')):
            pts = " ".join(f"{px(n):.1f},{py(v):.1f}"
                           for n, v in zip(s.lengths, getattr(s, f"{side}_{what}")) if v > 0)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}"{dash}/>')
        if s.crossover and what == "seconds":
            x = px(s.crossover)
            out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="{c}" '
                       f'stroke-dasharray="1,3"/><text class="crossover" x="{x + 3:.1f}" '
                       f'y="{top + 12 + 12 * i}" fill="{c}">L={s.crossover}</text>')
    return "".join(out)
