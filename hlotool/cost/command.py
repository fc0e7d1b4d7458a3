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
    entries = [site_entry(s, names, with_xla=with_xla, with_measure=measure,
                          backward=backward) for s in sites]
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


def _write_plot(path: str, site, names: Sequence[str]) -> None:
    from hlotool.cost.plot import series, svg

    title = (f"{site.function or 'site'}: B={site.batch} H={site.num_q_heads} "
             f"D={site.head_dim} {site.dtype} {site.mask}, Lq = Lk swept")
    text = svg([series(site, n) for n in names], title)
    write_output(path, text)
    if not os.path.getsize(path):
        raise HlotoolError(f"wrote nothing to {path}")
