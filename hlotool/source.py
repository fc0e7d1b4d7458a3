"""Where a value comes from in the user's code: one rule for every front end."""

from __future__ import annotations

import re
from typing import Iterable

_LIBRARY_PATH = re.compile(r"[/\\](?:site|dist)-packages[/\\]")


def user_source(frames: Iterable[tuple[str, int]]) -> str:
    """'file:line' of the innermost frame outside installed libraries (flax, haiku, ...),
    so a site inside a library's attention module points at the user's call; the innermost
    frame when all are library frames; "" without frames."""
    first = None
    for file, line in frames:
        first = first or f"{file}:{line}"
        if not _LIBRARY_PATH.search(file):
            return f"{file}:{line}"
    return first or ""
