"""Memory, native beside rewritten: XLA's `memory_analysis()` of both compiled programs.

    rows = [memory_row(f, rewritten, "tpu-v5e")]   # CapturedFunction native and rewritten
    print(render_memory(rows))
    [r.to_json() for r in rows]
    growth(rows)                                    # rows where the rewrite needs more

A kernel swap that needs more memory than the program it replaces is the failure hlotool
exists to catch (a custom memory path that cost 40% more before anyone noticed): these rows
put the rewritten program's buffers next to the native ones, per function and target, and
`--fail-on-memory-growth` turns growth into a failing exit status.

`memory_analysis()` gives the argument, output, aliased (donated arguments reused for outputs)
and temporary bytes of XLA's buffer assignment; `total` is what that assignment holds at once
at most (arguments + outputs − aliased + temporaries). jaxlib also gives XLA's `peak`, whose
meaning differs by backend (measured with jaxlib 0.10.2): XLA:CPU's counts only arguments and
outputs (8 MiB for a program with 128 MiB of temporaries), XLA:TPU's holds what its
temporaries leave out (79.7 MB for naive attention at L=2048 whose temporaries read 0 B: the
score buffers of XLA's own fusion). Each is a lower bound of what the program needs, so
`needs`, the figure growth is judged on, is the larger of the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hlotool.errors import HlotoolError
from hlotool.report.console import Term, printable
from hlotool.report.table import format_table
from hlotool.units import format_bytes

if TYPE_CHECKING:
    from hlotool.capture import CapturedFunction


@dataclasses.dataclass(frozen=True)
class Memory:
    """One compiled program's buffers, in bytes, as XLA's `memory_analysis()` gives them."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int | None = None  # XLA's own peak where this jaxlib reports it

    @property
    def total(self) -> int:
        """Bytes the program's buffer assignment holds at once at most."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def needs(self) -> int:
        """The figure growth is judged on: the larger of `total` and XLA's peak."""
        return max(self.total, self.peak or 0)

    @classmethod
    def of(cls, compiled: Any) -> Memory | None:
        """From a `jax.stages.Compiled`; None where the backend gives no analysis."""
        try:
            stats = compiled.memory_analysis()
        except Exception:  # some backends raise "unimplemented"
            return None
        if stats is None:
            return None
        peak = getattr(stats, "peak_memory_in_bytes", None)  # not in every jaxlib
        return cls(int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                   int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes),
                   int(peak) if peak else None)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "needs": self.needs}


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Native and rewritten memory of one function on one target; `note` says why a side
    is missing (does not fit the chip, no analysis on this backend)."""

    function: str
    target: str
    native: Memory | None
    rewritten: Memory | None
    note: str = ""
    # Where flash_jit's auto keeps every site native: the kernel the rewritten side runs
    # instead, the one the target's platform would use if it paid (not a rewrite auto makes).
    kernel_if_paid: str | None = None

    @property
    def change(self) -> int | None:
        """Rewritten minus native `needs`; None where a side is missing."""
        if self.native is None or self.rewritten is None:
            return None
        return self.rewritten.needs - self.native.needs

    @property
    def grows(self) -> bool:
        return (self.change or 0) > 0

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "target": self.target,
                "native": self.native.to_json() if self.native else None,
                "rewritten": self.rewritten.to_json() if self.rewritten else None,
                "change_bytes": self.change, "grows": self.grows,
                **({"note": self.note} if self.note else {}),
                **({"kernel_if_paid": self.kernel_if_paid} if self.kernel_if_paid else {})}


def memory_row(native: CapturedFunction, rewritten: CapturedFunction, target: str,
               kernel_if_paid: str | None = None) -> MemoryRow:
    """Compile both programs for `target` (cached on the captures) and compare their memory.
    A program the chip cannot hold is that row's note, not an error. kernel_if_paid: the
    kernel `rewritten` runs where auto kept every site native (see `MemoryRow`)."""
    from hlotool.report.fit import does_not_fit

    sides, notes = [], []
    for label, f in (("native", native), ("rewritten", rewritten)):
        try:
            memory = Memory.of(f.compiled(target))
        except HlotoolError as e:
            finding = does_not_fit(e, target)
            if finding is None:
                raise
            sides.append(None)
            notes.append(label + finding.removeprefix("native"))
            continue
        if memory is None:
            notes.append(f"no memory analysis for {label} on {target}")
        sides.append(memory)
    return MemoryRow(native.name, target, sides[0], sides[1], "; ".join(notes), kernel_if_paid)


def growth(rows: Sequence[MemoryRow]) -> list[MemoryRow]:
    """The rows whose rewritten program needs more memory than the native one (a kernel
    shown only for what it would do, where auto keeps native, is no rewrite that grows)."""
    return [r for r in rows if r.grows and r.kernel_if_paid is None]


def growth_line(row: MemoryRow) -> str:
    """One line naming a growth, for the --fail-on-memory-growth error."""
    assert row.native is not None and row.rewritten is not None
    return (f"{row.function} on {row.target}: rewritten needs "
            f"{format_bytes(row.rewritten.needs)}, native {format_bytes(row.native.needs)} "
            f"(+{format_bytes(row.change or 0)})")


def _bytes(memory: Memory | None, field: str) -> str:
    if memory is None:
        return "-"
    value = getattr(memory, field)
    return "-" if value is None else format_bytes(value)


def _pair(row: MemoryRow, field: str) -> str:
    return f"{_bytes(row.native, field)} → {_bytes(row.rewritten, field)}"


def _change(row: MemoryRow, note: int | None):
    """The change in `needs`, or "-" and the number of the note that says why not."""
    from rich.text import Text

    change = row.change
    if change is None:
        return Text("-" + (f" [{note}]" if note else ""), style="yellow")
    if change == 0:
        return "same"
    ratio = (row.rewritten.needs / row.native.needs) if row.native.needs else 0
    text = (f"+{format_bytes(change)}" if change > 0 else f"−{format_bytes(-change)}") + \
        (f" (×{ratio:.2f})" if ratio else "")
    return Text(text, style="bold red" if change > 0 else "green")


HEADERS = ("function", "target", "arguments", "outputs", "aliased", "temporaries", "XLA peak",
           "needs", "change")


def render_memory(rows: Sequence[MemoryRow], term: Term | None = None) -> str:
    """A table, one row per function and target: each figure as native → rewritten;
    "needs" is the larger of total and XLA's peak, what the change is judged on. A row whose
    rewritten side is only the kernel that would run if it paid has its target marked *,
    and a line under the table says so."""
    term = term or Term()
    if not rows:
        return "no rewritten function to compare"
    # A missing side's reason is a sentence: it goes under the table, once.
    notes = {r.note: None for r in rows if r.change is None and r.note}
    number = {note: n for n, note in enumerate(notes, 1)}
    body = [[printable(r.function), r.target + ("*" if r.kernel_if_paid else ""),
             _pair(r, "arguments"), _pair(r, "outputs"), _pair(r, "aliased"),
             _pair(r, "temporaries"), _pair(r, "peak"), _pair(r, "needs"),
             _change(r, number.get(r.note))] for r in rows]
    # A narrow terminal folds each "native → rewritten" pair after its arrow, then leaves
    # out the figures that rarely differ (--json has them all).
    out = [format_table(HEADERS, body, right_aligned=set(range(2, 9)),
                        wrap={0: 9, 1: 7, **{i: 9 for i in range(2, 8)}, 8: 9},
                        optional=(4, 3, 2, 6), keep={0, 1, 5, 7, 8}, term=term)]
    out += [term.wrap(printable(note), f"[{n}] ", " " * (len(str(n)) + 3))
            for note, n in number.items()]
    kernels = {f"{r.target}: {r.kernel_if_paid}": None for r in rows if r.kernel_if_paid}
    if kernels:
        out.append(term.wrap(
            "* auto keeps these functions native; the rewritten side runs the kernel the "
            f"target's platform would use if it paid ({'; '.join(kernels)}; --kernel NAME "
            "rewrites with it)", "", "  "))
    return "\n".join(out)
