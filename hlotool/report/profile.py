"""`hlotool profile`: native and rewritten programs run on this host under `jax.profiler`, per
site time read from the trace beside the cost model's prediction.

    prof = profile_function(captured, trace_dir, kernel="auto", repeats=3)
    print(render_profile([prof]))
    prof.to_json()

Per function with a site rewritten for the CPU: the native program and flash_jit's, each
compiled for the host and warmed up, then called `repeats` times each, the two in turn, every
call traced by `jax.profiler` into its side's log directory (TRACE_DIR/NNN_jit_NAME/native
and …/rewritten, one run per call: both sides side by side in TensorBoard / XProf). A
rewritten site's time is that of its ops (they carry the site's `hlotool/siteN:FILE:LINE`
scope); a native site's, that of the fusions and calls XLA put its work in, in a train step
its derivative's too (`passes.native`, backward=True). Where ops run side by side on
XLA:CPU's threads they share the time (`cost.trace.busy_seconds`), so a function's sites and
the rest add up to its busy time, never more than its wall time. Every figure is the median
over the calls.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hlotool.errors import HlotoolError, first_line
from hlotool.report.console import Term, printable
from hlotool.report.table import fit_table, format_table
from hlotool.units import format_seconds

if TYPE_CHECKING:
    from hlotool.capture import CapturedFunction
    from hlotool.hardware import Hardware
    from hlotool.site import AttentionSite


@dataclasses.dataclass(frozen=True)
class SiteProfile:
    """One site: seconds per call measured in the trace (native, rewritten) and predicted by
    the cost model for the host (native, kernel). kernel: the CPU's kernel, None where the
    site stays native on the CPU (then both sides run the same equations)."""

    function: str
    index: int  # the N of hlotool/siteN
    source: str
    q_shape: tuple[int, ...]
    kernel: str | None
    native_seconds: float | None
    rewritten_seconds: float | None
    predicted_native_seconds: float
    predicted_kernel_seconds: float

    @property
    def measured_ratio(self) -> float | None:
        if not self.native_seconds or not self.rewritten_seconds:
            return None
        return self.native_seconds / self.rewritten_seconds

    @property
    def predicted_ratio(self) -> float:
        return self.predicted_native_seconds / self.predicted_kernel_seconds

    @property
    def agrees(self) -> bool | None:
        """Whether the measured ratio is within 2× of the predicted one (None: not measured)."""
        measured = self.measured_ratio
        if measured is None:
            return None
        return bool(0.5 <= measured / self.predicted_ratio <= 2.0)

    def disagreement(self) -> str:
        """Which side the cost model misprices, where `agrees` is False: each side's
        measured seconds against its prediction, the further one first."""
        sides = [("the kernel", self.rewritten_seconds, self.predicted_kernel_seconds),
                 ("native", self.native_seconds, self.predicted_native_seconds)]
        sides.sort(key=lambda side: -abs(math.log(side[1] / side[2])))
        return ", ".join(f"{name} took {format_seconds(got)} against {format_seconds(want)} "
                         "predicted" for name, got, want in sides)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["q_shape"] = list(self.q_shape)
        out["measured_ratio"] = self.measured_ratio
        out["predicted_ratio"] = self.predicted_ratio
        out["agrees"] = self.agrees
        return out


@dataclasses.dataclass(frozen=True)
class FunctionProfile:
    """One function: wall seconds and busy seconds (some op running: `busy_seconds`) per
    call of both programs, medians over the calls, its sites, where the traces are, and a
    note where part of it could not be measured."""

    function: str
    repeats: int
    native_wall: float | None = None
    rewritten_wall: float | None = None
    native_ops: float | None = None
    rewritten_ops: float | None = None
    sites: tuple[SiteProfile, ...] = ()
    traces: dict[str, str] = dataclasses.field(default_factory=dict)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["sites"] = [s.to_json() for s in self.sites]
        return out


def _args(f: CapturedFunction) -> list[Any]:
    import jax

    from hlotool.cost.xla import example_arrays

    return example_arrays(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in f.in_avals))


def _predicted(s: Any, host: Hardware | None) -> tuple[float, float, str]:
    """Native and kernel seconds for site report `s` on this host (forward and backward in a
    train step): the prices the CPU's decision rests on, or with `host`'s rates; and, where
    those rates would not have chosen the kernel auto chose, why not."""
    from hlotool import kernels
    from hlotool.cost.decision import verdict

    choice = s.choices.get("cpu")
    cpu_kernel = s.kernels.get("cpu")
    priced = choice.verdict if choice is not None else None
    if host is None and priced is not None and (priced.kernel or not cpu_kernel):
        kernel_seconds = priced.kernel.seconds if cpu_kernel else priced.native.seconds
        return priced.native.seconds, kernel_seconds, ""
    found = None
    if cpu_kernel:  # a kernel asked for by name was not priced: it is priced here alike
        found, _ = kernels.first_taking(s.site, "cpu", kernel=cpu_kernel)
    v = verdict(s.site, host or "cpu", kernel=found, backward=s.trained, check_fusion=False)
    if found is None:
        return v.native.seconds, v.native.seconds, ""
    flipped = ""
    if priced is not None and priced.pays and not v.pays:
        flipped = f"with this run's rates the kernel would not pay ({v.why})"
    return v.native.seconds, v.kernel.seconds, flipped


@functools.cache
def host_rates() -> Hardware | str:
    """This host's `cpu` row measured now (`calibrate_host`, once per process), or why it
    could not be."""
    from hlotool.cost.measure import calibrate_host

    try:
        return calibrate_host()
    except HlotoolError as e:
        return f"calibrating this host failed ({first_line(e)}): predicted with the cpu row"


def profile_function(f: CapturedFunction, trace_dir: str, kernel: str = "auto",
                     repeats: int = 3, calibrate: bool = False) -> FunctionProfile:
    """Trace `f` native and rewritten on the host; see the module docstring. calibrate:
    predict with this host's rates measured in this process (`host_rates`), not the cpu
    row's."""
    import jax

    from hlotool.api import rewrite_captured
    from hlotool.cost.model import fault_seconds, native_faulted_bytes
    from hlotool.cost.trace import TraceUnreadable, busy_seconds, read_events, scope_sites, \
        traced_call
    from hlotool.hardware import get_hardware
    from hlotool.hlo import parse_module

    report, rewritten = rewrite_captured(f, kernel)
    if not report.sites:
        return FunctionProfile(f.name, repeats, note="no attention site")
    if not any(s.kernels.get("cpu") for s in report.sites):
        # The cpu's own verdict: the other platforms' are not what this host would run.
        reasons = "; ".join(dict.fromkeys(s.choices["cpu"].reason if "cpu" in s.choices
                                          else s.reason for s in report.sites))
        return FunctionProfile(f.name, repeats,
                               note=f"flash_jit keeps every site native on the cpu: {reasons}")
    host = host_rates() if calibrate else None
    notes = []
    if isinstance(host, str):
        notes.append(host)
        host = None
    arrays = _args(f)
    programs = {"native": f, "rewritten": rewritten}
    modules = {side: parse_module(program.optimized("cpu")) for side, program in programs.items()}
    owners = {"native": _native_owners(f, report.sites),
              "rewritten": scope_sites(modules["rewritten"])}
    traces = {side: os.path.join(trace_dir, f.file_stem, side) for side in programs}
    compiled = {side: program.compiled("cpu") for side, program in programs.items()}
    for side in programs:
        os.makedirs(traces[side], exist_ok=True)
        jax.block_until_ready(compiled[side](*arrays))  # compiled, first-call costs paid
    # The sides alternate, call by call, so a spell of load on this shared host slows both.
    walls: dict[str, list[float]] = {side: [] for side in programs}
    busy: dict[str, list[dict] | None] = {side: [] for side in programs}
    for call in range(1, repeats + 1):
        for side in programs:
            try:
                seconds, run = traced_call(compiled[side], arrays, traces[side], call)
                walls[side].append(seconds)
                if busy[side] is not None:
                    busy[side].append(busy_seconds(read_events(run), owners[side].get,
                                                   modules[side].name))
            except TraceUnreadable as e:
                if busy[side] is not None:
                    notes.append(f"{side}: {e}")
                busy[side] = None

    def median(side: str, index: int | None = None) -> float | None:
        if not busy[side]:
            return None
        return statistics.median(sum(b.values()) if index is None else b.get(index, 0.0)
                                 for b in busy[side])

    rewritten_sites = [s for s in report.sites if s.kernels.get("cpu")]
    shared = _shared_temporaries(f, [s.site for s in rewritten_sites],
                                 any(s.trained for s in rewritten_sites))
    sites = []
    for index, s in enumerate(report.sites, 1):
        site, cpu_kernel = s.site, s.kernels.get("cpu")
        predicted_native, predicted_kernel, flipped = _predicted(s, host)
        if shared and cpu_kernel and s is not rewritten_sites[0]:
            hw = host or get_hardware("cpu")
            predicted_native -= fault_seconds(native_faulted_bytes(site, hw, s.trained), hw)
        if flipped:
            notes.append(f"site{index}: {flipped}")
        native_s = median("native", index) if index in owners["native"].values() else None
        # A site native on the CPU has no scope of its own in the rewritten program.
        rewritten_s = median("rewritten", index) if cpu_kernel else None
        sites.append(SiteProfile(f.name, index, site.source, tuple(site.q_shape), cpu_kernel,
                                 native_s, rewritten_s, predicted_native, predicted_kernel))
    notes.append(shared)
    wall = {side: statistics.median(seen) if seen else None for side, seen in walls.items()}
    return FunctionProfile(
        f.name, repeats, wall["native"], wall["rewritten"], median("native"),
        median("rewritten"),
        tuple(sites), traces, "; ".join(n for n in notes if n))


def _native_owners(f: CapturedFunction, sites: Sequence[Any]) -> dict[str, int]:
    """Op of `f`'s optimized program → the index of the report site whose work XLA put in
    it (`passes.native`). Native fates come in the HLO's order: they are paired with the
    jaxpr's sites by source line and shape, in order (two layers written by one line are
    two sites)."""
    from hlotool.passes.native import native_fate

    unpaired = native_fate(f, "cpu", backward=True)
    owners = {}
    for index, s in enumerate(sites, 1):
        for i, fate in enumerate(unpaired):
            if (fate.site.source, fate.site.q_shape) == (s.site.source, s.site.q_shape):
                owners.update(dict.fromkeys((p.name for p in fate.placements), index))
                del unpaired[i]
                break
    return owners


def _shared_temporaries(f: CapturedFunction, sites: Sequence[AttentionSite],
                        trained: bool) -> str:
    """Why later sites of one call are predicted without paging: XLA:CPU gives the whole
    call one temporary allocation, smaller than what the sites allocate alone together, so
    they reuse its pages, which the OS maps in once per call where first touched; "" where
    that is not so (a train step keeps each layer's probabilities for its backward)."""
    from hlotool.cost.xla import host_temporaries
    from hlotool.units import format_bytes

    if len(sites) < 2:
        return ""
    alone = [host_temporaries(site, trained) for site in sites]
    temp = getattr(f.compiled("cpu").memory_analysis(), "temp_size_in_bytes", None)
    if None in alone or temp is None or temp >= sum(alone):
        return ""
    return (f"XLA:CPU allocates {format_bytes(temp)} of temporaries for the whole call, less "
            f"than its {len(sites)} sites' {format_bytes(sum(alone))} alone: they reuse one "
            "buffer, whose pages the OS maps in once per call where first touched, so sites "
            "after the first are predicted without paging (their price alone counts it)")


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else format_seconds(seconds)


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"×{ratio:.2f}"


SITE_HEADERS = ("site", "source", "kernel", "native (trace)", "rewritten (trace)", "measured",
                "predicted native", "predicted kernel", "predicted")
FUNCTION_HEADERS = ("function", "native wall", "rewritten wall", "native ops",
                    "rewritten ops", "speed-up (wall)")


def rates_line(host: Hardware | None) -> str:
    """Which rates the predictions use: this run's (`host`) beside the cpu row's, or the
    row's."""
    from hlotool.hardware import get_hardware

    def rates(hw: Hardware) -> str:
        return (f"matmul {hw.peak_flops('float32') / 1e9:.3g} GFLOP/s, softmax "
                f"{hw.softmax_rate / 1e9:.2g} G scores/s, bandwidth "
                f"{hw.hbm_bandwidth / 1e9:.3g} GB/s, fresh pages "
                f"{hw.fresh_page_rate / 1e9:.2g} GB/s")

    row = rates(get_hardware("cpu"))
    if host is None:
        return f"Predicted with the cpu row of hlotool/hardware.py, which auto decides with: {row}."
    return (f"Predicted with this host's rates measured in this run: {rates(host)} (auto "
            f"decides with the cpu row's: {row}).")


def render_profile(profiles: Sequence[FunctionProfile], term: Term | None = None,
                   host: Hardware | None = None) -> str:
    """Per function its wall and op time, then per site measured vs predicted; each
    seconds figure is per call. host: the rates predictions were made with, where measured
    in this run."""
    term = term or Term()
    measured = [p for p in profiles if p.native_wall is not None]
    out = []
    if measured:
        rows = [[printable(p.function), _s(p.native_wall), _s(p.rewritten_wall),
                 _s(p.native_ops), _s(p.rewritten_ops),
                 _ratio(p.native_wall / p.rewritten_wall if p.rewritten_wall else None)]
                for p in measured]
        out.append(format_table(FUNCTION_HEADERS, rows, right_aligned=set(range(1, 6)),
                                wrap={0: 10}, term=term))
        # "attend site1": the function and the N of its hlotool/siteN scope in the trace.
        site_rows = [[f"{printable(s.function)} site{s.index}", printable(s.source or "?"),
                      s.kernel or "native", _s(s.native_seconds), _s(s.rewritten_seconds),
                      _ratio(s.measured_ratio), _s(s.predicted_native_seconds),
                      _s(s.predicted_kernel_seconds), _ratio(s.predicted_ratio)]
                     for p in measured for s in p.sites]
        fitted = fit_table(SITE_HEADERS, site_rows, right_aligned=set(range(3, 9)),
                           wrap={0: 10, 1: 20}, optional=(6, 7, 2), keep={0, 5, 8}, term=term)
        ratios = [t for t in ("measured", "predicted") if t not in fitted.left_out]
        out.append("\n" + term.wrap("Per site, from the trace (seconds per call" + (
            f"; {' and '.join(ratios)}: native ÷ rewritten)" if ratios else ")")))
        out.append(fitted.text)
        off = [s for p in measured for s in p.sites if s.agrees is False]
        if off:
            total = sum(s.agrees is not None for p in measured for s in p.sites)
            worst = max(off, key=lambda s: abs(math.log(s.measured_ratio / s.predicted_ratio)))
            out.append(term.wrap(
                f"Predicted and measured differ by more than 2× at {len(off)} of {total} "
                f"site{'s' if total > 1 else ''}; furthest, {printable(worst.function)} "
                f"site{worst.index} (predicted {_ratio(worst.predicted_ratio)}, measured "
                f"{_ratio(worst.measured_ratio)}): {worst.disagreement()}. " + (
                    "The rates were measured in this run on lone sites: what is left is the "
                    "program around a site, which a per-site price does not see (how XLA "
                    "fuses the site with its neighbours, other work beside the kernel's)."
                    if host else
                    "The cpu row of hlotool/hardware.py holds rates measured on its own host "
                    "(benchmarks/cost_vs_measured.py --calibrate re-measures them here); "
                    "auto's choice on this machine rests on them."), "", "  "))
        out.append(term.wrap(rates_line(host), "", "  "))
    for p in profiles:
        if p.note:
            out.append(term.wrap(f"{printable(p.function)}: {printable(p.note)}", "", "  "))
    return "\n".join(out) if out else "nothing profiled"


def check_trace_dir(path: str, force: bool) -> str:
    """`path` made absolute and created; refused when it holds files hlotool did not put
    there (a user's directory is never written into), unless `force`."""
    from hlotool.errors import MANIFEST

    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise HlotoolError(f"{path} is a file; --trace names a directory")
    if os.path.isdir(path):
        entries = set(os.listdir(path))
        ours = set()
        if MANIFEST in entries:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
                ours = set(f.read().split())
        strangers = entries - ours - {MANIFEST}
        if strangers and not force:
            raise HlotoolError(f"{path} holds files hlotool did not write "
                               f"({', '.join(sorted(strangers)[:3])}); name a new directory "
                               "for --trace, or pass --force")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HlotoolError(f"cannot create trace directory {path}: {e.strerror or e}") from e
    return path


def list_in_manifest(trace_dir: str, names: Sequence[str]) -> None:
    """Record the entries hlotool wrote into `trace_dir`, so a later run may add to it."""
    from hlotool.errors import MANIFEST

    manifest = os.path.join(trace_dir, MANIFEST)
    known = set()
    if os.path.exists(manifest):
        with open(manifest, encoding="utf-8") as f:
            known = set(f.read().split())
    with open(manifest, "a", encoding="utf-8") as f:
        for name in names:
            if name not in known:
                f.write(name + "\n")
