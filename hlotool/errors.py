"""The one error type users see.

Anything that is the user's problem (a script that fails to import, a target name that does
not exist, malformed HLO text) is raised as `HlotoolError` with a one-line message. The CLI
prints that line and exits non-zero; tracebacks are reserved for `--debug`.
"""

from __future__ import annotations


class HlotoolError(Exception):
    """A problem with the user's input, stated in one line."""

    exit_code = 2


class HloParseError(HlotoolError):
    """Malformed HLO text; the message names line and column."""

    def __init__(self, message: str, line: int, column: int, source_name: str = "<hlo>"):
        self.line = line
        self.column = column
        self.source_name = source_name
        super().__init__(f"{source_name}:{line}:{column}: {message}")


def write_output(path: str, data: str | bytes) -> None:
    """Write a file the user asked for; a failure is one line naming the path and the cause."""
    if isinstance(data, str):
        data = data.encode("utf-8")  # reports hold −, ×, → and source paths in any script
    try:
        with open(path, "wb") as out:
            out.write(data)
    except OSError as e:
        raise HlotoolError(f"cannot write {path}: {e.strerror or e}") from None
