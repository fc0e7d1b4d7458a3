"""`hlotool rewrite`: flash_jit's decision per site, as lines that fit the terminal."""

from __future__ import annotations

from hlotool.report.console import Term, printable
from hlotool.site_report import describe, headline


def render_rewrite(report, term: Term | None = None) -> str:
    """One function's `hlotool.site_report.Report`: a header, then per site where it is, its
    shapes, and the kernel or native with the reason, once per group of platforms that
    share them (`SiteReport.groups`), each wrapped to `term` with a hanging indent."""
    term = term or Term()
    name = printable(report.function)
    if not report.sites:
        return f"{name}: {report.note or 'no attention site'}"
    n = len(report.sites)
    lines = [term.style(f"{name}: {n} site{'s' if n != 1 else ''}, {report.rewritten} "
                        "rewritten", "bold")]
    for i, s in enumerate(report.sites):
        lines.append(term.wrap(f"[{i}] {printable(headline(s))}", "  ", "      "))
        if s.blocker:  # one reason keeps it native everywhere
            lines.append(term.wrap(f"{', '.join(s.choices)}: native — {s.blocker}", "      ",
                                   "        "))
        for group in () if s.blocker else s.groups():
            text = describe(group)
            if group[0].kernel:
                text = text.replace(group[0].kernel, term.style(group[0].kernel, "green"), 1)
            lines.append(term.wrap(text, "      ", "        "))
        lines.extend(term.wrap(note, "      ", "        ") for note in s.notes)
    return "\n".join(lines)
