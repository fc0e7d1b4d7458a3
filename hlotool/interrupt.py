"""Ctrl-C ends the `hlotool` process within a second, whatever it is doing.

Two things kept it running after "interrupted" (a script training at L=4096, jaxlib 0.10.2:
6 to 50 s at 99% CPU, seen with gdb):
- exiting: jax's atexit hook destroys its CPU client, whose destructor joins the worker
  threads, and they first finish the computation the script dispatched last;
- Python runs a signal handler only between bytecodes of the main thread: a Ctrl-C during a
  long XLA compile waits for the compile.

`arm()`, which the console entry point calls, answers both. The signal's C-level handler
writes to a pipe at once (`signal.set_wakeup_fd`); a thread waiting on that pipe gives the
main thread `GRACE_S` to raise KeyboardInterrupt and report it, then reports it itself.
Either way the process ends with `os._exit` after hlotool's own cleanups (`at_exit`),
skipping the interpreter's teardown and jax's. Without `arm()` (hlotool called in-process,
as the tests do) an interrupt is an ordinary `SystemExit`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

from hlotool.errors import EXIT_INTERRUPTED

# How long the watchdog leaves the main thread to report a Ctrl-C itself.
GRACE_S = 0.5

_cleanups: list[Callable[[], object]] = []
_lock = threading.Lock()
_state = {"armed": False, "reported": False, "handled_here": 0}


def at_exit(fn: Callable[[], object]) -> None:
    """Run `fn` when the process exits, an interrupted one included."""
    atexit.register(fn)
    _cleanups.append(fn)


def arm(report: Callable[[], None]) -> None:
    """Make Ctrl-C end this process within a second: `report` (one line on stderr) once,
    hlotool's cleanups, exit status `EXIT_INTERRUPTED`. Call it from the main thread."""
    if _state["armed"]:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: Python's own handling stays
        return
    _state["armed"] = True
    threading.Thread(target=_watch, args=(read, report), name="hlotool-interrupt",
                     daemon=True).start()


def stop(report: Callable[[], None]) -> NoReturn:
    """Report an interrupt (once, whichever thread comes first) and end the process: at
    once where `arm` was called, else by `SystemExit`."""
    with _lock:
        first = not _state["reported"]
        _state["reported"] = _state["armed"]  # unarmed (in-process), every call reports
    if first:
        if _state["armed"] and _isatty(sys.__stderr__):
            sys.__stderr__.write("\r\x1b[2K")  # over a progress line still on the screen
        report()
    if _state["armed"]:
        _exit(EXIT_INTERRUPTED)
    sys.exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def handled_here() -> Iterator[None]:
    """While the block runs, Ctrl-C is the main thread's alone (a server that stops on it
    and lets the command go on)."""
    _state["handled_here"] += 1
    try:
        yield
    finally:
        _state["handled_here"] -= 1


def _watch(read: int, report: Callable[[], None]) -> None:
    while True:
        if signal.SIGINT not in os.read(read, 64) or _state["handled_here"]:
            continue
        time.sleep(GRACE_S)
        if not _state["handled_here"]:
            stop(report)


def _exit(code: int) -> NoReturn:
    for fn in _cleanups:
        try:
            fn()
        except Exception:  # noqa: BLE001 - leaving anyway; a cleanup must not keep us here
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken pipe
            pass
    if _isatty(sys.__stderr__):
        sys.__stderr__.write("\x1b[?25h")  # a progress line hides the cursor
        sys.__stderr__.flush()
    os._exit(code)


def _isatty(stream: object) -> bool:
    try:
        return stream.isatty()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a replaced stream without isatty or fileno
        return False
