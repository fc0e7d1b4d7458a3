"""The one error type users see, the exit codes, and writing the files users ask for.

Anything that is the user's problem (a script that fails to import, a target name that does
not exist, malformed HLO text) is raised as `HlotoolError` with a one-line message. The CLI
prints that line and exits with `EXIT_BAD_INPUT`; tracebacks are reserved for `--debug`.
"""

from __future__ import annotations

import os

# Exit codes of every hlotool command; a CI gate tells them apart (README, `hlotool --help`).
EXIT_OK = 0
EXIT_FINDINGS = 1  # a CI gate fired: `inspect --fail-on-sites`, `--fail-on-memory-growth`
EXIT_BAD_INPUT = 2  # the user's input: script, arguments, target, an output file, HLO text
EXIT_INTERNAL = 3  # a bug in hlotool (or in a library under it): rerun with --debug
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT

# Files hlotool writes carry this (HTML and SVG in a comment at the top; pieces written into
# a directory are listed in `MANIFEST` there), so that hlotool overwrites its own output but
# never a file it did not write.
MARK = "written by hlotool"
MANIFEST = ".hlotool-files"


class HlotoolError(Exception):
    """A problem with the user's input, stated in one line."""

    exit_code = EXIT_BAD_INPUT


class DoesNotFit(HlotoolError):
    """A program too big for the memory of what it is compiled for: a finding about the
    program (the shapes flash attention exists for), not a failure of hlotool."""


def lookup(table, name, what: str, error: type[HlotoolError] = HlotoolError):
    """`table[name]`, or `error` naming the valid names ("unknown target 'tpu-v9'; valid
    targets: cpu, tpu-v5e, ...")."""
    try:
        return table[name]
    except KeyError:
        raise error(f"unknown {what} {name!r}; valid {what}s: {', '.join(table)}") from None


def first_line(error: BaseException) -> str:
    """An exception as one line: its first non-blank line, or its type's name."""
    lines = [ln for ln in str(error).splitlines() if ln.strip()]
    return lines[0].strip() if lines else type(error).__name__


class HloParseError(HlotoolError):
    """Malformed HLO text; the message names line and column."""

    def __init__(self, message: str, line: int, column: int, source_name: str = "<hlo>"):
        self.line = line
        self.column = column
        self.source_name = source_name
        super().__init__(f"{source_name}:{line}:{column}: {message}")


def _listed(path: str) -> bool:
    manifest = os.path.join(os.path.dirname(path), MANIFEST)
    try:
        with open(manifest, encoding="utf-8") as f:
            return os.path.basename(path) in f.read().splitlines()
    except OSError:
        return False


def _marked(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return MARK.encode() in f.read(512)
    except OSError:
        return False


def check_overwrite(path: str, force: bool = False) -> None:
    """Raise unless writing `path` loses nothing: it does not exist, hlotool wrote it, or
    `force`. Called before a script runs (so a refusal costs nothing) and again on writing."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path):
        raise HlotoolError(f"{path} is a directory; name a file")
    if not force and not _marked(path) and not _listed(path):
        raise HlotoolError(f"{path} exists and hlotool did not write it; "
                           "pass --force to overwrite it")


def write_output(path: str, data: str | bytes, *, force: bool = False,
                 listed: bool = False) -> None:
    """Write a file the user asked for; a failure is one line naming the path and the cause.

    listed: record the file in its directory's `MANIFEST` (pieces written into a directory,
    whose formats have no room for `MARK`), so a later run may replace it."""
    check_overwrite(path, force)
    if isinstance(data, str):
        data = data.encode("utf-8")  # reports hold −, ×, → and source paths in any script
    try:
        with open(path, "wb") as out:
            out.write(data)
        if listed and not _listed(path):
            with open(os.path.join(os.path.dirname(path), MANIFEST), "a",
                      encoding="utf-8") as manifest:
                manifest.write(os.path.basename(path) + "\n")
    except OSError as e:
        raise HlotoolError(f"cannot write {path}: {e.strerror or e}") from None
