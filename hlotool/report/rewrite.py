"""`hlotool rewrite`: flash_jit's decision per site, as lines that fit the terminal."""

from __future__ import annotations

import re

from hlotool.report.console import Term, printable

# flash_jit's per-site reason joins one "platform: why" per platform with "; ".
PLATFORM_REASON = re.compile(r"(?:^|; )(cpu|tpu|cuda): (.*?)(?=; (?:cpu|tpu|cuda): |$)")


def platform_reasons(reason: str) -> dict[str, str]:
    """{"cpu": why, "tpu": why, ...} from a site's reason; {} when one reason (a blocker,
    such as intermediates used elsewhere) holds for every platform."""
    return dict(PLATFORM_REASON.findall(reason))


def render_rewrite(report, term: Term | None = None) -> str:
    """One function's `hlotool.flash.Report`: a header, then per site where it is, its
    shapes, and per platform the kernel or native with the reason, each wrapped to `term`
    with a hanging indent."""
    term = term or Term()
    name = printable(report.function)
    if not report.sites:
        return f"{name}: no attention site"
    n = len(report.sites)
    lines = [term.style(f"{name}: {n} site{'s' if n != 1 else ''}, {report.rewritten} "
                        "rewritten", "bold")]
    for i, s in enumerate(report.sites):
        a = s.site
        lines.append(term.wrap(
            f"[{i}] {printable(a.source or '?')} ({s.where}) q{list(a.q_shape)} "
            f"k{list(a.k_shape)} {a.dtype} mask={a.mask}", "  ", "      "))
        by_platform = platform_reasons(s.reason)
        if not by_platform:  # one reason keeps it native everywhere
            lines.append(term.wrap(f"{', '.join(s.kernels)}: native — {s.reason}", "      ",
                                   "        "))
            continue
        for platform, kernel in s.kernels.items():
            why = by_platform.get(platform, "")
            text = (f"{platform}: {term.style(kernel, 'green')} — {why}" if kernel else
                    f"{platform}: native {why.removeprefix('keep native ')}")
            lines.append(term.wrap(text.rstrip(" —"), "      ", "        "))
    return "\n".join(lines)
