"""Aligned text tables for the terminal; every report in hlotool prints through this."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], right_aligned: Collection[int] = ()
) -> str:
    """Rows as aligned text columns under a header and a rule."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right_aligned else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
