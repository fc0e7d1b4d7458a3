"""The `hlotool cost` document: per site and target, the native and kernel figures from each
source (analytic, XLA, measured) and the verdict; and a terminal table of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hlotool.cost import xla
from hlotool.cost.measure import measure
from hlotool.cost.model import kernel_for
from hlotool.cost.decision import verdict
from hlotool.errors import HlotoolError
from hlotool.hardware import get_hardware
from hlotool.site import AttentionSite


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
                _seconds(n["seconds"]) + f" {n['bound'][0]}",
                _seconds(k["seconds"]) + f" {k['bound'][0]}" if k else "-",
                _bytes(n["hbm_bytes"]), _bytes(k["hbm_bytes"]) if k else "-",
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
    return f"{_seconds(m['seconds'])} {_bytes(m['peak_rss_bytes'])}"


def _seconds(s: float) -> str:
    for unit, f in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= f:
            return f"{s / f:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _bytes(n: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def _flops(figs: dict[str, Any] | None) -> str:
    if not figs or "flops" not in figs or figs["flops"] is None:
        return "-"
    mark = "*" if figs.get("caveats") else ""
    return f"{figs['flops']:.3g}{mark}"
