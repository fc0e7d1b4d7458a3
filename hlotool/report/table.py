"""Aligned text tables for the terminal; every report in hlotool prints through this."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from hlotool.report.console import Term, printable

# Narrowest a prose column gets (in characters) before other columns are cut or left out.
_PROSE_MIN = 16


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str | Text]],
                 right_aligned: Collection[int] = (), *,
                 wrap: Collection[int] | Mapping[int, int] = (),
                 optional: Sequence[int] = (), term: Term | None = None) -> str:
    """Rows as aligned columns under a header and a rule, fitted to `term`'s width: the
    `wrap` columns (prose, lists) wrap inside their cell, each down to `_PROSE_MIN`
    characters or, where `wrap` is a mapping, its own minimum; where even then the table is too
    wide, the `optional` columns are left out in that order (a last line names them: --json
    has them all); what still does not fit is cut with …. Cells may be rich `Text`, to
    carry a colour."""
    term = term or Term()
    cells = [[c if isinstance(c, Text) else Text(printable(c)) for c in row] for row in rows]
    titles = [printable(h) for h in headers]

    def natural(i: int) -> int:
        return max((c.cell_len for c in [Text(titles[i]), *(r[i] for r in cells)]), default=0)

    def least(i: int) -> int:
        if i not in wrap:
            return natural(i)
        return min(natural(i), wrap[i] if isinstance(wrap, Mapping) else _PROSE_MIN)

    def room(columns: list[int]) -> int:  # what the columns may take, gaps aside
        return (term.width or 0) - 2 * (len(columns) - 1)

    shown = list(range(len(headers)))
    for i in optional:
        if term.width is None or sum(map(least, shown)) <= room(shown):
            break
        shown.remove(i)
    widths = {i: natural(i) for i in shown}
    if term.width is not None:
        # Narrow the widest prose column first, each down to its minimum: rich would narrow
        # them all in proportion and cut a number column before a path.
        excess = sum(widths.values()) - room(shown)
        while excess > 0:
            give = [i for i in shown if i in wrap and widths[i] > least(i)]
            if not give:
                break
            i = max(give, key=lambda j: widths[j])
            cut = min(excess, widths[i] - least(i), max(1, widths[i] - max(
                (widths[j] for j in give if j != i), default=0)))
            widths[i] -= cut
            excess -= cut
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
                  collapse_padding=True, header_style="bold", border_style="dim")
    for i in shown:
        table.add_column(titles[i], justify="right" if i in right_aligned else "left",
                         no_wrap=i not in wrap, overflow="fold" if i in wrap else "ellipsis",
                         width=widths[i] if i in wrap else None)
    for row in cells:
        table.add_row(*(row[i] for i in shown))
    text = term.render(table)
    left_out = [titles[i] for i in range(len(headers)) if i not in shown]
    if left_out:
        text += "\n" + term.wrap(f"(left out to fit {term.width} columns: "
                                 f"{', '.join(left_out)}; --json has every field)")
    return text
