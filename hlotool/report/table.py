"""Aligned text tables for the terminal; every report in hlotool prints through this.

The layout is done here, not by rich's table: rich narrows every column in proportion and
folds a cell wherever the width runs out (`train_ste|p`, `decoder.py:5|6`), and it collapses
a narrow column to nothing without saying so. Here a cell breaks only between words (and after
a `/` of a path), a number stays with its unit, and a column that cannot get the width of
its longest word is left out, by name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence

from rich.cells import cell_len
from rich.text import Text

from hlotool.report.console import Term, printable

# Narrowest a prose column gets (in characters) before other columns are cut or left out.
_PROSE_MIN = 16
_GAP = 2  # spaces between columns
# Spaces that do not break a line: between a number and its unit ("128.0 KiB", "305 µs"),
# before an arrow ("8.0 MiB → 4.0 MiB" breaks after the arrow) and before a note's number
# ("keep native [1]").
_GLUED = re.compile(r"(?<=\d) (?=(?:[KMGTPE]i?)?B\b|[µmn]?s\b)| (?=→| ?\[\d+\])")
_SPACES = re.compile(r" +")


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A table laid out for a terminal: its text and the titles of the columns left out."""

    text: str
    left_out: tuple[str, ...]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str | Text]],
                 right_aligned: Collection[int] = (), *,
                 wrap: Collection[int] | Mapping[int, int] = (),
                 optional: Sequence[int] = (), keep: Collection[int] = (0,),
                 term: Term | None = None) -> str:
    """Rows as aligned columns under a header and a rule, fitted to `term`'s width; see
    `fit_table`."""
    return fit_table(headers, rows, right_aligned, wrap=wrap, optional=optional, keep=keep,
                     term=term).text


def fit_table(headers: Sequence[str], rows: Sequence[Sequence[str | Text]],
              right_aligned: Collection[int] = (), *,
              wrap: Collection[int] | Mapping[int, int] = (),
              optional: Sequence[int] = (), keep: Collection[int] = (0,),
              term: Term | None = None) -> Fitted:
    """Rows as aligned columns under a header and a rule, fitted to `term`'s width.

    The `wrap` columns (prose, lists, paths) wrap between words, each down to `_PROSE_MIN`
    characters or, where `wrap` is a mapping, its own minimum, and never below its longest
    word; other cells stay on one line; titles wrap between words. Where even then the table
    is too wide, the `optional` columns are left out in that order, then columns from the
    right except those in `keep`; a last line names them (--json has them all). Cells may be
    rich `Text`, to carry a colour."""
    term = term or Term()
    cells = [[c if isinstance(c, Text) else Text(printable(c)) for c in row] for row in rows]
    titles = [Text(printable(h)) for h in headers]
    body = [[r[i] for r in cells] for i in range(len(headers))]
    natural = [max(map(_widest_line, [titles[i], *body[i]])) for i in range(len(headers))]
    # hard: the longest word of each column (a whole cell where cells do not wrap); soft: a
    # prose column's own minimum, which it keeps while optional columns can make room.
    hard = [max(_longest_word(titles[i], True), *(
        _longest_word(c, True) if i in wrap else _widest_line(c) for c in body[i]))
        for i in range(len(headers))]
    soft = [max(hard[i], min(max(map(_widest_line, body[i]), default=0),
                             wrap[i] if isinstance(wrap, Mapping) else _PROSE_MIN))
            if i in wrap else hard[i] for i in range(len(headers))]
    shown = list(range(len(headers)))

    def fits(least: Sequence[int]) -> bool:
        return term.width is None or (
            sum(least[i] for i in shown) + _GAP * (len(shown) - 1) <= term.width)

    for i in optional:
        if fits(soft):
            break
        shown.remove(i)
    for i in reversed(range(len(headers))):
        if fits(hard) or len(shown) == 1:
            break
        if i in shown and i not in keep:
            shown.remove(i)
    widths = {i: natural[i] for i in shown}
    if term.width is not None:
        prose = [i for i in shown if i in wrap]
        excess = sum(widths.values()) + _GAP * (len(shown) - 1) - term.width
        titled = [i for i in shown if i not in wrap]  # a title wider than its cells
        for group, least in ((prose, soft), (titled, hard), (prose, hard)):
            excess = _narrow(widths, group, least, excess)
        _spread(widths, {i: [titles[i], *body[i]] for i in shown}, prose, natural,
                term.width - _GAP * (len(shown) - 1))
    lines = _layout([titles[i] for i in shown], [[r[i] for i in shown] for r in cells],
                    [widths[i] for i in shown], [i in right_aligned for i in shown],
                    [i in wrap for i in shown])
    text = term.render(Text("\n").join(lines))
    left_out = tuple(titles[i].plain for i in range(len(headers)) if i not in shown)
    if left_out:
        text += "\n" + term.wrap(f"(left out to fit {term.width} columns: "
                                 f"{', '.join(left_out)}; --json has every field)")
    return Fitted(text, left_out)


def _narrow(widths: dict[int, int], group: Sequence[int], least: Sequence[int],
            excess: int) -> int:
    """Take up to `excess` characters off the `group` columns, the widest first, each down
    to its `least` width (rich would narrow all of them in proportion, cutting a number
    before a path); returns what is left to take."""
    while excess > 0:
        give = [i for i in group if widths[i] > least[i]]
        if not give:
            break
        i = max(give, key=lambda j: widths[j])
        second = max((widths[j] for j in give if j != i), default=0)
        cut = min(excess, widths[i] - least[i], max(1, widths[i] - second))
        widths[i] -= cut
        excess -= cut
    return excess


def _used(column: Sequence[Text], width: int, breaks_paths: bool) -> int:
    """The width a column's cells take once wrapped to `width` (the title first)."""
    return max(line.cell_len for k, cell in enumerate(column)
               for line in wrap_cell(cell, width, breaks_paths or k == 0))


def _spread(widths: dict[int, int], columns: Mapping[int, Sequence[Text]],
            prose: Sequence[int], natural: Sequence[int], room: int) -> None:
    """Shrink each column to what its wrapped lines (and title) use, then give what that
    frees to the prose columns still wrapped, narrowest first ("train_step site1" on one
    line rather than a path one line shorter)."""
    for i in widths:
        widths[i] = _used(columns[i], widths[i], i in prose)
    for i in sorted(prose, key=lambda j: natural[j]):
        slack = room - sum(widths.values())
        if slack <= 0:
            break
        if widths[i] < natural[i]:
            widths[i] = _used(columns[i], min(natural[i], widths[i] + slack), True)


def _layout(titles: Sequence[Text], rows: Sequence[Sequence[Text]], widths: Sequence[int],
            right: Sequence[bool], wraps: Sequence[bool]) -> list[Text]:
    """The table's lines: bold titles, a dim rule, then each row, cells wrapped and padded."""
    wrapped_rows = [[wrap_cell(c, w) for c, w in zip(titles, widths)],
                    *([wrap_cell(c, w, b) for c, w, b in zip(row, widths, wraps)] for row in rows)]

    def block(wrapped: Sequence[list[Text]], style: str = "") -> list[Text]:
        height = max(map(len, wrapped), default=1)
        out = []
        for n in range(height):
            line = Text(style=style)
            for k, (cell, w) in enumerate(zip(wrapped, widths)):
                part = cell[n] if n < len(cell) else Text("")
                pad = " " * max(0, w - part.cell_len)
                line.append_text(Text.assemble(*((pad, part) if right[k] else (part, pad))))
                if k < len(widths) - 1:
                    line.append(" " * _GAP)
            out.append(line)
        return out

    rule = Text("─" * (sum(widths) + _GAP * (len(widths) - 1)), style="dim")
    return [*block(wrapped_rows[0], "bold"), rule,
            *(line for row in wrapped_rows[1:] for line in block(row))]


def wrap_cell(text: Text, width: int, breaks_paths: bool = True) -> list[Text]:
    """`text` in lines of at most `width` cells, broken between words (and, with
    `breaks_paths`, after a `/` inside a word); only a word longer than `width` is cut."""
    out = []
    start = 0
    for line in text.plain.split("\n"):
        end = start + len(line)
        out.extend(_wrap_line(text[start:end], width, breaks_paths))
        start = end + 1
    return out


def _wrap_line(text: Text, width: int, breaks_paths: bool) -> list[Text]:
    if text.cell_len <= width:
        return [text]
    lines: list[Text] = []
    line_start = line_end = 0  # the line being filled, as offsets into text
    for begin, end in _words(text.plain, breaks_paths):
        if line_end > line_start and cell_len(text.plain[line_start:end]) > width:
            lines.append(text[line_start:line_end])
            line_start = begin
        while cell_len(text.plain[line_start:end]) > width:  # a word too long for any line
            cut = line_start + _fit_chars(text.plain[line_start:end], width)
            lines.append(text[line_start:cut])
            line_start = cut
        line_end = end
    lines.append(text[line_start:line_end])
    for line in lines:
        line.rstrip()
    return lines


def _words(plain: str, breaks_paths: bool) -> list[tuple[int, int]]:
    """(start, end) of each unbreakable piece of `plain`: split at spaces that are not
    `_GLUED`, and after each `/` followed by more of the word when `breaks_paths`."""
    glued = {m.start() for m in _GLUED.finditer(plain)}
    pieces, start = [], 0
    for m in _SPACES.finditer(plain):
        if m.start() in glued and m.end() - m.start() == 1:
            continue
        pieces.append((start, m.start()))
        start = m.end()
    pieces.append((start, len(plain)))
    if not breaks_paths:
        return [p for p in pieces if p[1] > p[0]]
    out = []
    for begin, end in pieces:
        cut = begin
        for m in re.finditer(r"/(?=[^/ ])", plain[begin:end]):
            out.append((cut, begin + m.end()))
            cut = begin + m.end()
        out.append((cut, end))
    return [p for p in out if p[1] > p[0]]


def _fit_chars(plain: str, width: int) -> int:
    """How many characters of `plain` fill `width` cells (at least one)."""
    n = 0
    while n < len(plain) and cell_len(plain[:n + 1]) <= width:
        n += 1
    return max(n, 1)


def _widest_line(text: Text) -> int:
    return max(cell_len(line) for line in text.plain.split("\n"))


def _longest_word(text: Text, breaks_paths: bool) -> int:
    plain = text.plain.replace("\n", " ")
    return max((cell_len(plain[a:b]) for a, b in _words(plain, breaks_paths)), default=0)
