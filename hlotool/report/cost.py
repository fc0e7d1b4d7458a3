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

from hlotool.cost import xla
from hlotool.cost.decision import verdict
from hlotool.cost.measure import measure
from hlotool.cost.model import kernel_for
from hlotool.errors import HlotoolError, write_output
from hlotool.hardware import get_hardware
from hlotool.report.table import format_table
from hlotool.site import AttentionSite
from hlotool.units import format_bytes, format_seconds


def cost_report(path: str, functions: Sequence, targets: Sequence[str], *, as_json: bool,
                backward: bool, with_xla: bool, measure: bool, plot_path: str | None) -> str:
    """The `hlotool cost` output for the functions a script compiled: a table, or one JSON
    document with, per site and target, each source's native and kernel figures and the
    verdict. Writes the SVG plot of the first site to `plot_path` when given."""
    from hlotool.passes.from_hlo import detect_captured

    names = tuple(get_hardware(t).name for t in targets)
    sites = detect_captured(functions)
    fused = _fusion_in_program(functions, sites, names) if with_xla and sites else None
    entries = [site_entry(s, names, with_xla=with_xla, with_measure=measure,
                          backward=backward, native_fused=f)
               for s, f in zip(sites, fused or [None] * len(sites))]
    if plot_path and sites:
        _write_plot(plot_path, sites[0], names)
        click.echo(f"wrote {plot_path}", err=True)
    if as_json:
        doc = {"version": 1, "script": path, "backward": backward,
               "hardware": {n: get_hardware(n).to_json() for n in names}, "sites": entries}
        return json.dumps(doc, indent=2)
    if not sites:
        return f"no attention site in the {len(functions)} functions {path} compiled"
    header = (f"{len(sites)} attention site{'s' if len(sites) != 1 else ''} in {path} "
              f"({'forward + backward' if backward else 'forward'}; t: roofline, c/m = "
              "compute/memory-bound)")
    return header + "\n" + format_table(HEADERS, table(entries), right_aligned={2, 3, 4, 5, 6, 7})


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


def _write_plot(path: str, site, names: Sequence[str]) -> None:
    from hlotool.report.cost_plot import series, svg

    title = (f"{site.function or 'site'}: B={site.batch} H={site.num_q_heads} "
             f"D={site.head_dim} {site.dtype} {site.mask}, Lq = Lk swept")
    text = svg([series(site, n) for n in names], title)
    write_output(path, text)
    if not os.path.getsize(path):
        raise HlotoolError(f"wrote nothing to {path}")


def site_entry(site: AttentionSite, targets: Sequence[str], *, with_xla: bool = True,
               with_measure: bool = False, backward: bool = False,
               native_fused: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """One site's entry: per target the verdict (with analytic figures) and XLA's numbers.

    native_fused: per target name, whether the program XLA compiled for it runs this site as
    its own online-softmax call (`hlotool.passes.native`); a target left out is asked with a
    single-site probe when `with_xla`. The entry's `native_fused_from` says where the answer
    came from.
    """
    seen = native_fused or {}
    per_target = {}
    for name in targets:
        hw = get_hardware(name)
        v = verdict(site, hw, backward=backward, native_fused=seen.get(name),
                    check_fusion=with_xla)
        entry: dict[str, Any] = {"verdict": v.to_json()}
        if v.native_fused is not None:
            entry["native_fused_from"] = (
                "the compiled program" if name in seen
                else "a single-site probe" if hw.platform == "tpu"
                else "XLA:CPU has no attention fusion")
        if with_xla and hw.compile_target is not None and v.kernel_name is not None:
            try:
                figs = xla.site_figures(site, hw.compile_target, kernel_for(site, hw))
                entry["xla"] = {side: f.to_json() for side, f in figs.items()}
            except HlotoolError as e:
                entry["xla"] = {"error": str(e)}
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


def table(entries: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Rows: site, target, native/kernel time and HBM bytes, XLA flops per side, verdict."""
    rows = []
    for i, e in enumerate(entries, 1):
        s = e["site"]
        label = f"{i} {s['function'] or '-'} L={s['q_len']}x{s['kv_len']} D={s['head_dim']}"
        for name, t in e["targets"].items():
            v = t["verdict"]
            n, k = v["native"], v["kernel"] or {}
            x = t.get("xla", {})
            rows.append([
                label, name,
                format_seconds(n["seconds"]) + f" {n['bound'][0]}",
                format_seconds(k["seconds"]) + f" {k['bound'][0]}" if k else "-",
                format_bytes(n["hbm_bytes"]), format_bytes(k["hbm_bytes"]) if k else "-",
                _flops(x.get("native")), _flops(x.get("kernel")),
                v["reason"],
            ])
            label = ""
        m = e.get("measured")
        if m:
            cells = [_measured(m.get(side, {})) for side in ("native", "kernel")]
            rows.append(["", "measured (this host)", cells[0], cells[1], "", "", "", "", ""])
    return rows


HEADERS = ["site", "target", "native t", "kernel t", "native HBM", "kernel HBM",
           "XLA flops native", "XLA flops kernel", "verdict"]


def _measured(m: dict[str, Any]) -> str:
    if "error" in m:
        return "skipped"
    return f"{format_seconds(m['seconds'])} {format_bytes(m['peak_rss_bytes'])}"




def _flops(figs: dict[str, Any] | None) -> str:
    if not figs or "flops" not in figs or figs["flops"] is None:
        return "-"
    mark = "*" if figs.get("caveats") else ""
    return f"{figs['flops']:.3g}{mark}"
