"""Capture every function jax compiles while a script or a function runs.

Every jit compilation — `jit(f)(x)`, `jit(f).lower(x)`, the jits flax, haiku or equinox
create internally — lowers through one private jax function; `_compile_hook` wraps it for the
duration of a capture through `hlotool.jaxcompat.lowering_hook`, the seam that checks at
import that it still exists with the parameters the hook relies on.

Each capture keeps the function's `ClosedJaxpr`; every later stage (StableHLO, HLO with
source locations, optimized HLO per target) is regenerated from it by jitting
`jax.extend.core.jaxpr_as_fun(closed_jaxpr)` on `ShapeDtypeStruct`s of the same avals.
The jaxpr's equations carry the user's tracebacks, so the regenerated HLO's stack-frame
tables still point at the user's source lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import importlib.util
import os
import runpy
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jaxlib.mlir import ir

from hlotool import jaxcompat
from hlotool.errors import DoesNotFit, HlotoolError, first_line
from hlotool.hlo import parse_module
from hlotool.jaxcompat import ClosedJaxpr, Jaxpr, jaxpr_as_fun
from hlotool.targets import Target, get_target
from hlotool.units import format_bytes

STAGES: tuple[str, ...] = ("jaxpr", "stablehlo", "hlo", "optimized")

# Functions whose source lives inside jax itself are eager dispatch (`jnp.ones(...)`,
# `x + 1` outside jit), not the user's programs.
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__)) + os.sep
# Nor are hlotool's own probes, which flash_jit compiles inside the user's script and would
# otherwise show up as the user's functions: the kernels' (a compile asked of XLA the first
# time a kernel is traced, `kernels.chunked._max_by_halves`, a "<lambda>") and the cost
# model's (`hlotool.cost.xla.naive_program`, compiled for TPU when a decision asks whether
# XLA:TPU fuses a site, an "attend").
_PROBE_DIRS = tuple(os.path.dirname(os.path.abspath(importlib.util.find_spec(package).origin))
                    + os.sep for package in ("hlotool.kernels", "hlotool.cost"))

class ScriptError(HlotoolError):
    """The user's script could not be run to completion."""


class NothingCapturedError(HlotoolError):
    """The script or function ran but jax compiled none of the user's functions."""


def _exclude_tool_frames() -> None:
    """Keep hlotool's, click's and its launchers' frames out of source locations.

    A script captured through the CLI is traced beneath those frames; jax records every
    non-library frame of the stack in the HLO stack-frame tables, which should show the
    user's code only. Cosmetic: without jax's exclusion list the tables merely keep them.
    """
    paths = [os.path.dirname(__file__), sysconfig.get_path("scripts")]
    click = importlib.util.find_spec("click")  # found, not imported: capture needs no CLI
    if click is not None and click.origin:
        paths.append(os.path.dirname(click.origin))
    for path in paths:
        jaxcompat.register_exclusion(os.path.abspath(path) + os.sep)
    jaxcompat.register_exclusion("<frozen runpy>")  # `python -m hlotool`


_exclude_tool_frames()


@dataclasses.dataclass(eq=False)
class CapturedFunction:
    """One function jax compiled, with its program at every stage.

    `closed_jaxpr` is the program as jax traced it; `in_avals` its flat argument
    shapes/dtypes (pytrees such as parameter dicts appear flattened, in jax's order).
    Stage texts are computed on first use and cached per target.
    """

    index: int  # 1-based, in order of first compilation
    name: str  # the jitted function's name, e.g. "train_step"
    closed_jaxpr: ClosedJaxpr
    in_avals: tuple[jax.core.ShapedArray, ...]
    arg_names: tuple[str, ...] | None  # jax's names for the flat args, when it kept them
    source: str | None  # "train_step at /path/model.py:42"
    lower_seconds: float  # jaxpr → StableHLO lowering of the original compile
    compile_seconds: float | None  # XLA compile of the original; None if never compiled
    # Per flat argument, whether the original jit donated it (donate_argnums): regenerated
    # stages donate the same, so XLA's aliasing and memory figures match the real program.
    donated: tuple[bool, ...]
    # (in, out) shardings of a program split over several of this process's devices (a
    # Sharding or None per flat argument and result), or None: the host's stages are then
    # lowered with them, so XLA partitions the program as the script's run did.
    shardings: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
    _lowered: dict[str, jax.stages.Lowered] = dataclasses.field(default_factory=dict, repr=False)
    # Per target lowered: whether its stages are the program split over devices.
    _split: dict[str, bool] = dataclasses.field(default_factory=dict, repr=False)
    _compiled: dict[str, jax.stages.Compiled] = dataclasses.field(
        default_factory=dict, repr=False
    )

    @property
    def devices(self) -> int:
        """The devices the script's run split this program over (1: not split)."""
        if self.shardings is None:
            return 1
        return max(len(s.device_set) for s in (*self.shardings[0], *self.shardings[1])
                   if s is not None)

    def split_on(self, target: str | Target) -> bool:
        """Whether `target`'s stages are this program split over devices (the host, a pod
        slice that holds the run's mesh), not whole on one: its figures are per device."""
        t = get_target(target)
        self.lowered(t)
        return self._split[t.name]

    @property
    def file_stem(self) -> str:
        """Deterministic, findable file stem, e.g. ``003_jit_train_step``."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name).strip("_.")
        return f"{self.index:03d}_jit_{safe or 'fn'}"

    def args_summary(self) -> list[str]:
        """Each flat argument as jax writes it: ``f32[2,64,32]``, ``i32[]``."""
        return [a.str_short(short_dtypes=True) for a in self.in_avals]

    @functools.cached_property
    def jaxpr_text(self) -> str:
        return str(self.closed_jaxpr)

    @functools.cached_property
    def stablehlo(self) -> str:
        """StableHLO (MLIR text) as lowered for the host CPU."""
        return self.lowered("cpu").as_text()

    def hlo(self, debug_info: bool = True, target: str | Target = "cpu") -> str:
        """Pre-optimization HLO text; with `debug_info`, `metadata=` and stack-frame tables
        that map each instruction to the user's source line."""
        return self.lowered(target).as_text(dialect="hlo", debug_info=debug_info)

    def optimized(self, target: str | Target = "cpu") -> str:
        """HLO text after XLA's optimization passes for `target`."""
        return self.compiled(target).as_text()

    def lowered(self, target: str | Target = "cpu") -> jax.stages.Lowered:
        """The function re-lowered for `target` (deviceless for TPU targets): split as the
        script's run split it (`shardings`) on the host and on a pod slice that holds the
        run's mesh, or whole where that split no longer lowers."""
        t = get_target(target)
        if t.name not in self._lowered:
            sharding = t.sharding()
            split = self._split_for(t)
            for attempt in ([split] if split else []) + [None]:
                try:
                    with t.lowering():
                        self._lowered[t.name] = self._jitted(sharding, attempt).trace(
                            *self._arguments(sharding, attempt)).lower()
                    self._split[t.name] = attempt is not None
                    break
                except Exception as e:
                    if attempt is None:
                        raise HlotoolError(
                            f"cannot lower {self.name} for {t.name}: {first_line(e)}"
                        ) from e
        return self._lowered[t.name]

    def _split_for(self, t: Target) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The run's shardings as `t` takes them: the host as they are, a pod slice laid
        onto its chips (`Target.split`); None for one chip, or a split the pod cannot hold."""
        if self.shardings is None or t.topology is None:
            return self.shardings
        laid = tuple(tuple(t.split(s) if s is not None else None for s in side)
                     for side in self.shardings)
        if any((s is None) != (x is None) for side, got in zip(self.shardings, laid)
               for s, x in zip(side, got)):
            return None
        return laid

    def _arguments(self, sharding: Any, split: Any) -> list[jax.ShapeDtypeStruct]:
        ins = split[0] if split else (sharding,) * len(self.in_avals)
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
                for a, s in zip(self.in_avals, ins)]

    def _jitted(self, sharding: Any, split: Any) -> Any:
        donate = tuple(i for i, d in enumerate(self.donated) if d)
        if split and all(s is not None for s in split[1]):  # a list: the flat function's
            return jax.jit(self._as_fun(), out_shardings=list(split[1]), donate_argnums=donate)
        if sharding is None:
            return jax.jit(self._as_fun(), donate_argnums=donate)
        return jax.jit(self._as_fun(), in_shardings=sharding, out_shardings=sharding,
                       donate_argnums=donate)

    def compiled(self, target: str | Target = "cpu") -> jax.stages.Compiled:
        """The function compiled by XLA for `target`. Raises `DoesNotFit` when one value
        of it alone exceeds the host's memory and the target is the host (XLA:CPU would spend
        the compile for nothing, and jaxlib 0.12's crashes on such a program)."""
        t = get_target(target)
        if t.name not in self._compiled:
            check_host_memory(t, self.closed_jaxpr.jaxpr)
            lowered = self.lowered(t)
            try:
                self._compiled[t.name] = lowered.compile()
            except Exception as e:
                raise HlotoolError(
                    f"cannot compile {self.name} for {t.name}: {first_line(e)}"
                ) from e
        return self._compiled[t.name]

    def stage_text(self, stage: str, target: str | Target = "cpu") -> str:
        """The program at `stage` (one of `STAGES`), for `target` where that matters."""
        if stage == "jaxpr":
            return self.jaxpr_text
        if stage == "stablehlo":
            return self.lowered(target).as_text()
        if stage == "hlo":
            return self.hlo(debug_info=True, target=target)
        if stage == "optimized":
            return self.optimized(target)
        raise HlotoolError(f"unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")

    def stage_filename(self, stage: str, target: str | Target = "cpu") -> str:
        """File name `dump` writes `stage` to, e.g. ``003_jit_train_step.cpu.hlo.txt``."""
        if stage == "jaxpr":
            return f"{self.file_stem}.jaxpr.txt"
        t = get_target(target).name
        suffix = {"stablehlo": "stablehlo.mlir", "hlo": "hlo.txt", "optimized": "optimized.hlo.txt"}
        if stage not in suffix:
            raise HlotoolError(f"unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
        return f"{self.file_stem}.{t}.{suffix[stage]}"

    def instruction_counts(self, target: str | Target = "cpu") -> dict[str, int]:
        """Size of the program at each stage: jaxpr equations (nested ones included),
        StableHLO ops, pre- and post-optimization HLO instructions."""
        return {
            "jaxpr": _count_eqns(self.closed_jaxpr.jaxpr),
            "stablehlo": _count_mlir_ops(self.lowered(target)),
            "hlo": _count_hlo(self.hlo(debug_info=False, target=target)),
            "optimized": _count_hlo(self.optimized(target)),
        }

    def with_jaxpr(self, closed_jaxpr: ClosedJaxpr) -> CapturedFunction:
        """The same function (name, index, source) with another program of the same inputs,
        e.g. a rewritten one; its stages are computed afresh.

        Prefer this to `dataclasses.replace`, which would share the per-target caches.
        """
        # Shapes and dtypes: an aval's sharding names the mesh it was traced under, which a
        # rewrite traced from ShapeDtypeStructs has no part in.
        def signature(avals: Sequence[Any]) -> list[tuple[Any, ...]]:
            return [(a.shape, a.dtype, a.weak_type) for a in avals]

        if signature(closed_jaxpr.in_avals) != signature(self.in_avals):
            raise HlotoolError(
                f"{self.name}: new program takes {_avals(closed_jaxpr.in_avals)}, "
                f"expected {_avals(self.in_avals)}"
            )
        return dataclasses.replace(
            self, closed_jaxpr=closed_jaxpr, _lowered={}, _compiled={}, _split={}
        )

    def _as_fun(self) -> Callable[..., Any]:
        closed = self.closed_jaxpr

        def fun(*args: Any) -> list[Any]:
            return jaxpr_as_fun(closed)(*args)

        # jax names the HLO module and op_name paths after the function.
        fun.__name__ = fun.__qualname__ = self.name
        return fun


@dataclasses.dataclass
class _Record:
    name: str
    closed_jaxpr: ClosedJaxpr
    lower_seconds: float
    donated: tuple[bool, ...]
    shardings: tuple[tuple[Any, ...], tuple[Any, ...]] | None
    compile_seconds: float | None = None


@contextlib.contextmanager
def _compile_hook(on_compile: Callable[[str], None] | None = None
                  ) -> Iterator[list[_Record]]:
    """Record every jit lowering (and the XLA compile that follows) while active; tell
    `on_compile` the name of each of the user's functions as its lowering starts."""
    records: list[_Record] = []

    def hook(closed_jaxpr: ClosedJaxpr, api_name: str, fun_name: str, *args, **kwargs):
        if on_compile is not None and not _not_users(closed_jaxpr):
            on_compile(fun_name)
        start = time.perf_counter()
        computation = lower(closed_jaxpr, api_name, fun_name, *args, **kwargs)
        donated = jaxcompat.lowering_donated(closed_jaxpr, api_name, fun_name, *args, **kwargs)
        record = _Record(fun_name, closed_jaxpr, time.perf_counter() - start, donated,
                         jaxcompat.lowering_shardings(closed_jaxpr, api_name, fun_name,
                                                      *args, **kwargs))
        records.append(record)
        compile_fn = computation.compile

        def timed_compile(*c_args, **c_kwargs):
            start = time.perf_counter()
            out = compile_fn(*c_args, **c_kwargs)
            record.compile_seconds = time.perf_counter() - start
            return out

        computation.compile = timed_compile
        return computation

    # Functions compiled before the capture would be served from jax's caches unseen.
    jax.clear_caches()
    # jax.nn.softmax as every jax up to 0.12.0 traced it, so its sites can be rewritten
    # (`jaxcompat.plain_softmax`); the flag is part of jit's cache key.
    with jaxcompat.lowering_hook(hook) as lower, jaxcompat.plain_softmax():
        yield records


def _not_users(closed_jaxpr: ClosedJaxpr) -> bool:
    """Whether the function lives inside jax itself (eager dispatch) or is one of hlotool's
    probes (kernels, cost model): not the user's program."""
    source = getattr(closed_jaxpr.jaxpr.debug_info, "func_src_info", None)
    return bool(source) and _source_path(source).startswith((_JAX_DIR, *_PROBE_DIRS))


def _to_captured(records: Sequence[_Record]) -> list[CapturedFunction]:
    """The user's functions among `records`, identical recompiles merged, in first-seen order."""
    out: list[CapturedFunction] = []
    seen: set[tuple[str, str, tuple[bool, ...]]] = set()
    for r in records:
        info = r.closed_jaxpr.jaxpr.debug_info
        source = getattr(info, "func_src_info", None)
        if _not_users(r.closed_jaxpr):
            continue
        key = (r.name, str(r.closed_jaxpr), r.donated, repr(r.shardings))
        if key in seen:
            continue
        seen.add(key)
        names = getattr(info, "arg_names", None)
        out.append(
            CapturedFunction(
                index=len(out) + 1,
                name=r.name,
                closed_jaxpr=r.closed_jaxpr,
                in_avals=tuple(r.closed_jaxpr.in_avals),
                arg_names=tuple(names) if names is not None else None,
                source=source,
                lower_seconds=r.lower_seconds,
                compile_seconds=r.compile_seconds,
                donated=r.donated,
                shardings=r.shardings,
            )
        )
    return out


def capture_function(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[CapturedFunction]:
    """Call ``fn(*args, **kwargs)`` and return every function jax compiled meanwhile.

    `fn` is typically jitted itself; a plain function captures the jits it calls.
    """
    with _compile_hook() as records:
        fn(*args, **kwargs)
    captured = _to_captured(records)
    if not captured:
        raise NothingCapturedError(
            f"{getattr(fn, '__name__', fn)!s} compiled no jax functions; wrap it in jax.jit"
        )
    return captured


def capture_script(path: str | os.PathLike[str], argv: Sequence[str] = (),
                   on_compile: Callable[[str], None] | None = None
                   ) -> list[CapturedFunction]:
    """Run the script at `path` as ``__main__`` with ``sys.argv = [path, *argv]`` and return
    every function jax compiled while it ran; `on_compile(name)` hears of each of them as
    its compile starts (a progress line).

    The script runs unmodified, except that jax.nn.softmax traces as plain operations, as
    on every jax up to 0.12.0 (`jaxcompat.plain_softmax`: the same values, its derivative
    taken by autodiff rather than jax 0.12.1's rule for it): its directory is put first on
    `sys.path`, ``sys.exit(0)`` is a normal end. Its stdout is sent to stderr so the caller's stdout stays its own (to
    whatever sys.stderr is at each write: a progress line's proxy prints it above the line).
    Raises `ScriptError` (one line, naming the file) for a missing file, a syntax error,
    an exception or a non-zero exit, and `NothingCapturedError` when nothing was compiled.
    """
    path = os.fspath(path)
    _check_script(path)
    script_dir = os.path.dirname(os.path.abspath(path))
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, script_dir)
    try:
        with _compile_hook(on_compile) as records, contextlib.redirect_stdout(_Stderr()):
            _run(path)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    captured = _to_captured(records)
    if not captured:
        raise NothingCapturedError(
            f"{path} ran but compiled no jax functions (eager operations are not listed; "
            "wrap the model in jax.jit)"
        )
    return captured


class _Stderr:
    """A stream writing to sys.stderr as it is at each call, not as it was at the start."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(sys.stderr, name)


def _check_script(path: str) -> None:
    """Fail early, in one line, on a file that is missing or does not parse."""
    if not os.path.exists(path):
        raise ScriptError(f"no such file: {path}")
    if not os.path.isfile(path):
        raise ScriptError(f"not a file: {path}")
    try:
        with open(path, "rb") as f:
            source = f.read()
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise ScriptError(f"{path}:{e.lineno}: syntax error: {e.msg}") from e
    except (OSError, ValueError) as e:
        raise ScriptError(f"cannot read {path}: {e}") from e


def _run(path: str) -> None:
    """Run the script as ``__main__``, turning its failures into one line."""
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            detail = f"status {e.code}" if isinstance(e.code, int) else repr(e.code)
            raise ScriptError(f"{path} exited with {detail}") from e
    except Exception as e:
        raise ScriptError(f"{_where(e, path)}: {type(e).__name__}: {first_line(e)}") from e


def _where(error: BaseException, path: str) -> str:
    """``path:line`` of the deepest frame of the traceback that is in the script."""
    where = path
    abspath = os.path.abspath(path)
    tb = error.__traceback__
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == abspath:
            where = f"{path}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _avals(avals: Sequence[Any]) -> str:
    return "(" + ", ".join(a.str_short(short_dtypes=True) for a in avals) + ")"




def _source_path(func_src_info: str) -> str:
    """The file in jax's ``"f at /path/x.py:12"`` form."""
    _, _, rest = func_src_info.rpartition(" at ")
    return os.path.abspath(rest.rsplit(":", 1)[0]) if rest else ""


def select(captured: Sequence[CapturedFunction], pattern: str) -> list[CapturedFunction]:
    """The captured functions whose name matches `pattern`.

    A pattern with glob characters (``*?[``) must match the whole name (``train_*``);
    otherwise it matches any name containing it (``step`` matches ``train_step``).
    Raises `HlotoolError` naming the captured functions when nothing matches.
    """
    if any(c in pattern for c in "*?["):
        chosen = [c for c in captured if fnmatch.fnmatchcase(c.name, pattern)]
    else:
        chosen = [c for c in captured if pattern in c.name]
    if not chosen:
        names = ", ".join(sorted({c.name for c in captured}))
        raise HlotoolError(f"no captured function matches {pattern!r}; captured: {names}")
    return chosen


def _count_eqns(jaxpr: Jaxpr) -> int:
    """Equations in `jaxpr` and every jaxpr nested in its equations' parameters."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(sub, ClosedJaxpr):
                    total += _count_eqns(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    total += _count_eqns(sub)
    return total


def _count_mlir_ops(lowered: jax.stages.Lowered) -> int:
    """Operations in the lowered module, not counting module/function scaffolding."""
    module = lowered.compiler_ir("stablehlo")
    count = 0

    def visit(op: Any) -> Any:
        nonlocal count
        if op.name.split(".", 1)[0] not in ("builtin", "func"):
            count += 1
        return ir.WalkResult.ADVANCE

    with module.context:
        module.operation.walk(visit)
    return count


def _count_hlo(text: str) -> int:
    """Instructions over all computations of an HLO module's text."""
    return sum(len(c.instructions) for c in parse_module(text).computations.values())


def largest_value_bytes(jaxpr: Jaxpr) -> int:
    """Bytes of the largest value a jaxpr (or any jaxpr nested in it) computes."""
    biggest = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                size = 1
                for d in aval.shape:
                    size *= d if isinstance(d, int) else 1
                biggest = max(biggest, size * aval.dtype.itemsize)
        for sub in jaxcompat.jaxprs_in_params(eqn.params):
            biggest = max(biggest, largest_value_bytes(sub))
    return biggest


def check_host_memory(target: Target, jaxpr: Jaxpr) -> None:
    """Raise `DoesNotFit` when `target` compiles on this host (not deviceless) and one value
    of `jaxpr` needs more than the host's memory."""
    if target.deviceless:
        return
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    value_bytes = largest_value_bytes(jaxpr)
    if value_bytes > host:
        raise DoesNotFit(f"native does not fit in this host's {format_bytes(host)} memory: "
                         f"one value alone is {format_bytes(value_bytes)}")
