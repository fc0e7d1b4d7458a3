"""The `hlotool` command line: inspect, dump, cost, rewrite and diff the programs a JAX
script compiles.

Errors the user can fix (a missing script, a script that raises, an unknown target) print
one line to stderr and exit with `EXIT_BAD_INPUT`; ``hlotool --debug`` shows the full
traceback. Output paths are resolved before the script runs (it may `os.chdir`) and never
replace a file hlotool did not write, unless --force.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from hlotool import __version__, interrupt
from hlotool.doctor import doctor
from hlotool.errors import (
    EXIT_BAD_INPUT, EXIT_FINDINGS, EXIT_INTERNAL, EXIT_INTERRUPTED, HlotoolError,
    check_overwrite, first_line, write_output,
)
from hlotool.hardware import HARDWARE, get_hardware
from hlotool.report.console import Term, printable, progress
from hlotool.report.table import format_table
from hlotool.targets import TARGETS, default_jax_platforms, load_tpu_compiler

if TYPE_CHECKING:
    from hlotool.capture import CapturedFunction
    from hlotool.passes.native import NativeFate
    from hlotool.targets import Target

STAGE_NAMES = ("jaxpr", "stablehlo", "hlo", "optimized")
# Widest argument list the table shows in full; longer ones (parameter pytrees) are
# abbreviated, and `inspect -v` lists every argument.
_MAX_ARGS_SHOWN = 4

_EXIT_CODES = f"""\b
Exit status:
  {0}    success
  {EXIT_FINDINGS}    findings: `inspect --fail-on-sites` found naive attention, or
       `rewrite`/`diff --fail-on-memory-growth` a rewrite that needs more memory
  {EXIT_BAD_INPUT}    bad input: the script, an argument, a target, an output file
  {EXIT_INTERNAL}    internal error in hlotool (rerun with --debug, please report it)
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C)"""

_MEMORY_GROWTH_HELP = (
    f"Exit with status {EXIT_FINDINGS} when a rewritten program needs more memory than the "
    "native one on any target: by XLA's memory_analysis, the larger of its peak and "
    "arguments + outputs − aliased + temporaries; for CI.")


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
            _error(f"error: {e}")
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            if debug:
                raise
            interrupt.stop(_report_interrupt)
        except Exception as e:
            if debug:
                traceback.print_exception(e)
            first = first_line(e)
            _error(f"internal error: {type(e).__name__}: {first} "
                   "(rerun with --debug for the traceback)")
            sys.exit(EXIT_INTERNAL)

    return click.option("--debug", "debug_here", is_flag=True,
                        help="Show full tracebacks for errors.")(wrapper)


def _report_interrupt() -> None:
    _error("interrupted")


def _error(message: str) -> None:
    term = Term.of(sys.stderr)
    click.echo(term.style("hlotool:", "bold red") + " " + printable(message), err=True,
               color=term.color)


def _echo(text: str, term: Term, err: bool = False) -> None:
    """Print report text made for `term` (ANSI colour only where `term` has it)."""
    click.echo(text, err=err, color=term.color)


class _ScriptCommand(click.Command):
    """A command taking SCRIPT [-- ARGS]: an option it does not know is most likely the
    script's own, so the error says where those go."""

    def invoke(self, ctx: click.Context) -> Any:
        # Each command imports jax (a second, holding the GIL) before it runs the script:
        # a line says so at once, on a terminal, rather than nothing for two seconds.
        with progress("loading jax", after=0):
            import hlotool.capture  # noqa: F401
        return super().invoke(ctx)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            e.message = (f"{e.message.rstrip('.')}; options for the script go after `--`: "
                         f"hlotool {ctx.info_name} SCRIPT -- {e.option_name} …")
            raise


class _Group(click.Group):
    """The `hlotool` group: click's usage errors, too, are one line and `EXIT_BAD_INPUT`."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            return super().main(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            sys.exit(EXIT_BAD_INPUT)
        except click.UsageError as e:
            command = e.ctx.command_path if e.ctx else "hlotool"
            _error(f"error: {e.format_message().rstrip('.')} (see `{command} --help`)")
            sys.exit(EXIT_BAD_INPUT)
        except click.ClickException as e:
            _error(f"error: {e.format_message()}")
            sys.exit(e.exit_code)
        except click.Abort:
            interrupt.stop(_report_interrupt)


@click.group("hlotool", cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=_EXIT_CODES)
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
    warnings stay out of the output. TPU targets never need a TPU. libtpu's log files go to
    a temporary directory hlotool removes (unless TPU_LOG_DIR is set).

    Tables fit the terminal's width (--json has every field in full); colour on a terminal
    only, never with NO_COLOR set.
    """
    _private_libtpu_logs()


_LIBTPU_LOGS: list[str] = []


def _private_libtpu_logs() -> None:
    """Point libtpu's log files (a tpu_logs/ directory under the system temp dir, never
    cleaned) at a temporary directory removed when the process exits. libtpu reads
    TPU_LOG_DIR once, when it loads, so one directory serves the whole process."""
    if "TPU_LOG_DIR" in os.environ and not _LIBTPU_LOGS:
        return  # the user's choice
    if not _LIBTPU_LOGS:
        _LIBTPU_LOGS.append(tempfile.mkdtemp(prefix="hlotool-libtpu-logs-"))
        interrupt.at_exit(functools.partial(shutil.rmtree, _LIBTPU_LOGS[0], True))
    os.environ["TPU_LOG_DIR"] = _LIBTPU_LOGS[0]


def _script_argument(command: Callable[..., None]) -> Callable[..., None]:
    command = click.argument("script_args", nargs=-1, type=click.UNPROCESSED)(command)
    return click.argument("script", metavar="SCRIPT[:NAME]")(command)


def _force_option(command: Callable[..., None]) -> Callable[..., None]:
    return click.option("--force", is_flag=True,
                        help="Overwrite output files that hlotool did not write.")(command)


def _check_kernel(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """Reject an unknown kernel name before the script runs, not after."""
    from hlotool import kernels

    if value != "auto" and value not in kernels.names():
        raise click.BadParameter(
            f"no kernel named {value!r}; known: auto, {', '.join(kernels.names())}")
    return value


def _kernel_option(help_text: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    return click.option("--kernel", default="auto", show_default=True, callback=_check_kernel,
                        help=help_text)


@cli.command(
    cls=_ScriptCommand,
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
              help=f"Exit with status {EXIT_FINDINGS} when an attention site is found (for "
              f"CI; errors exit {EXIT_BAD_INPUT} or {EXIT_INTERNAL}).")
@click.option("-v", "--verbose", is_flag=True, help="Also list every argument by name.")
@click.option("--why-not", is_flag=True,
              help="Also list near misses: an exp between two dots that is not attention, with "
              "its source line and the first rule it breaks (a where(mask, p, 0) after the "
              "softmax, tanh soft-capping, a head mask, ...).")
@_fail_cleanly
def inspect(
    script: str, script_args: tuple[str, ...], targets: tuple[str, ...], as_json: bool,
    fail_on_sites: bool, verbose: bool, why_not: bool,
) -> None:
    """Run SCRIPT and report every attention site in the functions JAX compiled.

    Per site: function, source line, q/k/v shapes and layout, dtype, heads, scale, mask
    and the bytes of the score matrix the naive program materializes. Then, per --target,
    what XLA does with it natively: the fusions and custom calls of the optimized program
    that hold its work (XLA:TPU's own online-softmax shows here) and the [.., Lq, Lk]
    score buffers that remain; a program too big for a TPU's HBM is reported as that
    finding. Calls the program already makes into an attention kernel (hlotool's own
    rewrite, jax's Pallas flash/splash/mha, cuDNN fused attention, tokamax) are listed per
    --target as "already a kernel" with their shapes (--json: "kernels"). Also lists each
    function with its arguments and program size per stage for the first --target.

    SCRIPT:NAME keeps only functions whose name matches NAME: a glob when NAME contains
    * ? or [ (matched against the whole name), otherwise a substring. Arguments after
    `--` are passed to the script. The script's own output goes to stderr.
    """
    from hlotool.passes.from_hlo import detect_hlo, near_misses_hlo
    from hlotool.passes.kernel_calls import kernel_calls_captured
    from hlotool.report.sites import (
        render_kernel_calls, render_near_misses, render_sites, sites_document,
    )
    from hlotool.targets import get_target

    names = [get_target(t).name for t in dict.fromkeys(targets)]
    path, functions = _capture(script, script_args)
    with progress(f"finding attention in {len(functions)} function"
                  f"{'s' if len(functions) != 1 else ''}"):
        # Detected in the first target's program: a function that calls a TPU kernel lowers
        # for TPU only (a Pallas TPU call has no CPU lowering outside interpret mode).
        programs = [(f, f.hlo(debug_info=True, target=names[0])) for f in functions]
        sites = [s for f, text in programs for s in detect_hlo(text, f.name)]
        misses = [m for f, text in programs for m in near_misses_hlo(text, f.name)] \
            if why_not else []
        calls = [c for t in names for c in kernel_calls_captured(functions, t)]
        with_sites = {s.function for s in sites}
        failed = _compile(functions, names, lambda f, t: t == names[0] or f.name in with_sites)
        rows = [(f, _instruction_counts(f, names[0], failed)) for f in functions]
        fates = _native_fates(functions, sites, names, failed)
    term = Term.of()
    if as_json:
        doc = sites_document(sites, kernels=[c.to_json() for c in calls],
                             **_inspect_report(path, names, rows))
        for entry, by_target in zip(doc["sites"], fates):
            entry["native"] = {t: fate if isinstance(fate, dict) else fate.to_json()
                               for t, fate in by_target.items()}
        if why_not:
            doc["near_misses"] = [m.to_json() for m in misses]
        click.echo(json.dumps(doc, indent=2))
    else:
        out = [term.wrap(
            f"{len(functions)} function{'s' if len(functions) != 1 else ''} compiled by "
            f"{printable(path)} (stage sizes for {names[0]}; compile s: as the script ran)"),
            _function_table(rows, names[0], term),
            f"\n{len(sites)} attention site{'s' if len(sites) != 1 else ''}"]
        if sites:
            out += [render_sites(sites, term), f"\nWhat XLA does natively ({', '.join(names)}):",
                    _native_table(fates, term)]
        if calls:
            out += [f"\n{len(calls)} call{'s' if len(calls) != 1 else ''} already in an "
                    f"attention kernel ({', '.join(names)})", render_kernel_calls(calls, term)]
        if why_not:
            out += [f"\n{len(misses)} near miss{'es' if len(misses) != 1 else ''} (almost "
                    "attention, not detected)", render_near_misses(misses, term)]
        if verbose:
            for f in functions:
                out.append(f"\n{f.index} {printable(f.name)}  "
                           f"({printable(f.source or 'source unknown')})")
                arg_names = f.arg_names or [f"arg{i}" for i in range(len(f.in_avals))]
                for name, arg, gone in zip(arg_names, f.args_summary(), f.donated):
                    out.append(f"    {arg:<20} {printable(name)}"
                               + ("  (donated)" if gone else ""))
        _echo("\n".join(out), term)
    if fail_on_sites and sites:
        _error(f"{len(sites)} attention site{'s' if len(sites) != 1 else ''} found "
               "(--fail-on-sites)")
        sys.exit(EXIT_FINDINGS)


def _compile(functions: Sequence[CapturedFunction], targets: Sequence[str],
             wanted: Callable[[CapturedFunction, str], bool]) -> dict[tuple[int, str], str]:
    """Compile each wanted (function, target) pair, with a progress line for slow ones.
    Returns the pairs whose program does not fit the chip's HBM, each with that finding;
    any other failure is raised."""
    from hlotool.report.fit import does_not_fit

    failed = {}
    for t in targets:
        for f in functions:
            if not wanted(f, t):
                continue
            with progress(f"compiling {f.name} for {t}"):
                try:
                    f.compiled(t)
                except HlotoolError as e:
                    finding = does_not_fit(e, t)
                    if finding is None:
                        raise
                    failed[(f.index, t)] = finding
    return failed


def _instruction_counts(f: CapturedFunction, target: str,
                        failed: dict[tuple[int, str], str]) -> dict[str, int | None]:
    """Program size per stage; no optimized count where the compile did not fit."""
    if (f.index, target) not in failed:
        return f.instruction_counts(target)
    # The lowered stages exist; only XLA's compile failed.
    from hlotool.capture import _count_eqns, _count_hlo, _count_mlir_ops

    return {"jaxpr": _count_eqns(f.closed_jaxpr.jaxpr),
            "stablehlo": _count_mlir_ops(f.lowered(target)),
            "hlo": _count_hlo(f.hlo(debug_info=False, target=target)), "optimized": None}


def _native_fates(functions: Sequence[CapturedFunction], sites: Sequence, targets: Sequence[str],
                  failed: dict[tuple[int, str], str]) -> list[dict[str, Any]]:
    """Per site, per target: its `NativeFate`, or, where the function's program does not
    fit the chip, `{"target", "error", "does_not_fit": True}`."""
    from hlotool.passes.native import native_fates

    out: list[dict[str, Any]] = [{} for _ in sites]
    for t in targets:
        too_big = {f.name: failed[(f.index, t)] for f in functions if (f.index, t) in failed}
        fitting = [i for i, s in enumerate(sites) if s.function not in too_big]
        fates = native_fates([f for f in functions if f.name not in too_big],
                             [sites[i] for i in fitting], [t])
        for i, fate in zip(fitting, fates):
            out[i][t] = fate[t]
        for i, s in enumerate(sites):
            if s.function in too_big:
                out[i][t] = {"target": t, "error": too_big[s.function], "does_not_fit": True}
    return out


@cli.command(
    cls=_ScriptCommand,
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
@_force_option
@_fail_cleanly
def dump(
    script: str, script_args: tuple[str, ...], stage: str, target: str, output: str,
    force: bool,
) -> None:
    """Run SCRIPT and write each compiled function's program at one stage.

    One file per function, numbered in the order JAX first compiled them:
    NNN_jit_NAME.jaxpr.txt, NNN_jit_NAME.TARGET.stablehlo.mlir, NNN_jit_NAME.TARGET.hlo.txt
    or NNN_jit_NAME.TARGET.optimized.hlo.txt. SCRIPT:NAME and `--` script arguments work
    as for `inspect`. A file of that name that hlotool did not write is kept (the command
    stops) unless --force.
    """
    from hlotool.targets import get_target

    compile_target = get_target(target)
    directory = _output_dir(output)
    path, functions = _capture(script, script_args)
    for f in functions:
        name = f.stage_filename(stage, compile_target)
        with progress(f"{stage} of {f.name} for {compile_target.name}"):
            text = f.stage_text(stage, compile_target)
        write_output(os.path.join(directory, name), text, force=force, listed=True)
        click.echo(printable(os.path.join(output, name)))
    click.echo(
        f"wrote {len(functions)} file{'s' if len(functions) != 1 else ''} ({stage}, "
        f"{compile_target.name}) for {printable(path)}",
        err=True,
    )


def _capture(script: str, script_args: Sequence[str], *, tpu_compiler: bool = False
             ) -> tuple[str, list[CapturedFunction]]:
    """Split SCRIPT[:NAME], run the script, and keep the functions NAME selects.
    tpu_compiler: load libtpu first, so that every site's decision probes XLA:TPU's own fusion
    alike (the deciding commands; not `profile`: jax.profiler crashes in a process that loaded
    it)."""
    path, pattern = _split_script(script)
    running = f"running {os.path.basename(path)}"

    def compiling(name: str) -> None:
        line.update(f"{running} (last compiled: {name})")

    # At once: importing jax alone takes a second, and the script is why hlotool runs.
    with progress(running, after=0) as line:
        from hlotool.capture import capture_script, select

        if tpu_compiler:
            load_tpu_compiler()

        functions = capture_script(path, script_args, on_compile=compiling)
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


def _output_dir(path: str) -> str:
    """`path` made absolute (the script may chdir) and created, before the script runs."""
    path = os.path.abspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HlotoolError(f"cannot create output directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise HlotoolError(f"output directory {path} is not writable")
    return path


def _output_file(path: str, force: bool) -> str:
    """`path` made absolute (the script may chdir), refused now if hlotool may not
    replace it or its directory is missing or not writable: before the script runs, not
    after it (a long run's results would be lost)."""
    check_overwrite(path, force)
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise HlotoolError(f"no such directory: {folder} (for {path}); create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise HlotoolError(f"directory {folder} is not writable (for {path})")
    return path


def _args_cell(f: CapturedFunction) -> str:
    args = f.args_summary()
    if len(args) <= _MAX_ARGS_SHOWN:
        return ", ".join(args)
    # Data usually comes last, after parameter pytrees: keep both ends.
    return f"{args[0]}, {args[1]}, …, {args[-1]} ({len(args)} args)"


def _function_table(rows: Sequence[tuple[CapturedFunction, dict[str, int | None]]],
                    target: str, term: Term | None = None) -> str:
    headers = ["#", "function", "args", "jaxpr", "stablehlo", "hlo", f"opt ({target})", "compile s"]
    body = [
        [
            str(f.index),
            f.name,
            _args_cell(f),
            str(counts["jaxpr"]),
            str(counts["stablehlo"]),
            str(counts["hlo"]),
            "too big" if counts["optimized"] is None else str(counts["optimized"]),
            _seconds(f),
        ]
        for f, counts in rows
    ]
    numeric = {0, 3, 4, 5, 6, 7}
    return format_table(headers, body, right_aligned=numeric, wrap={1, 2}, optional=(4, 5),
                        term=term)


def _seconds(f: CapturedFunction) -> str:
    total = f.lower_seconds + (f.compile_seconds or 0.0)
    return f"{total:.2f}" + ("" if f.compile_seconds is not None else " (lowered only)")


def _inspect_report(
    path: str, targets: Sequence[str],
    rows: Sequence[tuple[CapturedFunction, dict[str, int | None]]],
) -> dict[str, Any]:
    """Everything of the inspect document but its version and sites; "instructions" are
    counted for the first target (optimized: null where the program does not fit)."""
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


def _native_table(fates: Sequence[dict[str, NativeFate | dict[str, Any]]],
                  term: Term | None = None) -> str:
    from rich.text import Text

    rows = []
    split = any(not isinstance(f, dict) and f.collectives
                for by_target in fates for f in by_target.values())
    for i, by_target in enumerate(fates, 1):
        for target, fate in by_target.items():
            if isinstance(fate, dict):
                rows.append([str(i), target, Text(fate["error"], style="bold yellow"), "-"]
                            + ["-"] * split)
                continue
            where = target + (f" ({fate.partitions} devices)" if fate.partitions > 1 else "")
            rows.append([str(i), where, fate.summary(), str(fate.score_buffers) + (
                f" ({fate.score_buffers_on_chip} on chip)" if fate.score_buffers_on_chip
                else "")] + [fate.collectives_summary() or (
                    "none" if fate.partitions > 1 else "compiled for one device")] * split)
    # Only a program split over devices has collectives: the column is there for one.
    headers = ["#", "target", "fusions and custom calls holding the site", "L×L buffers"]
    return format_table(headers + ["collectives"] * split, rows, right_aligned={0, 3},
                        wrap={2, 4}, term=term)


@cli.command(
    cls=_ScriptCommand,
    short_help="Run SCRIPT and show what the flash rewrite changes in each compiled program.",
    epilog="""\b
Examples:
  hlotool diff examples/causal_decoder.py
  hlotool diff examples/causal_decoder.py -o report.html
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
@_kernel_option("Kernel flash_jit uses: auto (the cost model's choice per platform) or a "
                "name from hlotool.kernels. Where auto keeps native, the diff shows the "
                "kernel the target's platform would use if it paid, under auto's verdict.")
@click.option("--hops", type=click.IntRange(min=0), default=1, show_default=True,
              help="Steps around each changed site drawn in the pictures.")
@click.option("-o", "--output", "output", type=click.Path(),
              help="HTML report file; with --format, the directory for the pieces.")
@click.option("--format", "fmt", type=click.Choice(("svg", "png", "dot", "txt",
                                                    "model-explorer")),
              help="Write pieces instead of one HTML report: each site's native/rewritten "
              "picture (svg, png, dot), each function's text diff (txt), or both programs "
              "as Model Explorer graphs with change, FLOPs and bytes overlays "
              "(model-explorer: native.json, rewritten.json, NAME.OVERLAY.json).")
@click.option("--open", "open_viewer", is_flag=True,
              help="With --format model-explorer: start Model Explorer on localhost with "
              "both graphs (pip install \"hlotool[explorer]\"); Ctrl-C stops it.")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True,
              help="With --open: Model Explorer's port.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout: per function the change counts and "
              "the memory of both programs.")
@click.option("--fail-on-memory-growth", is_flag=True, help=_MEMORY_GROWTH_HELP)
@_force_option
@_fail_cleanly
def diff(script: str, script_args: tuple[str, ...], stage: str, target: str, kernel: str,
         hops: int, output: str | None, fmt: str | None, open_viewer: bool, port: int,
         as_json: bool, fail_on_memory_growth: bool, force: bool) -> None:
    """Run SCRIPT and diff each compiled function, native vs hlotool.flash_jit.

    Instructions are matched by structure (opcode, shape, operands), not by XLA's names.
    Without -o: one summary line per function and per attention site. -o report.html
    writes one self-contained HTML page (inline SVG, laid out by hlotool itself) that opens
    on each site's neighbourhood, native and rewritten side by side at one scale; a kernel
    is one box there, its inside drawn below on demand (only PNG pieces need graphviz's
    `dot`). Each diffed function's memory, native → rewritten on --target (XLA's
    memory_analysis), follows the summary (--json: under "memory"). SCRIPT:NAME and `--`
    script arguments work as for `inspect`.
    """
    from hlotool.report import render
    from hlotool.report.memory import memory_row, render_memory
    from hlotool.targets import get_target

    compile_target = get_target(target)
    if fmt is not None and output is None:
        raise HlotoolError(f"--format {fmt} writes files: name a directory with -o")
    if open_viewer and fmt != "model-explorer":
        raise HlotoolError("--open starts Model Explorer: use it with --format model-explorer")
    if open_viewer:
        _need_model_explorer()
    if fmt is not None:
        where = _output_dir(output)
    elif output is not None:
        where = _output_file(output, force)
    path, functions = _capture(script, script_args, tpu_compiler=True)
    term = Term.of()
    diffs, verdicts, notes, memory = [], [], [], []
    for f in functions:
        with progress(f"diffing {f.name} ({stage}, {compile_target.name})"):
            result, verdict, rewritten = _diff_function(f, stage, compile_target, kernel)
        if isinstance(result, str):
            notes.append(result)
            continue
        diffs.append(result)
        verdicts.append(verdict)
        with progress(f"compiling native and rewritten {f.name} for {compile_target.name}"):
            memory.append(memory_row(f, rewritten, compile_target.name))
    if not diffs and not as_json:
        _echo(term.wrap(f"nothing to diff in {printable(path)}:"), term)
        for note in notes:
            _echo(term.wrap(printable(note), "  ", "    "), term)
        return
    files_made = fmt is not None or output is not None
    if fmt == "model-explorer":
        from hlotool.report.model_explorer import open_command, write_model_explorer

        for file in write_model_explorer(diffs, where, force=force):
            click.echo(printable(os.path.join(output, os.path.basename(file))), err=as_json)
        if not open_viewer:
            _echo(term.wrap("open both: " + " ".join(open_command(output)) + " (with each "
                            "side's overlays: hlotool diff … --open)", "", "  "), term, err=True)
    elif fmt is not None:
        with progress(f"drawing {fmt} pieces"):
            files = render.write_pieces(diffs, where, fmt, hops, force=force)
        for file in files:
            click.echo(printable(os.path.join(output, os.path.basename(file))), err=as_json)
    elif output is not None:
        with progress("drawing the report's graphs"):
            page = render.html_report(diffs, hops, title=f"hlotool diff {os.path.basename(path)}",
                                      verdicts=verdicts)
        write_output(where, page, force=force)
        click.echo(printable(output), err=as_json)
    elif not as_json:
        _echo(render.text_summary(diffs, verdicts, term), term)
    if as_json:
        click.echo(json.dumps({
            "version": 1, "script": path, "stage": stage, "target": compile_target.name,
            "kernel": kernel,
            "functions": [{"function": d.function, "changes": d.diff.stats().line(),
                           "sites": sum(c.site is not None for c in d.changes),
                           **({"verdict": v} if v else {})} for d, v in zip(diffs, verdicts)],
            "memory": [m.to_json() for m in memory], "skipped": notes}, indent=2))
    else:
        if memory:
            _echo(f"\nMemory, native → rewritten (XLA memory_analysis, {compile_target.name}"
                  f"{_per_device(functions, [compile_target])})\n"
                  + render_memory(memory, term), term, err=files_made)
        for note in notes:
            _echo(term.wrap(f"skipped {printable(note)}", "", "  "), term, err=files_made)
    if open_viewer:
        _serve_model_explorer(where, port)
    _memory_gate(memory, fail_on_memory_growth)


def _need_model_explorer() -> None:
    """Fail before the script runs when --open cannot start the viewer."""
    import importlib.util

    if importlib.util.find_spec("model_explorer") is None:
        raise HlotoolError('--open needs Model Explorer: pip install "hlotool[explorer]" '
                           "(or ai-edge-model-explorer)")


def _serve_model_explorer(directory: str, port: int) -> None:
    """Run Model Explorer on localhost until Ctrl-C, which ends the command normally."""
    from hlotool.report.model_explorer import serve

    click.echo(f"starting Model Explorer on http://localhost:{port} (Ctrl-C stops it)",
               err=True)
    try:
        with interrupt.handled_here():  # this Ctrl-C ends the viewer, not hlotool
            serve(directory, port=port)
    except KeyboardInterrupt:
        click.echo("Model Explorer stopped", err=True)


def _diff_function(f: CapturedFunction, stage: str, target: Target, kernel: str
                   ) -> tuple[Any, str | None, CapturedFunction | None]:
    """`f` native vs rewritten by flash_jit at `stage`: a `FunctionDiff`, where `kernel`
    is auto and auto keeps every site native, the verdict of auto above a diff with the
    kernel `target`'s platform would use if it paid, and the rewritten function. A one-line
    reason instead of the diff (and no function) when `f` has no site or no kernel could
    take one."""
    import jax
    from jax.extend.core import jaxpr_as_fun

    from hlotool.api import explain, rewrite_captured
    from hlotool.passes.diff import FunctionDiff, by_site, diff_modules, site_nodes

    native_pre = f.hlo(target=target.name)
    sites = site_nodes(native_pre, f.name)
    if not sites:
        return f"{f.name}: no attention site", None, None
    fun = jaxpr_as_fun(f.closed_jaxpr)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in f.in_avals]
    verdict = None
    report = explain(fun, *args, kernel=kernel)
    if kernel == "auto" and not report.rewritten:
        fallback = _kernel_if_it_paid(report, target.platform)
        if fallback is not None:
            kernel, verdict = fallback
            report = explain(fun, *args, kernel=kernel)
    if not report.rewritten:
        # Nothing to diff: a re-traced copy of the same program differs only in XLA's noise.
        return _left_native(f, report), None, None
    _, rewritten = rewrite_captured(f, kernel)
    if stage == "hlo":
        d = diff_modules(native_pre, rewritten.hlo(target=target.name))
    else:
        d = diff_modules(f.optimized(target.name), rewritten.optimized(target.name))
        sites = [(site, set(), lines) for site, _, lines in sites]
    if d.unchanged:
        return _left_native(f, report), None, None
    return FunctionDiff(f.name, stage, target.name, d, by_site(d, sites)), verdict, rewritten


def _left_native(f: CapturedFunction, report: Any) -> str:
    reasons = "; ".join(dict.fromkeys(s.reason for s in report.sites))
    return f"{f.name}: flash_jit left every site native ({reasons})"


def _kernel_if_it_paid(report: Any, platform: str) -> tuple[str, str] | None:
    """For a report where auto rewrote nothing: the kernel `platform` would run the first
    site with if the cost model said it paid (the one its verdict priced), and auto's
    verdict for that platform as one line; None when no kernel takes the sites."""
    name, reasons = None, []
    for s in report.sites:
        choice = s.choices.get(platform)
        if s.blocker or choice is None or choice.priced is None:
            continue  # kept native for another reason than cost (a blocker): no kernel helps
        reasons.append(f"({choice.verdict.why})" if choice.verdict else choice.reason)
        name = name or choice.priced
    if name is None:
        return None
    why = "; ".join(dict.fromkeys(reasons))
    return name, (f"auto keeps native here {why}. Shown: {name}, the kernel {platform} "
                  f"would run if it paid (--kernel {name}).")


@cli.command(
    cls=_ScriptCommand,
    short_help="Run SCRIPT and rewrite each compiled function's attention with flash_jit.",
    epilog="""\b
Examples:
  hlotool rewrite examples/causal_decoder.py
  hlotool rewrite examples/causal_decoder.py --target cpu --target tpu-v5e -- --seq-len 1024
  hlotool rewrite examples/causal_decoder.py:forward --stage hlo -o out/
  hlotool rewrite examples/flax_model.py --kernel chunked --json -- --seq-len 256
  hlotool rewrite examples/causal_decoder.py --fail-on-memory-growth -- --seq-len 1024""",
)
@_script_argument
@_kernel_option("auto (the cost model's choice per platform) or a kernel name from "
                "hlotool.kernels.")
@click.option("--stage", type=click.Choice(STAGE_NAMES),
              help="With -o: write each rewritten program at this stage.")
@click.option(
    "--target", "targets", default=("cpu",), multiple=True, show_default=True, metavar="NAME",
    help=_TARGET_HELP + " Repeat it to compare memory (and write -o stages) on several.")
@click.option("-o", "--output", "output", type=click.Path(file_okay=False),
              help="Directory for the rewritten programs (created if missing).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--fail-on-memory-growth", is_flag=True, help=_MEMORY_GROWTH_HELP)
@_force_option
@_fail_cleanly
def rewrite(script: str, script_args: tuple[str, ...], kernel: str, stage: str | None,
            targets: tuple[str, ...], output: str | None, as_json: bool,
            fail_on_memory_growth: bool, force: bool) -> None:
    """Run SCRIPT and rewrite each compiled function as hlotool.flash_jit would.

    Prints, per attention site, the kernel chosen on each platform (cpu, tpu, cuda) or why
    it stays native. Then, per function with a rewritten site and per --target, XLA's
    memory_analysis of the native and the rewritten program side by side (arguments,
    outputs, aliased, temporaries, XLA's peak) and what each needs: the larger of the peak
    and arguments + outputs − aliased + temporaries (XLA:CPU's peak leaves temporaries out,
    XLA:TPU's temporaries leave out its fusions' buffers). Where auto keeps a function's
    sites native for cost, its rows (target marked *) show the kernel the target's platform
    would run if it paid; --fail-on-memory-growth does not count them, as no rewrite was
    made. --stage with -o writes each rewritten program like `dump`, as
    NNN_jit_NAME.flash.<stage file>. SCRIPT:NAME and `--` script arguments work as for
    `inspect`.
    """
    from hlotool.api import rewrite_captured
    from hlotool.report.memory import memory_row, render_memory
    from hlotool.report.rewrite import render_rewrite
    from hlotool.targets import get_target

    if (stage is None) != (output is None):
        raise HlotoolError("--stage and -o go together: name both to write rewritten programs")
    compile_targets = [get_target(t) for t in dict.fromkeys(targets)]
    directory = _output_dir(output) if output is not None else None
    path, functions = _capture(script, script_args, tpu_compiler=True)
    reports, memory, files = [], [], []
    # One line over the whole loop: its steps are each short, together they are not.
    with progress(f"rewriting {len(functions)} function{'s' if len(functions) != 1 else ''}"):
        for f in functions:
            with progress(f"rewriting {f.name}"):
                report, rewritten = rewrite_captured(f, kernel)
            reports.append(report)
            for t in compile_targets if directory is not None else ():
                stem, _, rest = f.stage_filename(stage, t).partition(".")
                name = f"{stem}.flash.{rest}"
                if name in files:  # the jaxpr is the same for every target
                    continue
                files.append(name)
                with progress(f"{stage} of the rewritten {f.name} for {t.name}"):
                    text = rewritten.stage_text(stage, t)
                write_output(os.path.join(directory, name), text, force=force, listed=True)
            if report.rewritten:
                for t in compile_targets:
                    with progress(f"compiling native and rewritten {f.name} for {t.name}"):
                        memory.append(memory_row(f, rewritten, t.name))
            elif kernel == "auto":
                memory += _memory_if_it_paid(f, report, compile_targets)
    for name in files:  # after the progress line: stdout may share its terminal
        click.echo(printable(os.path.join(output, name)), err=as_json)
    if as_json:
        click.echo(json.dumps({"version": 1, "script": path, "kernel": kernel,
                               "targets": [t.name for t in compile_targets],
                               "functions": [r.to_json() for r in reports],
                               "memory": [m.to_json() for m in memory]}, indent=2))
    else:
        term = Term.of()
        out = [render_rewrite(r, term) for r in reports]
        if memory:
            out += [f"\nMemory, native → rewritten (XLA memory_analysis; "
                    f"{', '.join(t.name for t in compile_targets)}"
                    f"{_per_device(functions, compile_targets)})", render_memory(memory, term)]
        _echo("\n".join(out), term)
    _memory_gate(memory, fail_on_memory_growth)


def _per_device(functions: Sequence[CapturedFunction], targets: Sequence[Target]) -> str:
    """"; cpu: per device, attention split over 8" for each target that compiles a program
    the script split over several devices split the same way (the host; a pod slice that
    holds the run's mesh): its memory figures are one device's."""
    notes = []
    for t in targets:
        split = [f for f in functions if f.split_on(t)]
        if split:
            notes.append(f"{t.name}: per device, " + ", ".join(
                f"{printable(f.name)} split over {f.devices}" for f in split))
    return "".join("; " + note for note in notes)


def _memory_if_it_paid(f: CapturedFunction, report: Any, targets: Sequence[Target]
                       ) -> list[Any]:
    """Where auto keeps every site of `f` native: per target, `f`'s memory beside the kernel
    the target's platform would run if it paid (the one `diff` draws there), so that what a
    swap would cost in memory shows before anyone asks for it."""
    from hlotool.api import rewrite_captured
    from hlotool.report.memory import memory_row

    rows, rewritten = [], {}
    for t in targets:
        fallback = _kernel_if_it_paid(report, t.platform)
        if fallback is None:
            continue  # kept native for another reason than cost: no kernel takes it
        name = fallback[0]
        if name not in rewritten:
            with progress(f"rewriting {f.name} with {name}"):
                took, program = rewrite_captured(f, name)
            rewritten[name] = program if took.rewritten else None
        if rewritten[name] is not None:
            with progress(f"compiling native and {name} {f.name} for {t.name}"):
                rows.append(memory_row(f, rewritten[name], t.name, kernel_if_paid=name))
    return rows


def _memory_gate(rows: Sequence[Any], enabled: bool) -> None:
    """--fail-on-memory-growth: one line per growth on stderr, then `EXIT_FINDINGS`."""
    from hlotool.report.memory import growth, growth_line

    grown = growth(rows) if enabled else []
    for row in grown:
        _error(f"memory grows: {growth_line(row)}")
    if grown:
        _error(f"{len(grown)} rewritten program{'s need' if len(grown) != 1 else ' needs'} "
               "more memory than native (--fail-on-memory-growth)")
        sys.exit(EXIT_FINDINGS)


@cli.command(
    cls=_ScriptCommand,
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
              help="Write an SVG of predicted time and HBM bytes vs sequence length, native "
              "and kernel per --target, for each distinct site shape (one row of panels "
              "each; sites that differ only in function or source share a row).")
@_force_option
@_fail_cleanly
def cost(script: str, script_args: tuple[str, ...], targets: tuple[str, ...], as_json: bool,
         backward: bool, no_xla: bool, measure: bool, plot_path: str | None,
         force: bool) -> None:
    """Run SCRIPT and price each attention site natively and with the flash kernel.

    Per site and target: the analytic model (FLOPs, HBM bytes, roofline time, compute- or
    memory-bound), XLA's cost_analysis of the naive and kernel programs (* = numbers XLA is
    known to get wrong there; see --json caveats) and the verdict. A native program too big
    for a TPU's HBM is reported as that finding, and the other targets go on.
    """
    from hlotool.report.cost import cost_report

    targets = tuple(get_hardware(t).name for t in (targets or ("cpu",)))
    plot_file = _output_file(plot_path, force) if plot_path else None
    path, functions = _capture(script, script_args, tpu_compiler=True)
    term = Term.of()
    _echo(cost_report(path, functions, targets, as_json=as_json, backward=backward,
                      with_xla=not no_xla, measure=measure, plot_path=plot_file,
                      plot_shown=plot_path, force=force, term=term), term)


@cli.command(
    cls=_ScriptCommand,
    short_help="Run SCRIPT, then trace native and rewritten programs on this host.",
    epilog="""\b
Examples:
  hlotool profile examples/causal_decoder.py -- --seq-len 1024
  hlotool profile examples/causal_decoder.py:forward --trace prof/ -- --seq-len 2048
  tensorboard --logdir prof/     # or XProf: both runs of each function side by side""",
)
@_script_argument
@_kernel_option("Kernel flash_jit uses: auto (the cost model's choice per platform) or a "
                "name from hlotool.kernels.")
@click.option("--trace", "trace_dir", type=click.Path(file_okay=False),
              help="Directory for the jax.profiler traces (kept; default: a new temporary "
              "directory, printed). A directory holding files hlotool did not write is "
              "refused unless --force.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Traced calls of each program, after one untraced warm-up call; "
              "the figures are their medians.")
@click.option("--calibrate/--no-calibrate", default=True, show_default=True,
              help="Measure this host's matmul, softmax and memory rates first (about ten "
              "seconds: the naive program and the chunked kernel timed at three shapes, "
              "forward and forward + backward) and predict with them; --no-calibrate "
              "predicts with the cpu row of hlotool/hardware.py, the rates auto decides with.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@_force_option
@_fail_cleanly
def profile(script: str, script_args: tuple[str, ...], kernel: str, trace_dir: str | None,
            repeats: int, calibrate: bool, as_json: bool, force: bool) -> None:
    """Run SCRIPT, then run each function native and as flash_jit rewrites it on this host
    under jax.profiler, and print per-site time from the traces beside the cost model's.

    Each function with a site rewritten for the CPU is compiled both ways, warmed up, then
    called --repeats times each, the two programs in turn (a spell of load slows both), on
    random inputs of its argument shapes, each call traced. Per site: the time of its ops
    (a rewritten site's ops carry its hlotool/siteN:FILE:LINE scope; a native site's are the
    fusions XLA put its work in, in a train step its derivative's too; ops running side by
    side share their time), their ratio, and the cost model's predicted native and kernel
    times for the host. Per function: wall time and the time some op ran. Figures are
    medians over the calls. The traces stay in --trace (TRACE/NNN_jit_NAME/native and
    …/rewritten, one run per call) for TensorBoard or XProf; the path is printed.
    SCRIPT:NAME and `--` script arguments work as for `inspect`.
    """
    from hlotool.report.profile import (
        check_trace_dir, host_rates, list_in_manifest, profile_function, rates_line,
        render_profile,
    )

    if trace_dir is not None:
        where = check_trace_dir(trace_dir, force)
    else:
        where = tempfile.mkdtemp(prefix="hlotool-profile-")
    path, functions = _capture(script, script_args)
    profiles = []
    for f in functions:
        with progress(f"tracing {f.name} native and rewritten ({repeats} calls each)"):
            profiles.append(profile_function(f, where, kernel, repeats, calibrate))
        if profiles[-1].traces:
            list_in_manifest(where, [f.file_stem])
    traced = any(p.traces for p in profiles)
    if not traced and trace_dir is None:
        shutil.rmtree(where, ignore_errors=True)  # ours, and empty of traces
    kept = where if traced or trace_dir is not None else None
    # Calibrated only where a function had a site to predict (host_rates is cached).
    host = host_rates() if calibrate and traced else None
    host = host if not isinstance(host, str) else None
    if as_json:
        click.echo(json.dumps({"version": 1, "script": path, "kernel": kernel,
                               "trace_dir": kept, "repeats": repeats,
                               "rates": rates_line(host),
                               "functions": [p.to_json() for p in profiles]}, indent=2))
    else:
        term = Term.of()
        _echo(render_profile(profiles, term, host), term)
    click.echo(f"traces: {printable(where)}" if traced else "nothing traced" + (
        f" ({printable(where)} holds no trace)" if kept else ""), err=as_json)


cli.add_command(doctor)


def main() -> None:
    """Console entry point (``hlotool``, ``python -m hlotool``): Ctrl-C ends the process
    within a second (`hlotool.interrupt`)."""
    interrupt.arm(_report_interrupt)
    try:
        default_jax_platforms()
        cli(prog_name="hlotool")
    except KeyboardInterrupt:  # before a command took over (importing, parsing)
        interrupt.stop(_report_interrupt)
