"""What reaches the terminal: its width, colour, and a progress line for slow compiles.

rich measures the terminal, wraps table cells and knows the colour conventions (a TTY only,
NO_COLOR, FORCE_COLOR); its live status line refreshes from a thread, which a progress line
needs while the main thread sits in one blocking XLA compile. Reports still return strings:
`Term` says how wide and whether in colour, and the CLI echoes what they return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

# A compile shorter than this passes in silence; a longer one gets a live status line.
PROGRESS_AFTER_S = 1.0
_TRAILING_SPACE = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$", re.M)


def printable(text: str) -> str:
    """`text` with control characters (ANSI escapes in a function name, a newline in a
    path) written as Python escapes, so nothing but text reaches the terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclasses.dataclass(frozen=True)
class Term:
    """How text is laid out for one stream: `width` columns (None: lines as long as they
    come, for files and pipes) and whether ANSI colour is used."""

    width: int | None = None
    color: bool = False

    @classmethod
    def of(cls, stream: IO[str] | None = None) -> Term:
        """The terminal's width and colour on a TTY (rich's detection: FORCE_COLOR counts
        as one, NO_COLOR turns colour off); elsewhere $COLUMNS when set, else unlimited."""
        probe = Console(file=stream or sys.stdout)
        if probe.is_terminal:
            return cls(probe.width, probe.color_system is not None and not probe.no_color)
        columns = os.environ.get("COLUMNS", "")
        return cls(int(columns) if columns.isdigit() and int(columns) > 0 else None, False)

    def render(self, renderable: object) -> str:
        """`renderable` (a rich Table or Text) as text for this terminal, no trailing spaces."""
        width = self.width
        if width is None:
            width = Console(width=10**6).measure(renderable).maximum
        out = io.StringIO()
        Console(file=out, width=max(width, 20), force_terminal=self.color,
                color_system="standard" if self.color else None, highlight=False,
                markup=False, emoji=False).print(renderable)
        return _TRAILING_SPACE.sub(r"\1", out.getvalue()).rstrip("\n")

    def wrap(self, text: str, indent: str = "", hang: str | None = None) -> str:
        """A paragraph wrapped to the width: first line at `indent`, the rest at `hang`
        (default: `indent`). Unlimited width leaves it on one line."""
        hang = indent if hang is None else hang
        if self.width is None:
            return indent + text
        return _Wrapper(max(self.width, 40), initial_indent=indent, subsequent_indent=hang,
                        break_on_hyphens=False).fill(text)

    def style(self, text: str, style: str) -> str:
        """`text` in a rich style ("bold", "red", ...) when colour is on."""
        return self.render(Text(text, style=style)) if self.color else text


class _Wrapper(textwrap.TextWrapper):
    """textwrap, but a word too long for a line (a path) breaks after a `/` where it can,
    not in the middle of a name."""

    def _handle_long_word(self, reversed_chunks: list[str], cur_line: list[str], cur_len: int,
                          width: int) -> None:
        room = max(width - cur_len, 1)
        chunk = reversed_chunks[-1]
        cut = chunk.rfind("/", 0, room) + 1
        if cut <= 0 or cut == len(chunk):
            super()._handle_long_word(reversed_chunks, cur_line, cur_len, width)
            return
        cur_line.append(chunk[:cut])
        reversed_chunks[-1] = chunk[cut:]


class Progress:
    """The step a progress line names; `update` renames it while the block runs."""

    def __init__(self, message: str) -> None:
        self.message = printable(message)

    def update(self, message: str) -> None:
        self.message = printable(message)


_shown: list[Progress] = []  # the progress line on screen (rich shows one live line at once)


@contextlib.contextmanager
def progress(message: str, term_stream: IO[str] | None = None,
             after: float | None = None) -> Iterator[Progress]:
    """Show `message` with a spinner and the seconds elapsed on stderr while the block runs
    past `after` seconds (`PROGRESS_AFTER_S`; 0: at once, for a step that is never short);
    nothing on a stream that is not a terminal. A progress inside another shows on the same
    line. Lines written to sys.stderr meanwhile (a script's own output) print above it;
    sys.stdout is left alone, as a script's capture redirects it."""
    console = Console(file=term_stream or sys.stderr, highlight=False, markup=False)
    if _shown:
        outer = _shown[-1]
        saved, outer.message = outer.message, printable(message)
        try:
            yield outer
        finally:
            outer.message = saved
        return
    handle = Progress(message)
    if not console.is_terminal:
        yield handle
        return
    after = PROGRESS_AFTER_S if after is None else after
    start = time.monotonic()
    spinner = Spinner("dots", text=handle.message, style="status.spinner")
    live = Live(spinner, console=console, refresh_per_second=12.5, transient=True,
                redirect_stdout=False)
    done = threading.Event()

    def show() -> None:
        while not done.wait(0.25):
            spinner.update(text=f"{handle.message} ({time.monotonic() - start:.0f} s)")

    def later() -> None:
        if not done.wait(after):
            with live:
                show()

    if not after:
        # From this thread: a thread of its own would wait for the GIL while the block
        # imports jax (loading its libraries holds the GIL for a second).
        live.start()
    thread = threading.Thread(target=later if after else show, daemon=True)
    _shown.append(handle)
    thread.start()
    try:
        yield handle
    finally:
        _shown.pop()
        done.set()
        thread.join()
        if not after:
            live.stop()
