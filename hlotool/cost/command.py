"""`hlotool cost SCRIPT --target ...`: does the flash kernel pay here, and by how much?

`hlotool/cli.py` registers it: `cli.add_command(command())`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import click

from hlotool.errors import HlotoolError
from hlotool.hardware import HARDWARE, get_hardware

_TARGETS_HELP = ("Chip to price for; repeat for several (default: cpu). One of: "
                 + ", ".join(HARDWARE) + ". cpu and the TPU v5e/v5p/v6e also get XLA's own "
                 "numbers (TPU compiled deviceless); the others are analytic only.")


EPILOG = """\b
Examples:
  hlotool cost examples/causal_decoder.py --target tpu-v5e --target h100
  hlotool cost examples/causal_decoder.py:forward --json
  hlotool cost examples/causal_decoder.py --plot cost.svg --target cpu --target h200
  hlotool cost examples/causal_decoder.py --measure"""


@click.argument("script", metavar="SCRIPT[:NAME]")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--target", "targets", multiple=True, metavar="NAME", help=_TARGETS_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--backward", is_flag=True, help="Price forward plus backward (training).")
@click.option("--no-xla", is_flag=True, help="Skip XLA's numbers (no compiles: faster).")
@click.option("--measure", is_flag=True,
              help="Also time native and kernel on this host, each in its own process.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write an SVG of predicted time and HBM bytes vs sequence length.")
def _cost(script: str, script_args: tuple[str, ...], targets: tuple[str, ...], as_json: bool,
         backward: bool, no_xla: bool, measure: bool, plot_path: str | None) -> None:
    """Run SCRIPT and price each attention site natively and with the flash kernel.

    Per site and target: the analytic model (FLOPs, HBM bytes, roofline time, compute- or
    memory-bound), XLA's cost_analysis of the naive and kernel programs (* = numbers XLA is
    known to get wrong there; see --json caveats) and the verdict.
    """
    from hlotool.cli import _capture, format_table
    from hlotool.cost.report import HEADERS, site_entry, table
    from hlotool.passes.report import detect_captured

    names = tuple(get_hardware(t).name for t in (targets or ("cpu",)))
    path, functions = _capture(script, script_args)
    sites = detect_captured(functions)
    entries = [site_entry(s, names, with_xla=not no_xla, with_measure=measure,
                          backward=backward) for s in sites]
    if plot_path and sites:
        _write_plot(plot_path, sites[0], names)
    if as_json:
        doc = {"version": 1, "script": path, "backward": backward,
               "hardware": {n: get_hardware(n).to_json() for n in names}, "sites": entries}
        click.echo(json.dumps(doc, indent=2))
        return
    if not sites:
        click.echo(f"no attention site in the {len(functions)} functions {path} compiled")
        return
    click.echo(f"{len(sites)} attention site{'s' if len(sites) != 1 else ''} in {path} "
               f"({'forward + backward' if backward else 'forward'}; t: roofline, c/m = "
               "compute/memory-bound)")
    click.echo(format_table(HEADERS, table(entries), right_aligned={2, 3, 4, 5, 6, 7}))
    if plot_path and sites:
        click.echo(f"wrote {plot_path}", err=True)


def command() -> click.Command:
    """The `cost` command, with the CLI's one-line error handling."""
    from hlotool.cli import _fail_cleanly

    return click.command("cost", epilog=EPILOG)(_fail_cleanly(_cost))


def _write_plot(path: str, site, names: Sequence[str]) -> None:
    from hlotool.cost.plot import series, svg

    title = (f"{site.function or 'site'}: B={site.batch} H={site.num_q_heads} "
             f"D={site.head_dim} {site.dtype} {site.mask}, Lq = Lk swept")
    text = svg([series(site, n) for n in names], title)
    try:
        with open(path, "w") as out:
            out.write(text)
    except OSError as e:
        raise HlotoolError(f"cannot write {path}: {e.strerror or e}") from None
    if not os.path.getsize(path):
        raise HlotoolError(f"wrote nothing to {path}")
