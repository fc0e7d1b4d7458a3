"""`hlotool cost --plot`: predicted time and HBM bytes against sequence length, native and
kernel per chip, the crossover marked; a small hand-written SVG (log-log axes), one row of
two panels per distinct site shape."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

from hlotool.cost.decision import choose
from hlotool.cost.model import analytic
from hlotool.hardware import get_hardware
from hlotool.errors import MARK
from hlotool.site import AttentionSite
from hlotool.units import format_bytes, format_seconds

LENGTHS = tuple(2**p for p in range(7, 16))  # 128 .. 32768
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")
_W, _H = 460, 300
_TITLE_H = 30  # a row's title line, above its panels' own labels
_LEFT = 72  # room for tick labels such as "512.0 MiB"


@dataclasses.dataclass(frozen=True)
class Series:
    """One chip's curves over `lengths`: native as XLA runs it and the kernel the verdict
    prices (`hlotool.cost.decision.choose`, what every command reads), and whether it pays
    at each length."""

    target: str
    lengths: tuple[int, ...]
    native_seconds: tuple[float, ...]
    kernel_seconds: tuple[float, ...]
    native_bytes: tuple[int, ...]
    kernel_bytes: tuple[int, ...]
    pays: tuple[bool, ...] = ()

    @property
    def crossover(self) -> int | None:
        """The length from which the verdict runs the kernel, where it keeps native at the
        length before it; None when one verdict holds across the whole sweep (a sweep's
        first length is where it starts, not where anything crosses)."""
        return next((n for n, before, now in zip(self.lengths[1:], self.pays, self.pays[1:])
                     if now and not before), None)

    @property
    def outcome(self) -> str:
        """The legend's words: the verdict's, at each length."""
        if self.crossover:
            return f"the kernel pays from L={self.crossover}"
        if self.pays and all(self.pays):
            return f"the kernel pays at every L ≥ {self.lengths[0]}"
        return f"keep native at every L ≤ {self.lengths[-1]}"


def series(site: AttentionSite, target: str, lengths: Sequence[int] = LENGTHS, *,
           backward: bool = False, check_fusion: bool = True) -> Series:
    """`site` with Lq = Lk = each length, priced on `target` by the one decision."""
    platform = get_hardware(target).platform
    verdicts = []
    for n in lengths:
        # At the site's own length the site as it is: the plot marks what the commands say.
        s = site if n == site.q_len == site.kv_len else dataclasses.replace(
            site, q_len=n, kv_len=n, mask_shape=None)
        v = choose(s, platform, chip=target, backward=backward,
                   check_fusion=check_fusion).verdict
        kernel = v.kernel or analytic(s, target, "kernel", backward=backward)
        verdicts.append((v, kernel))
    return Series(target, tuple(lengths), tuple(v.native.seconds for v, _ in verdicts),
                  tuple(k.seconds for _, k in verdicts),
                  tuple(v.native.hbm_bytes for v, _ in verdicts),
                  tuple(k.hbm_bytes for _, k in verdicts),
                  tuple(v.pays for v, _ in verdicts))


def swept_shape(site: AttentionSite) -> AttentionSite:
    """What the sweep keeps of a site: everything but its lengths, function and source, so
    layers of one model share a row."""
    return dataclasses.replace(site, q_len=0, kv_len=0, mask_shape=None, q_shape=(),
                               k_shape=(), v_shape=(), function="", source="")


def plot(sites: Sequence[AttentionSite], targets: Sequence[str], *, backward: bool = False,
         check_fusion: bool = True) -> str:
    """The SVG for `hlotool cost --plot`: one row per distinct `swept_shape`, each titled
    with the functions holding it and marked at their own lengths."""
    rows: dict[AttentionSite, list[AttentionSite]] = {}
    for s in sites:
        rows.setdefault(swept_shape(s), []).append(s)
    out = []
    for group in rows.values():
        own = sorted({s.kv_len for s in group})
        lengths = sorted(set(LENGTHS) | set(own))  # the script's own lengths are on the axis
        out.append(([series(group[0], t, lengths, backward=backward, check_fusion=check_fusion)
                     for t in targets], _title(group), own))
    return svg(out)


def _title(group: Sequence[AttentionSite]) -> str:
    s = group[0]
    where = ", ".join(dict.fromkeys(x.function or "site" for x in group))
    n = len(group)
    return (f"{where} ({n} site{'s' if n != 1 else ''}): B={s.batch} H={s.num_q_heads} "
            f"D={s.head_dim} {s.dtype} mask {s.mask_text}; Lq = Lk swept")


def svg(rows: Sequence[tuple[Sequence[Series], str, Sequence[int]]]) -> str:
    """Per row (its series, title, the lengths the script itself runs): two panels (time,
    HBM bytes) side by side; solid with dots = native, dashed with squares = kernel."""
    parts, y = [], 0
    for all_series, title, own in rows:
        parts.append(f'<text x="{_LEFT}" y="{y + 20}" font-size="14" '
                     f'font-weight="bold">{escape(title)}</text>')
        top = y + _TITLE_H
        parts.append(_panel(all_series, "predicted time", "seconds", 0, top, own))
        parts.append(_panel(all_series, "HBM traffic", "bytes", _W, top, own))
        y = top + _H
        for i, s in enumerate(all_series):
            c = _COLORS[i % len(_COLORS)]
            ly = y + 16 * i + 4
            parts.append(
                f'<line x1="{_LEFT}" y1="{ly - 4}" x2="{_LEFT + 24}" y2="{ly - 4}" '
                f'stroke="{c}" stroke-width="2"/><line x1="{_LEFT + 30}" y1="{ly - 4}" '
                f'x2="{_LEFT + 54}" y2="{ly - 4}" stroke="{c}" stroke-width="2" '
                f'stroke-dasharray="5,3"/><text x="{_LEFT + 60}" y="{ly}">'
                f"{escape(s.target)}: native (solid), kernel (dashed); "
                f"{escape(s.outcome)}</text>")
        y += 16 * len(all_series) + 12
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * _W}" height="{y}" '
            f'viewBox="0 0 {2 * _W} {y}" font-family="sans-serif" font-size="11">'
            f"<!-- {MARK} -->"
            f'<rect width="100%" height="100%" fill="white"/>'
            + "".join(parts) + "</svg>\n")


def _ticks(lo: float, hi: float, what: str) -> list[float]:
    """Tick values spanning [lo, hi]: powers of 10 for seconds, powers of 2 for bytes (so
    they read 1.0 KiB, 8.0 TiB), thinned to at most 7."""
    base = 2 if what == "bytes" else 10
    e0, e1 = math.floor(math.log(lo, base)), math.ceil(math.log(hi, base))
    step = next(s for s in (1, 2, 5, 10, 20) if (e1 - e0) / s <= 6)
    first = e0 - e0 % step
    return [base**e for e in range(first, e1 + step, step) if base**e <= hi * base**step]


def _panel(all_series: Sequence[Series], label: str, what: str, x0: int, top: float,
           own: Sequence[int]) -> str:
    values = [v for s in all_series for v in (getattr(s, f"native_{what}")
                                              + getattr(s, f"kernel_{what}")) if v > 0]
    lengths = [n for s in all_series for n in s.lengths]
    ticks = _ticks(min(values), max(values), what)
    lx0, lx1 = math.log10(min(lengths)), math.log10(max(lengths))
    ly0, ly1 = math.log10(ticks[0]), math.log10(ticks[-1])
    left, right, bottom = x0 + _LEFT, x0 + _W - 12, top + _H - 40
    plot_top = top + 18

    def px(n: float) -> float:
        return left + (math.log10(n) - lx0) / max(lx1 - lx0, 1e-9) * (right - left)

    def py(v: float) -> float:
        return bottom - (math.log10(v) - ly0) / max(ly1 - ly0, 1e-9) * (bottom - plot_top)

    fmt = format_bytes if what == "bytes" else format_seconds
    out = [f'<text x="{left}" y="{top + 10}" font-size="12">{label} vs sequence length '
           f"(log-log)</text>",
           f'<rect x="{left}" y="{plot_top}" width="{right - left}" '
           f'height="{bottom - plot_top}" fill="none" stroke="#999"/>']
    for n in sorted(set(lengths)):
        if n in LENGTHS or n in own:
            out.append(f'<text x="{px(n):.1f}" y="{bottom + 14}" text-anchor="middle">'
                       f"{n if n < 1024 or n % 1024 else f'{n // 1024}K'}</text>")
    out.append(f'<text x="{(left + right) / 2:.0f}" y="{bottom + 30}" '
               'text-anchor="middle">Lq = Lk</text>')
    for t in ticks:
        out.append(f'<text x="{left - 4}" y="{py(t) + 4:.1f}" text-anchor="end">'
                   f"{escape(fmt(t))}</text><line x1=\"{left}\" y1=\"{py(t):.1f}\" "
                   f'x2="{right}" y2="{py(t):.1f}" stroke="#eee"/>')
    for n in own:
        if min(lengths) <= n <= max(lengths):
            out.append(f'<line x1="{px(n):.1f}" y1="{plot_top}" x2="{px(n):.1f}" '
                       f'y2="{bottom}" stroke="#000" stroke-opacity="0.35"/>'
                       f'<text class="own-length" x="{px(n) + 3:.1f}" y="{bottom - 4}" '
                       f'fill="#555">this script: L={n}</text>')
    count = len(all_series)
    for i, s in enumerate(all_series):
        c = _COLORS[i % len(_COLORS)]
        # Chips can predict the same curve (HBM bytes rarely depend on the chip): earlier
        # series are drawn wider underneath, so coincident lines show as nested stripes.
        width = 1.5 + 2.5 * (count - 1 - i)
        for side, dash in (("native", ""), ("kernel", ' stroke-dasharray="6,4"')):
            points = [(px(n), py(v)) for n, v in zip(s.lengths, getattr(s, f"{side}_{what}"))
                      if v > 0]
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{c}" '
                       f'stroke-width="{width:.1f}" stroke-opacity="0.85"{dash}/>')
            r = 2.5 + 1.2 * (count - 1 - i)
            for x, y in points:
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{c}"/>'
                           if side == "native" else
                           f'<rect x="{x - r - 1:.1f}" y="{y - r - 1:.1f}" '
                           f'width="{2 * r + 2:.1f}" height="{2 * r + 2:.1f}" fill="none" '
                           f'stroke="{c}" stroke-width="1.5"/>')
        if s.crossover and what == "seconds":
            x = px(s.crossover)
            out.append(f'<line x1="{x:.1f}" y1="{plot_top}" x2="{x:.1f}" y2="{bottom}" '
                       f'stroke="{c}" stroke-dasharray="1,3"/><text class="crossover" '
                       f'x="{x + 3:.1f}" y="{plot_top + 12 + 12 * i}" fill="{c}">'
                       f"L={s.crossover}</text>")
    return "".join(out)
