"""Measured per site: a `jax.profiler` trace of a compiled program on this host, its time
shared out among the attention sites.

    seconds, run = traced_call(compiled, arrays, log_dir, call=1)
    by_site = scope_sites(optimized_hlo_text)  # op → hlotool site index (rewritten programs)
    times = busy_seconds(read_events(run), by_site.get)  # site index (None: the rest) → s

XLA:CPU's thunk executor records one trace event per HLO instruction it runs, with the
instruction's name in an `hlo_op` argument. The names are those of the optimized program, so
each event is attributed through that program's instructions: a rewritten site's ops carry
its `hlotool/siteN:FILE:LINE` scope in their op_name metadata; a native site's ops are the
placements `passes.native` found for it. An op run inside another (the body of a while
loop, a fusion's parts) is counted once, in the outer one; ops that run side by side on
XLA:CPU's threads share the instants they overlap (`busy_seconds`).

jax writes the trace under `log_dir/plugins/profile/RUN/` as `HOST.trace.json.gz` (Chrome
trace JSON) and `HOST.xplane.pb` (XSpace). The JSON is read first (plain json); where a jax
writes only the XSpace, `jax.profiler.ProfileData` (jax ≥ 0.4.35) reads it. Neither → a
`TraceUnreadable` with a one-line reason, and callers report wall time only.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from hlotool.errors import HlotoolError
from hlotool.targets import tpu_compiler_loaded


class TraceUnreadable(HlotoolError):
    """A trace was written but this jax's files could not be read back."""


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One HLO op the trace saw run: name, module, thread, start and duration in seconds."""

    op: str
    module: str
    thread: str
    start: float
    seconds: float


class ProfilerUnsafe(HlotoolError):
    """This process cannot start jax's profiler."""


def traced_call(compiled: Any, arrays: Sequence[Any], log_dir: str, call: int
                ) -> tuple[float, str]:
    """One call of `compiled(*arrays)` under `jax.profiler.trace(log_dir)` (warm it up
    first). Returns its wall seconds and its run's directory (`read_events` reads it), kept as
    `log_dir/plugins/profile/STAMP-callN`: the profiler names runs by the second they end,
    and calls a fraction of a second apart would otherwise share one.

    Refuses (`ProfilerUnsafe`) in a process that loaded libtpu: with jax 0.10.2 and libtpu
    0.0.52, starting the profiler there is a segmentation fault (libtpu registers its own
    profiler; measured on this machine, with the device tracer off too). `hlotool profile`
    never compiles for TPU, so its own process is safe."""
    import jax

    if tpu_compiler_loaded():
        raise ProfilerUnsafe(
            "jax.profiler crashes in a process that loaded libtpu (a TPU target was compiled "
            "here): trace in a process of its own, e.g. `hlotool profile SCRIPT`")
    before = set(_runs(log_dir))
    with jax.profiler.trace(log_dir):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*arrays))
        seconds = time.perf_counter() - start
    new = [run for run in _runs(log_dir) if run not in before]
    if not new:
        raise TraceUnreadable(f"no trace under {log_dir}/plugins/profile (jax wrote none)")
    kept = f"{new[-1]}-call{call}"
    os.replace(new[-1], kept)
    return seconds, kept


def _runs(log_dir: str) -> list[str]:
    """The run directories under `log_dir`, oldest first."""
    return sorted(glob.glob(os.path.join(log_dir, "plugins", "profile", "*")),
                  key=os.path.getmtime)


def read_events(where: str) -> list[OpEvent]:
    """The HLO op events of one trace run: `where` is the run's directory, or a log
    directory whose newest run is read."""
    if glob.glob(os.path.join(where, "*.pb")) or glob.glob(os.path.join(where, "*.json.gz")):
        run = where
    elif runs := _runs(where):
        run = runs[-1]
    else:
        raise TraceUnreadable(f"no trace under {where}/plugins/profile (jax wrote none)")
    reasons = []
    for path in sorted(glob.glob(os.path.join(run, "*.trace.json.gz"))):
        try:
            return list(_json_events(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            reasons.append(f"{os.path.basename(path)}: {e}")
    for path in sorted(glob.glob(os.path.join(run, "*.xplane.pb"))):
        try:
            return list(_xspace_events(path))
        except Exception as e:  # a jax without ProfileData, or a format it cannot read
            reasons.append(f"{os.path.basename(path)}: {type(e).__name__}: {e}")
    raise TraceUnreadable(f"cannot read the trace in {run}: "
                          + ("; ".join(reasons) or "neither *.trace.json.gz nor *.xplane.pb"))


def _json_events(path: str) -> Iterable[OpEvent]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        doc = json.load(f)
    for e in doc["traceEvents"]:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args:
            # Chrome trace times are microseconds.
            yield OpEvent(str(args["hlo_op"]), str(args.get("hlo_module", "")),
                          f"{e.get('pid')}/{e.get('tid')}", float(e["ts"]) * 1e-6,
                          float(e.get("dur", 0)) * 1e-6)


def _xspace_events(path: str) -> Iterable[OpEvent]:
    import jax

    profile_data = getattr(jax.profiler, "ProfileData", None)
    if profile_data is None:
        raise TraceUnreadable(f"jax {jax.__version__} has no jax.profiler.ProfileData")
    data = profile_data.from_file(path)
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" in stats:
                    yield OpEvent(str(stats["hlo_op"]), str(stats.get("hlo_module", "")),
                                  f"{plane.name}/{line.name}", e.start_ns * 1e-9,
                                  e.duration_ns * 1e-9)


def outermost(events: Iterable[OpEvent]) -> list[OpEvent]:
    """The events not inside another one on their thread (a while loop's body ops run
    inside the loop's event: the loop counts, they do not, so nothing counts twice)."""
    out = []
    by_thread: dict[str, list[OpEvent]] = collections.defaultdict(list)
    for e in events:
        by_thread[e.thread].append(e)
    for thread_events in by_thread.values():
        end = float("-inf")
        for e in sorted(thread_events, key=lambda x: (x.start, -x.seconds)):
            if e.start >= end:
                out.append(e)
                end = e.start + e.seconds
    return out


def busy_seconds(events: Iterable[OpEvent], owner: Callable[[str], Hashable],
                 module: str | None = None, calls: int = 1) -> dict[Hashable, float]:
    """Seconds per call during which each owner's ops ran (of `module` where given), every
    instant shared equally by the owners running then. `owner` maps an op's name to what it
    is counted for (a site, or None for the rest of the program).

    So each instant counts once: ops side by side on XLA:CPU's threads (part of a loop's
    body may run on another thread than the loop's own event) are not added up, and the
    owners' seconds sum to the time some op ran, at most the call's wall time."""
    chosen = outermost(e for e in events if module is None or e.module == module)
    edges = sorted(((t, step, owner(e.op)) for e in chosen
                    for t, step in ((e.start, 1), (e.start + e.seconds, -1))),
                   key=lambda edge: edge[:2])
    running: collections.Counter = collections.Counter()
    totals: dict[Hashable, float] = collections.defaultdict(float)
    last = None
    for t, step, who in edges:
        if running and last is not None:
            for name in running:
                totals[name] += (t - last) / len(running) / calls
        running[who] += step
        if not running[who]:
            del running[who]
        last = t
    return dict(totals)


def scope_sites(optimized: Any) -> dict[str, int]:
    """Instruction name → hlotool site index, for every instruction of an optimized program
    (a parsed `Module` or its text) whose op_name carries a site's scope."""
    from hlotool.hlo import parse_module
    from hlotool.passes.kernel_calls import SITE_SCOPE

    module = parse_module(optimized) if isinstance(optimized, str) else optimized
    out = {}
    for inst in module.instructions():
        m = SITE_SCOPE.search(inst.metadata.get("op_name", ""))
        if m:
            out[inst.name] = int(m.group(1))
    return out
