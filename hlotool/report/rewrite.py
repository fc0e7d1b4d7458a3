"""`hlotool rewrite`: flash_jit's decision per site, as lines that fit the terminal."""

from __future__ import annotations

import re
from collections.abc import Mapping

from hlotool.hardware import HARDWARE
from hlotool.report.console import Term, printable

# flash_jit's per-site reason joins one "platform: why" per platform with "; ".
PLATFORM_REASON = re.compile(r"(?:^|; )(cpu|tpu|cuda): (.*?)(?=; (?:cpu|tpu|cuda): |$)")
# A platform priced on another chip's figures says which: "keep native (…) on tpu-v5e".
_ON_CHIP = re.compile(r" on (" + "|".join(map(re.escape, HARDWARE)) + r")(?=$|, )")


def platform_reasons(reason: str) -> dict[str, str]:
    """{"cpu": why, "tpu": why, ...} from a site's reason; {} when one reason (a blocker,
    such as intermediates used elsewhere) holds for every platform."""
    return dict(PLATFORM_REASON.findall(reason))


def shared_reasons(reason: str, kernels: Mapping[str, str | None]
                   ) -> list[tuple[str, str | None, str]]:
    """The per-platform decisions of one site with each reason once: (platforms, kernel,
    why) per group of platforms that share a kernel and a reason once the chip each was
    priced on is set aside, e.g. ("cpu, tpu (tpu-v5e), cuda (h100)", None, "keep native
    (short sequence: …)"). A platform alone keeps its reason as written."""
    by_platform = platform_reasons(reason)
    groups: dict[tuple[str | None, str], list[tuple[str, str, str | None]]] = {}
    for platform, kernel in kernels.items():
        why = by_platform.get(platform, "")
        chip = _ON_CHIP.search(why)
        shared = _ON_CHIP.sub("", why, count=1) if chip else why
        groups.setdefault((kernel, shared), []).append(
            (platform, why, chip.group(1) if chip and chip.group(1) != platform else None))
    out = []
    for (kernel, shared), members in groups.items():
        if len(members) == 1:
            out.append((members[0][0], kernel, members[0][1]))
            continue
        names = ", ".join(p + (f" ({chip})" if chip else "") for p, _, chip in members)
        out.append((names, kernel, shared))
    return out


def render_rewrite(report, term: Term | None = None) -> str:
    """One function's `hlotool.flash.Report`: a header, then per site where it is, its
    shapes, and the kernel or native with the reason, once per group of platforms that
    share them, each wrapped to `term` with a hanging indent."""
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
        if not platform_reasons(s.reason):  # one reason keeps it native everywhere
            lines.append(term.wrap(f"{', '.join(s.kernels)}: native — {s.reason}", "      ",
                                   "        "))
            continue
        for platforms, kernel, why in shared_reasons(s.reason, s.kernels):
            text = (f"{platforms}: {term.style(kernel, 'green')} — {why}" if kernel else
                    f"{platforms}: native {why.removeprefix('keep native ')}")
            lines.append(term.wrap(text.rstrip(" —"), "      ", "        "))
    return "\n".join(lines)
