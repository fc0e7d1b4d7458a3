"""`hlotool cost SCRIPT --target ...`: does the flash kernel pay here, and by how much?"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import click

from hlotool.errors import HlotoolError, write_output
from hlotool.hardware import get_hardware
from hlotool.table import format_table


def cost_report(path: str, functions: Sequence, targets: Sequence[str], *, as_json: bool,
                backward: bool, with_xla: bool, measure: bool, plot_path: str | None) -> str:
    """The `hlotool cost` output for the functions a script compiled: a table, or one JSON
    document with, per site and target, each source's native and kernel figures and the
    verdict. Writes the SVG plot of the first site to `plot_path` when given."""
    from hlotool.cost.report import HEADERS, site_entry, table
    from hlotool.passes.report import detect_captured

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
    from hlotool.cost.plot import series, svg

    title = (f"{site.function or 'site'}: B={site.batch} H={site.num_q_heads} "
             f"D={site.head_dim} {site.dtype} {site.mask}, Lq = Lk swept")
    text = svg([series(site, n) for n in names], title)
    write_output(path, text)
    if not os.path.getsize(path):
        raise HlotoolError(f"wrote nothing to {path}")
