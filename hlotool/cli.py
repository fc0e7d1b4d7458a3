"""The `hlotool` command line: `inspect` and `dump` the programs a JAX script compiles.

Errors the user can fix (a missing script, a script that raises, an unknown target) print
one line to stderr and exit non-zero; ``hlotool --debug`` shows the full traceback.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from hlotool import __version__
from hlotool.doctor import doctor
from hlotool.errors import HlotoolError, write_output
from hlotool.hardware import HARDWARE, get_hardware
from hlotool.report.table import format_table
from hlotool.targets import TARGETS, default_jax_platforms

if TYPE_CHECKING:
    from hlotool.capture import CapturedFunction
    from hlotool.passes.native import NativeFate

STAGE_NAMES = ("jaxpr", "stablehlo", "hlo", "optimized")
# Widest argument list the table shows in full; longer ones (parameter pytrees) are
# abbreviated, and `inspect -v` lists every argument.
_MAX_ARGS_SHOWN = 4
# `inspect --fail-on-sites` exit status when it finds attention (errors exit 2).
_SITES_FOUND = 1

_TARGET_HELP = (
    "Compile target: "
    + ", ".join(f"{t.name} ({t.description})" for t in TARGETS.values())
    + ". TPU targets compile deviceless through libtpu: no TPU needed, nothing runs on one."
)


def _fail_cleanly(command: Callable[..., None]) -> Callable[..., None]:
    """Turn errors into one line on stderr and a non-zero exit; tracebacks only with --debug,
    which each command also takes after its name (`hlotool inspect model.py --debug`)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        debug = (kwargs.pop("debug_here")
                 or click.get_current_context().find_root().params.get("debug", False))
        try:
            command(*args, **kwargs)
        except HlotoolError as e:
            if debug:
                traceback.print_exception(e)
            click.echo(f"hlotool: error: {e}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            if debug:
                raise
            click.echo("hlotool: interrupted", err=True)
            sys.exit(130)
        except Exception as e:
            if debug:
                traceback.print_exception(e)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            click.echo(
                f"hlotool: internal error: {type(e).__name__}: {first} "
                "(rerun with --debug for the traceback)",
                err=True,
            )
            sys.exit(1)

    return click.option("--debug", "debug_here", is_flag=True,
                        help="Show full tracebacks for errors.")(wrapper)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(
    __version__,
    prog_name="hlotool",
    message=f"%(prog)s %(version)s (jax {importlib.metadata.version('jax')})",
)
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def cli(debug: bool) -> None:
    """Find out what XLA makes of the attention in your JAX programs.

    Commands run your script unmodified, as `python model.py` would, and record every
    function JAX compiles while it runs (plain jax.jit, decorators, and the jits flax,
    haiku or equinox create). Eager operations outside jit are not listed.

    Unless JAX_PLATFORMS is set, hlotool sets JAX_PLATFORMS=cpu (cuda,cpu with an NVIDIA
    GPU and jax's CUDA plugin) on a machine with no TPU attached, so that libtpu's start-up
    warnings stay out of the output. TPU targets never need a TPU.
    """


def _script_argument(command: Callable[..., None]) -> Callable[..., None]:
    command = click.argument("script_args", nargs=-1, type=click.UNPROCESSED)(command)
    return click.argument("script", metavar="SCRIPT[:NAME]")(command)


@cli.command(
    epilog="""\b
Examples:
  hlotool inspect examples/causal_decoder.py
  hlotool inspect examples/causal_decoder.py:train_step --target cpu --target tpu-v5e
  hlotool inspect 'examples/flax_model.py:*step' --json
  hlotool inspect examples/padded_encoder.py --fail-on-sites -- --seq-len 256""",
)
@_script_argument
@click.option(
    "--target", "targets", default=("cpu",), multiple=True, show_default=True,
    metavar="NAME", help=_TARGET_HELP + " Repeat it to see XLA's native handling on several.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--fail-on-sites", is_flag=True,
              help=f"Exit with status {_SITES_FOUND} when an attention site is found (for CI).")
@click.option("-v", "--verbose", is_flag=True, help="Also list every argument by name.")
@_fail_cleanly
def inspect(
    script: str, script_args: tuple[str, ...], targets: tuple[str, ...], as_json: bool,
    fail_on_sites: bool, verbose: bool,
) -> None:
    """Run SCRIPT and report every attention site in the functions JAX compiled.

    Per site: function, source line, q/k/v shapes and layout, dtype, heads, scale, mask
    and the bytes of the score matrix the naive program materializes. Then, per --target,
    what XLA does with it natively: the fusions and custom calls of the optimized program
    that hold its work (XLA:TPU's own online-softmax shows here) and the [.., Lq, Lk]
    score buffers that remain. Also lists each function with its arguments and program
    size per stage for the first --target.

    SCRIPT:NAME keeps only functions whose name matches NAME: a glob when NAME contains
    * ? or [ (matched against the whole name), otherwise a substring. Arguments after
    `--` are passed to the script. The script's own output goes to stderr.
    """
    from hlotool.passes.native import native_fates
    from hlotool.passes.from_hlo import detect_captured
    from hlotool.report.sites import render_sites, sites_document
    from hlotool.targets import get_target

    names = [get_target(t).name for t in dict.fromkeys(targets)]
    path, functions = _capture(script, script_args)
    rows = [(f, f.instruction_counts(names[0])) for f in functions]
    sites = detect_captured(functions)
    fates = native_fates(functions, sites, names)
    if as_json:
        doc = sites_document(sites, **_inspect_report(path, names, rows))
        for entry, by_target in zip(doc["sites"], fates):
            entry["native"] = {t: fate.to_json() for t, fate in by_target.items()}
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(
            f"{len(functions)} function{'s' if len(functions) != 1 else ''} compiled by {path} "
            f"(stage sizes for {names[0]}; compile s: as the script ran)"
        )
        click.echo(_function_table(rows, names[0]))
        click.echo(f"\n{len(sites)} attention site{'s' if len(sites) != 1 else ''}")
        if sites:
            click.echo(render_sites(sites))
            click.echo(f"\nWhat XLA does natively ({', '.join(names)}):")
            click.echo(_native_table(fates))
        if verbose:
            for f in functions:
                click.echo(f"\n{f.index} {f.name}  ({f.source or 'source unknown'})")
                arg_names = f.arg_names or [f"arg{i}" for i in range(len(f.in_avals))]
                for name, arg, gone in zip(arg_names, f.args_summary(), f.donated):
                    click.echo(f"    {arg:<20} {name}" + ("  (donated)" if gone else ""))
    if fail_on_sites and sites:
        click.echo(f"hlotool: {len(sites)} attention site{'s' if len(sites) != 1 else ''} "
                   "found (--fail-on-sites)", err=True)
        sys.exit(_SITES_FOUND)


@cli.command(
    short_help="Run SCRIPT and write each compiled function's program at one stage.",
    epilog="""\b
Examples:
  hlotool dump examples/causal_decoder.py --stage hlo -o out/
  hlotool dump examples/causal_decoder.py:forward --stage optimized --target tpu-v5e -o out/
  hlotool dump examples/padded_encoder.py --stage jaxpr -o out/ -- --seq-len 256""",
)
@_script_argument
@click.option(
    "--stage",
    type=click.Choice(STAGE_NAMES),
    required=True,
    help="jaxpr; stablehlo (MLIR); hlo (before optimization, with source locations); "
    "optimized (HLO after XLA's passes for --target).",
)
@click.option(
    "--target", "target", default="cpu", show_default=True, metavar="NAME", help=_TARGET_HELP
)
@click.option(
    "-o",
    "--output",
    "output",
    required=True,
    type=click.Path(file_okay=False),
    help="Directory to write into (created if missing).",
)
@_fail_cleanly
def dump(
    script: str, script_args: tuple[str, ...], stage: str, target: str, output: str
) -> None:
    """Run SCRIPT and write each compiled function's program at one stage.

    One file per function, numbered in the order JAX first compiled them:
    NNN_jit_NAME.jaxpr.txt, NNN_jit_NAME.TARGET.stablehlo.mlir, NNN_jit_NAME.TARGET.hlo.txt
    or NNN_jit_NAME.TARGET.optimized.hlo.txt. SCRIPT:NAME and `--` script arguments work
    as for `inspect`.
    """
    from hlotool.targets import get_target

    compile_target = get_target(target)
    _ensure_writable_dir(output)
    path, functions = _capture(script, script_args)
    for f in functions:
        file = os.path.join(output, f.stage_filename(stage, compile_target))
        write_output(file, f.stage_text(stage, compile_target))
        click.echo(file)
    click.echo(
        f"wrote {len(functions)} file{'s' if len(functions) != 1 else ''} ({stage}, "
        f"{compile_target.name}) for {path}",
        err=True,
    )


def _capture(script: str, script_args: Sequence[str]) -> tuple[str, list[CapturedFunction]]:
    """Split SCRIPT[:NAME], run the script, and keep the functions NAME selects."""
    from hlotool.capture import capture_script, select

    path, pattern = _split_script(script)
    functions = capture_script(path, script_args)
    if pattern:
        functions = select(functions, pattern)
    return path, functions


def _split_script(script: str) -> tuple[str, str | None]:
    """``model.py:train_*`` → (``model.py``, ``train_*``); an existing path is taken whole."""
    if os.path.exists(script) or ":" not in script:
        return script, None
    path, _, pattern = script.rpartition(":")
    if not pattern:
        raise HlotoolError(f"empty function name after ':' in {script!r}")
    return path, pattern


def _ensure_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HlotoolError(f"cannot create output directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise HlotoolError(f"output directory {path} is not writable")


def _args_cell(f: CapturedFunction) -> str:
    args = f.args_summary()
    if len(args) <= _MAX_ARGS_SHOWN:
        return ", ".join(args)
    # Data usually comes last, after parameter pytrees: keep both ends.
    return f"{args[0]}, {args[1]}, …, {args[-1]} ({len(args)} args)"


def _function_table(rows: Sequence[tuple[CapturedFunction, dict[str, int]]], target: str) -> str:
    headers = ["#", "function", "args", "jaxpr", "stablehlo", "hlo", f"opt ({target})", "compile s"]
    body = [
        [
            str(f.index),
            f.name,
            _args_cell(f),
            str(counts["jaxpr"]),
            str(counts["stablehlo"]),
            str(counts["hlo"]),
            str(counts["optimized"]),
            _seconds(f),
        ]
        for f, counts in rows
    ]
    numeric = {0, 3, 4, 5, 6, 7}
    return format_table(headers, body, right_aligned=numeric)


def _seconds(f: CapturedFunction) -> str:
    total = f.lower_seconds + (f.compile_seconds or 0.0)
    return f"{total:.2f}" + ("" if f.compile_seconds is not None else " (lowered only)")


def _inspect_report(
    path: str, targets: Sequence[str], rows: Sequence[tuple[CapturedFunction, dict[str, int]]]
) -> dict[str, Any]:
    """Everything of the inspect document but its version and sites; "instructions" are
    counted for the first target."""
    return {
        "script": path,
        "target": targets[0],
        "targets": list(targets),
        "functions": [
            {
                "index": f.index,
                "name": f.name,
                "source": f.source,
                "args": [
                    {"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                     "donated": gone}
                    for name, a, gone in zip(f.arg_names or [None] * len(f.in_avals),
                                             f.in_avals, f.donated)
                ],
                "instructions": counts,
                "lower_seconds": f.lower_seconds,
                "compile_seconds": f.compile_seconds,
            }
            for f, counts in rows
        ],
    }


def _native_table(fates: Sequence[dict[str, NativeFate]]) -> str:
    rows = [
        [str(i), target, fate.summary(), str(fate.score_buffers)
         + (f" ({fate.score_buffers_on_chip} on chip)" if fate.score_buffers_on_chip else "")]
        for i, by_target in enumerate(fates, 1) for target, fate in by_target.items()
    ]
    return format_table(["#", "target", "fusions and custom calls holding the site",
                         "L×L buffers"], rows, right_aligned={0, 3})


@cli.command(
    short_help="Run SCRIPT and show what the flash rewrite changes in each compiled program.",
    epilog="""\b
Examples:
  hlotool diff examples/causal_decoder.py
  hlotool diff examples/causal_decoder.py --stage optimized --target tpu-v5e -o report.html
  hlotool diff examples/causal_decoder.py:forward --format svg --hops 3 -o pictures/""",
)
@_script_argument
@click.option(
    "--stage",
    type=click.Choice(("hlo", "optimized")),
    default="hlo",
    show_default=True,
    help="hlo: before XLA's passes (the pattern → the kernel call); optimized: after XLA's "
    "passes for --target (which fusions go, which custom calls come).",
)
@click.option(
    "--target", "target", default="cpu", show_default=True, metavar="NAME", help=_TARGET_HELP
)
@click.option("--kernel", default="auto", show_default=True,
              help="Kernel flash_jit uses: auto (per platform) or a name from hlotool.kernels.")
@click.option("--hops", type=click.IntRange(min=0), default=2, show_default=True,
              help="Steps around each changed site drawn in the pictures.")
@click.option("-o", "--output", "output", type=click.Path(),
              help="HTML report file; with --format, the directory for the pieces.")
@click.option("--format", "fmt", type=click.Choice(("svg", "png", "dot", "txt")),
              help="Write pieces instead of one HTML report: each site's native/rewritten "
              "picture (svg, png, dot) or each function's text diff (txt).")
@_fail_cleanly
def diff(script: str, script_args: tuple[str, ...], stage: str, target: str, kernel: str,
         hops: int, output: str | None, fmt: str | None) -> None:
    """Run SCRIPT and diff each compiled function, native vs hlotool.flash_jit.

    Instructions are matched by structure (opcode, shape, operands), not by XLA's names.
    Without -o: one summary line per function and per attention site. -o report.html
    writes one self-contained HTML page (inline SVG; needs graphviz's `dot`) with each
    site's neighbourhood, native and rewritten side by side. SCRIPT:NAME and `--` script
    arguments work as for `inspect`.
    """
    from hlotool.report import render
    from hlotool.targets import get_target

    compile_target = get_target(target)
    if fmt is not None and output is None:
        raise HlotoolError(f"--format {fmt} writes files: name a directory with -o")
    path, functions = _capture(script, script_args)
    diffs, notes = [], []
    for f in functions:
        result = _diff_function(f, stage, compile_target.name, kernel)
        (notes if isinstance(result, str) else diffs).append(result)
    if not diffs:
        click.echo(f"nothing to diff in {path}: " + "; ".join(notes))
        return
    if fmt is not None:
        for file in render.write_pieces(diffs, output, fmt, hops):
            click.echo(file)
    elif output is not None:
        page = render.html_report(diffs, hops, title=f"hlotool diff {os.path.basename(path)}")
        write_output(output, page)
        click.echo(output)
    else:
        click.echo(render.text_summary(diffs), nl=False)
    for note in notes:
        click.echo(f"skipped {note}", err=fmt is not None or output is not None)


def _diff_function(f: CapturedFunction, stage: str, target: str, kernel: str) -> Any:
    """`f` native vs rewritten by flash_jit at `stage`, as a `FunctionDiff`; a one-line
    reason instead when `f` has no attention site."""
    import dataclasses

    import jax
    from jax.extend.core import jaxpr_as_fun

    from hlotool.flash import explain, flash_jit
    from hlotool.passes.diff import FunctionDiff, by_site, diff_modules, site_nodes

    native_pre = f.hlo(target=target)
    sites = site_nodes(native_pre, f.name)
    if not sites:
        return f"{f.name}: no attention site"
    fun = jaxpr_as_fun(f.closed_jaxpr)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in f.in_avals]
    closed = jax.make_jaxpr(flash_jit(fun, kernel=kernel))(*args)
    rewritten = dataclasses.replace(f, closed_jaxpr=closed, _lowered={}, _compiled={})
    if stage == "hlo":
        d = diff_modules(native_pre, rewritten.hlo(target=target))
    else:
        d = diff_modules(f.optimized(target), rewritten.optimized(target))
        sites = [(site, set(), lines) for site, _, lines in sites]
    if d.unchanged:
        report = explain(fun, *args, kernel=kernel)
        reasons = "; ".join(dict.fromkeys(s.reason for s in report.sites))
        return f"{f.name}: flash_jit left every site native ({reasons})"
    return FunctionDiff(f.name, stage, target, d, by_site(d, sites))


@cli.command(
    short_help="Run SCRIPT and rewrite each compiled function's attention with flash_jit.",
    epilog="""\b
Examples:
  hlotool rewrite examples/causal_decoder.py
  hlotool rewrite examples/causal_decoder.py:forward --stage hlo -o out/
  hlotool rewrite examples/flax_model.py --kernel chunked --json -- --seq-len 256""",
)
@_script_argument
@click.option("--kernel", default="auto", show_default=True,
              help="auto (per platform) or a kernel name from hlotool.kernels.")
@click.option("--stage", type=click.Choice(STAGE_NAMES),
              help="With -o: write each rewritten program at this stage.")
@click.option(
    "--target", "target", default="cpu", show_default=True, metavar="NAME", help=_TARGET_HELP
)
@click.option("-o", "--output", "output", type=click.Path(file_okay=False),
              help="Directory for the rewritten programs (created if missing).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@_fail_cleanly
def rewrite(script: str, script_args: tuple[str, ...], kernel: str, stage: str | None,
            target: str, output: str | None, as_json: bool) -> None:
    """Run SCRIPT and rewrite each compiled function as hlotool.flash_jit would.

    Prints, per attention site, the kernel chosen on each platform (cpu, tpu, cuda) or why
    it stays native. --stage with -o writes each rewritten program like `dump`, as
    NNN_jit_NAME.flash.<stage file>. SCRIPT:NAME and `--` script arguments work as for
    `inspect`.
    """
    from hlotool.flash import rewrite_captured
    from hlotool.targets import get_target

    if (stage is None) != (output is None):
        raise HlotoolError("--stage and -o go together: name both to write rewritten programs")
    compile_target = get_target(target)
    if output is not None:
        _ensure_writable_dir(output)
    path, functions = _capture(script, script_args)
    reports = []
    for f in functions:
        report, rewritten = rewrite_captured(f, kernel)
        reports.append(report)
        if output is not None:
            stem, _, rest = f.stage_filename(stage, compile_target).partition(".")
            file = os.path.join(output, f"{stem}.flash.{rest}")
            write_output(file, rewritten.stage_text(stage, compile_target))
            click.echo(file, err=as_json)
    if as_json:
        click.echo(json.dumps({"version": 1, "script": path, "kernel": kernel,
                               "functions": [r.to_json() for r in reports]}, indent=2))
        return
    for report in reports:
        click.echo(str(report))


@cli.command(
    short_help="Run SCRIPT and price each attention site natively and with the flash kernel.",
    epilog="""\b
Examples:
  hlotool cost examples/causal_decoder.py --target tpu-v5e --target h100
  hlotool cost examples/causal_decoder.py:forward --json
  hlotool cost examples/causal_decoder.py --plot cost.svg --target cpu --target h200
  hlotool cost examples/causal_decoder.py --measure""",
)
@_script_argument
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="Chip to price for; repeat for several (default: cpu). One of: "
              + ", ".join(HARDWARE) + ". cpu and the TPU v5e/v5p/v6e also get XLA's own "
              "numbers (TPU compiled deviceless); the others are analytic only.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--backward", is_flag=True, help="Price forward plus backward (training).")
@click.option("--no-xla", is_flag=True, help="Skip XLA's numbers (no compiles: faster).")
@click.option("--measure", is_flag=True,
              help="Also time native and kernel on this host, each in its own process.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write an SVG of predicted time and HBM bytes vs sequence length.")
@_fail_cleanly
def cost(script: str, script_args: tuple[str, ...], targets: tuple[str, ...], as_json: bool,
         backward: bool, no_xla: bool, measure: bool, plot_path: str | None) -> None:
    """Run SCRIPT and price each attention site natively and with the flash kernel.

    Per site and target: the analytic model (FLOPs, HBM bytes, roofline time, compute- or
    memory-bound), XLA's cost_analysis of the naive and kernel programs (* = numbers XLA is
    known to get wrong there; see --json caveats) and the verdict.
    """
    from hlotool.report.cost import cost_report

    targets = tuple(get_hardware(t).name for t in (targets or ("cpu",)))
    path, functions = _capture(script, script_args)
    click.echo(cost_report(path, functions, targets, as_json=as_json, backward=backward,
                           with_xla=not no_xla, measure=measure, plot_path=plot_path))


cli.add_command(doctor)


def main() -> None:
    """Console entry point (``hlotool``, ``python -m hlotool``)."""
    default_jax_platforms()
    cli(prog_name="hlotool")
