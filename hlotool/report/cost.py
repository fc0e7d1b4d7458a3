"""`hlotool cost SCRIPT --target ...`: does the flash kernel pay here, and by how much?

The document: per site and target, the native and kernel figures from each source
(analytic, XLA, measured) and the verdict; and a terminal table of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import click
from rich.text import Text

from hlotool.cost import split, xla
from hlotool import kernels
from hlotool.cost.decision import choose
from hlotool.cost.measure import measure
from hlotool.errors import HlotoolError, write_output
from hlotool.hardware import get_hardware
from hlotool.kernels.sharded import mesh_of
from hlotool.report.console import Term, progress
from hlotool.report.fit import does_not_fit
from hlotool.report.table import fit_table
from hlotool.site import AttentionSite
from hlotool.units import format_bytes, format_seconds


def cost_report(path: str, functions: Sequence, targets: Sequence[str], *, as_json: bool,
                backward: bool, with_xla: bool, measure: bool, plot_path: str | None,
                plot_shown: str | None = None, force: bool = False,
                term: Term | None = None) -> str:
    """The `hlotool cost` output for the functions a script compiled: a table fitted to
    `term`, or one JSON document with, per site and target, each source's native and
    kernel figures and the verdict. Writes the SVG plot (a row of panels per distinct site
    shape) to `plot_path` when given, announcing it as `plot_shown`."""
    from hlotool.passes.from_hlo import detect_captured

    names = tuple(get_hardware(t).name for t in targets)
    with progress(f"finding attention in {len(functions)} function(s)"):
        sites = detect_captured(functions)
        # A function that differentiates a site (a train step) is priced forward and
        # backward, as flash_jit prices it; --backward prices every function so.
        trained = {f.name: backward or _trains(f) for f in functions} if sites else {}
    entries = []
    # One line over all of it: each step may be short, together they are not.
    with progress(f"pricing {len(sites)} site(s) on {', '.join(names)}"):
        with progress(f"compiling {len(functions)} function(s) for XLA:TPU's own fusion"):
            fused = _fusion_in_program(functions, sites, names) if with_xla and sites else None
        meshes = {f.name: _mesh(f) for f in functions}
        for i, (s, f) in enumerate(zip(sites, fused or [None] * len(sites)), 1):
            with progress(f"pricing site {i} of {len(sites)} on {', '.join(names)}"):
                entries.append(site_entry(s, names, with_xla=with_xla, with_measure=measure,
                                          backward=trained.get(s.function, backward),
                                          native_fused=f, mesh=meshes.get(s.function)))
    if plot_path and sites:
        _write_plot(plot_path, sites, names, force, any(trained.values()), with_xla)
        click.echo(f"wrote {plot_shown or plot_path}", err=True)
    if as_json:
        doc = {"version": 1, "script": path, "backward": backward,
               "hardware": {n: get_hardware(n).to_json() for n in names}, "sites": entries}
        return json.dumps(doc, indent=2)
    if not sites:
        return f"no attention site in the {len(functions)} functions {path} compiled"
    term = term or Term()
    training = sorted({name for name, t in trained.items() if t
                       and any(s.function == name for s in sites)})
    priced = ("training (forward and backward pass)" if backward
              else f"inference (forward pass only), {', '.join(training)} for training "
                   "(forward and backward)" if training
              else "inference (forward pass only)")
    rows, notes = table(entries)
    fitted = fit_table(HEADERS, rows, right_aligned={2, 3, 4, 5, 6},
                       wrap={0: 12, 1: 7, 6: 11, 7: 11},
                       optional=(6, 5, 4), keep={0, 1, 7}, term=term)
    # No legend for a column the table left out.
    skipping = any(map(_skips, entries))
    legend = [text for columns, text, shown in (
        (HEADERS[2:4], "t: roofline time; c/m: compute- or memory-bound", True),
        (HEADERS[3:4], "N%: the share of score tiles the kernel computes where the mask's "
                       "band lets it skip the rest", skipping),
        (HEADERS[6:7], "* XLA's number is known to be wrong there (--json says why)", True))
        if shown and not set(columns) <= set(fitted.left_out)]
    header = (f"{len(sites)} attention site{'s' if len(sites) != 1 else ''} in {path}, "
              f"priced for {priced}. {'; '.join(legend)}")
    return "\n".join([term.wrap(header), fitted.text, *(
        term.wrap(f"{note}", f"[{n}] ", " " * (len(str(n)) + 3))
        for n, note in enumerate(notes, 1)), *_split_lines(entries, term)])


def _mesh(function: Any) -> Any:
    """The mesh the script's run split `function` over, or None (run on one device)."""
    return mesh_of((), function.shardings) if function.shardings else None


def _split_lines(entries: Sequence[dict[str, Any]], term: Term) -> list[str]:
    """Per site and target whose sequence the run's mesh splits: all-gather against ring, per
    device, and which pays ("1 cpu: sequence over 8 devices: all-gather … → ring (why)")."""
    lines = [term.wrap(f"{i} {name}: {t['sequence_split']['summary']} "
                       f"({t['sequence_split']['why']})", "", "    ")
             for i, e in enumerate(entries, 1) for name, t in e["targets"].items()
             if "sequence_split" in t]
    if not lines:
        return []
    return ["Sequence split over the run's mesh, per device (all-gather: XLA's native program; "
            "ring: flash_jit's ring attention):", *lines]


def _fusion_in_program(functions: Sequence, sites: Sequence, names: Sequence[str]
                       ) -> list[dict[str, bool]] | None:
    """Per site, for each TPU target XLA can compile here, whether the script's own program
    runs the site as XLA:TPU's online-softmax call: the real program, context and all, rather
    than a probe of the naive formula alone. None when that program holds other sites than
    the host's (the verdict then falls back to the probe)."""
    from hlotool.passes.native import native_fates

    tpu = {hw.name: hw.compile_target for hw in map(get_hardware, names)
           if hw.platform == "tpu" and hw.compile_target}
    if not tpu:
        return None
    try:
        fates = native_fates(functions, sites, sorted(set(tpu.values())))
    except HlotoolError:
        return None
    return [{name: by_target[target].online_softmax for name, target in tpu.items()}
            for by_target in fates]


def _trains(function: Any) -> bool:
    """Whether `function` differentiates any of its sites, as flash_jit sees it (a site it
    cannot read counts as not)."""
    from hlotool.api import rewrite_captured

    try:
        report, _ = rewrite_captured(function)
    except HlotoolError:
        return False
    return any(s.trained for s in report.sites)


def _write_plot(path: str, sites: Sequence[AttentionSite], names: Sequence[str],
                force: bool, backward: bool, with_xla: bool) -> None:
    from hlotool.report.cost_plot import plot

    write_output(path, plot(sites, names, backward=backward, check_fusion=with_xla), force=force)
    if not os.path.getsize(path):
        raise HlotoolError(f"wrote nothing to {path}")


def site_entry(site: AttentionSite, targets: Sequence[str], *, with_xla: bool = True,
               with_measure: bool = False, backward: bool = False,
               native_fused: Mapping[str, bool] | None = None,
               mesh: Any = None) -> dict[str, Any]:
    """One site's entry: per target the verdict (with analytic figures) and XLA's numbers;
    where `mesh` (the run's) splits the site's sequence, all-gather against ring per device
    on the target's chip (`sequence_split`, `hlotool.cost.split`).

    native_fused: per target name, whether the program XLA compiled for it runs this site as
    its own online-softmax call (`hlotool.passes.native`); a target left out is asked with a
    single-site probe when `with_xla`. The entry's `native_fused_from` says where the answer
    came from.
    """
    seen = native_fused or {}
    per_target = {}
    for name in targets:
        hw = get_hardware(name)
        # The one decision every command reads, priced on this target's chip: the fusion it
        # prices is the single-site probe's, which explain and flash_jit ask too; what the
        # script's own program does is reported beside it.
        choice = choose(site, hw.platform, chip=name, backward=backward,
                        check_fusion=with_xla)
        v = choice.verdict
        entry: dict[str, Any] = {"verdict": v.to_json(), "backward": backward}
        if v.native_fused is not None:
            entry["native_fused_from"] = ("a single-site probe" if hw.platform == "tpu"
                                          else "XLA:CPU has no attention fusion")
        if name in seen:
            entry["native_fused_in_program"] = seen[name]
        priced = split.on_mesh(mesh, site, chip=name, backward=backward) if mesh else None
        if priced is not None:
            entry["sequence_split"] = priced.to_json()
        if with_xla and hw.compile_target is not None and v.kernel_name is not None:
            try:
                figs = xla.site_figures(site, hw.compile_target,
                                        kernels.registered(v.kernel_name))
                entry["xla"] = {side: f.to_json() for side, f in figs.items()}
            except HlotoolError as e:
                too_big = does_not_fit(e, name)
                if too_big:
                    entry["does_not_fit"] = too_big
                entry["xla"] = {"error": too_big or str(e)}
        elif with_xla:
            entry["xla"] = {"error": f"no compiler for {name} on this machine: analytic only"}
        per_target[name] = entry
    out: dict[str, Any] = {"site": site.to_json(), "targets": per_target}
    if with_measure:
        out["measured"] = {}
        for side in ("native", "kernel"):
            try:
                out["measured"][side] = measure(site, side, min_seconds=0.5).to_json()
            except HlotoolError as e:
                out["measured"][side] = {"error": str(e)}
    return out


def table(entries: Sequence[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    """Rows: site, target, native/kernel time and HBM bytes, XLA flops per side, verdict
    (green where the kernel pays); and the verdicts' reasons, each once, which the verdict
    cells refer to by number ("keep native [1]"): one short-sequence reason holds for every
    target and every site of one shape."""
    rows, notes = [], {}
    for i, e in enumerate(entries, 1):
        s = e["site"]
        label = f"{i} {s['function'] or '-'} L={s['q_len']}x{s['kv_len']} D={s['head_dim']}"
        for name, t in e["targets"].items():
            v = t["verdict"]
            n, k = v["native"], v["kernel"] or {}
            x = t.get("xla", {})
            decision = v["decision"]
            why = "; ".join(filter(None, (t.get("does_not_fit"), v["why"])))
            ref = f" [{notes.setdefault(why, len(notes) + 1)}]" if why else ""
            rows.append([
                label, name,
                format_seconds(n["seconds"]) + f" {n['bound'][0]}",
                format_seconds(k["seconds"]) + f" {k['bound'][0]}{_skipping(k)}" if k else "-",
                format_bytes(n["hbm_bytes"]), format_bytes(k["hbm_bytes"]) if k else "-",
                f"{_flops(x.get('native'))} / {_flops(x.get('kernel'))}",
                Text(decision + ref, style="green" if v["pays"] else ""),
            ])
            label = ""
        m = e.get("measured")
        if m:
            cells = [_measured(m.get(side, {})) for side in ("native", "kernel")]
            rows.append(["", "measured (this host)", cells[0], cells[1], "", "", "", ""])
    return rows, list(notes)


HEADERS = ["site", "target", "native t", "kernel t", "native HBM", "kernel HBM",
           "XLA flops native / kernel", "verdict"]


def _skipping(kernel: dict[str, Any]) -> str:
    """" 38%" where the kernel's band lets it compute only that share of the score tiles."""
    blocks = kernel.get("score_blocks")
    if not blocks or not blocks["skipped"]:
        return ""
    return f" {100 * blocks['computed'] / blocks['total']:.0f}%"


def _skips(entry: dict[str, Any]) -> bool:
    return any(_skipping(t["verdict"]["kernel"] or {}) for t in entry["targets"].values())


def _measured(m: dict[str, Any]) -> str:
    if "error" in m:
        return "skipped"
    return f"{format_seconds(m['seconds'])} {format_bytes(m['peak_rss_bytes'])}"


def _flops(figs: dict[str, Any] | None) -> str:
    if not figs or "flops" not in figs or figs["flops"] is None:
        return "-"
    mark = "*" if figs.get("caveats") else ""
    return f"{figs['flops']:.3g}{mark}"
