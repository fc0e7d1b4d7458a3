"""The one seam between hlotool and jax's private or unstable APIs.

hlotool needs a few things jax offers no stable public API for: a hook on jit lowering (to
capture every function a script compiles), the jaxpr types, dead-code elimination of a
jaxpr, the user's frames of an equation's traceback, jax's canonical platform names, and
libtpu's deviceless topologies. Each is looked up here once, at import: its public home
first (`jax.extend.*`, `jax.core`, `jax.experimental`), then the private module of the jax
releases that have none. Nothing else in hlotool imports `jax._src`
(tests/test_jaxcompat.py greps the sources for it).

A hook that is missing does not fail the import. Its `Hook` in `HOOKS` holds a one-line
reason naming the jax version, and its names here are bound to stand-ins: a required hook's
stand-in raises `MissingHook` (a one-line `HlotoolError` that points at `hlotool doctor`)
when used, a cosmetic hook's degrades quietly, as its `without` says. So only the features
that need a hook stop: `missing("flash_jit")` tells `flash_jit` to fall back to `jax.jit`;
`inspect` keeps working without the flash hooks. `hlotool doctor` lists every hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core

from hlotool.errors import HlotoolError

JAX_VERSION = jax.__version__


@dataclasses.dataclass(frozen=True)
class Hook:
    """One jax API hlotool relies on, and whether this jax provides it."""

    name: str  # what `hlotool doctor` calls it: "jit lowering", "jaxpr types", ...
    api: str  # where it was found, or the first place it was looked for
    used_by: str  # the features that need it
    reason: str | None = None  # one line naming the jax version; None when found
    private: bool = False  # found (or looked for) under jax._src
    without: str = ""  # what happens without it, for hooks that only degrade

    @property
    def ok(self) -> bool:
        return self.reason is None


class MissingHook(HlotoolError):
    """A feature needs a jax API this jax does not provide."""

    def __init__(self, hook: Hook):
        super().__init__(f"{hook.used_by} unavailable: {hook.reason} (see `hlotool doctor`)")
        self.hook = hook


HOOKS: dict[str, Hook] = {}

# Which hooks each user-facing feature cannot do without.
FEATURES: dict[str, tuple[str, ...]] = {
    "capture": ("jit lowering", "jaxpr types"),
    "flash_jit": ("jaxpr types", "jaxpr evaluation", "dead-code elimination"),
    "tpu targets": ("TPU topologies",),
}


def missing(feature: str) -> str | None:
    """Why `feature` cannot work with this jax (one line), or None when it can."""
    for name in FEATURES[feature]:
        hook = HOOKS[name]
        if not hook.ok:
            return str(MissingHook(hook))
    return None


def _lookup(candidates: Sequence[str], attr: str) -> tuple[Any, str, str | None]:
    """(value, "module.attr", None) from the first module in `candidates` that has `attr`,
    else (None, first candidate's "module.attr", why not)."""
    problems = []
    for module in candidates:
        try:
            value = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            problems.append(f"cannot import {module} ({e})")
        except AttributeError:
            problems.append(f"{module} has no {attr}")
        else:
            return value, f"{module}.{attr}", None
    return None, f"{candidates[0]}.{attr}", f"jax {JAX_VERSION}: " + "; ".join(problems)


def signature_problem(fn: Callable[..., Any], where: str, params: tuple[str, ...],
                      prefix: bool = False) -> str | None:
    """None when `fn` takes `params` (as its leading parameters, in order, with `prefix`),
    else what is wrong, naming `where`."""
    try:
        accepted = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return f"cannot read the signature of {where}"
    if prefix and accepted[: len(params)] != params:
        return f"{where} takes {accepted[:len(params)]}, expected {params}"
    absent = [p for p in params if p not in accepted]
    if absent:
        return f"{where} takes no {', '.join(absent)}"
    return None


def probe(name: str, used_by: str, candidates: Sequence[str], attrs: Sequence[str], *,
          params: tuple[str, ...] = (), prefix: bool = False, without: str = ""
          ) -> tuple[Hook, list[Any]]:
    """Look up each of `attrs` in the first of `candidates` that has it; check the first
    attr's parameters. The `Hook`, and the values found (None for those not found).
    Registers nothing: `_use` does, for the hooks hlotool relies on."""
    values, apis, reason = [], [], None
    for attr in attrs:
        value, api, why = _lookup(candidates, attr)
        values.append(value)
        apis.append(api)
        reason = reason or why
    if reason is None and params:
        problem = signature_problem(values[0], apis[0], params, prefix)
        reason = problem and f"jax {JAX_VERSION}: {problem}"
    api = apis[0] if len(apis) == 1 else f"{apis[0].rpartition('.')[0]}.{{{', '.join(attrs)}}}"
    return Hook(name, api, used_by, reason, private="._src" in api, without=without), values


def _use(*args: Any, **kwargs: Any) -> tuple[Hook, list[Any]]:
    hook, values = probe(*args, **kwargs)
    HOOKS[hook.name] = hook
    return hook, values


def _raising(hook: Hook) -> Callable[..., Any]:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise MissingHook(hook)

    return unavailable


def _missing_type(hook: Hook, name: str) -> type:
    """A stand-in for a jaxpr type this jax lacks: nothing is an instance of it, and making
    one raises `MissingHook`."""

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise MissingHook(hook)

    return type(name, (), {"__new__": new, "__doc__": f"missing: {hook.reason}"})


# --- jit lowering: every jit compile lowers through one private function ------------------
# No public API sees the jaxpr of each function jax compiles, so capture wraps this one.
_PXLA = "jax._src.interpreters.pxla"
_LOWERING_PARAMS = ("closed_jaxpr", "api_name", "fun_name", "in_shardings", "out_shardings",
                    "in_layouts", "out_layouts", "donated_invars")
_lowering_hook, (_lower,) = _use(
    "jit lowering", "capture (inspect, dump, cost, rewrite, diff)",
    (_PXLA,), ("lower_sharding_computation",),
    params=_LOWERING_PARAMS, prefix=True)
_LOWER_SIGNATURE = inspect.signature(_lower) if _lowering_hook.ok else None


@contextlib.contextmanager
def lowering_hook(wrapper: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """While active, every jit lowering calls `wrapper(closed_jaxpr, api_name, fun_name,
    ...)` in place of jax's; yields jax's own function, for the wrapper to call."""
    if not _lowering_hook.ok:
        raise MissingHook(_lowering_hook)
    module = importlib.import_module(_PXLA)
    module.lower_sharding_computation = wrapper
    try:
        yield _lower
    finally:
        module.lower_sharding_computation = _lower


def lowering_donated(*args: Any, **kwargs: Any) -> tuple[bool, ...]:
    """Per flat argument of a lowering call (as `lowering_hook`'s wrapper got it), whether
    the jit donated it."""
    donated = _LOWER_SIGNATURE.bind(*args, **kwargs).arguments["donated_invars"]
    return tuple(bool(d) for d in donated)


def lowering_shardings(*args: Any, **kwargs: Any
                       ) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """(in_shardings, out_shardings) of a lowering call, each a `jax.sharding.Sharding` or
    None where the jit left it to the compiler; None when no argument or result is split
    over more than one device (a one-device program)."""
    bound = _LOWER_SIGNATURE.bind(*args, **kwargs).arguments

    def known(shardings: Any) -> tuple[Any, ...]:
        return tuple(s if isinstance(s, jax.sharding.Sharding) else None for s in shardings)

    ins, outs = known(bound["in_shardings"]), known(bound["out_shardings"])
    if all(s is None or len(s.device_set) == 1 for s in ins + outs):
        return None
    return ins, outs


# --- jaxpr types: public in jax.extend.core / jax.core on every supported jax -------------
_JAXPR_NAMES = ("ClosedJaxpr", "Jaxpr", "JaxprEqn", "Literal", "jaxpr_as_fun")
_jaxpr_hook, _jaxpr_values = _use(
    "jaxpr types", "capture and flash_jit", ("jax.extend.core",), _JAXPR_NAMES)
ClosedJaxpr, Jaxpr, JaxprEqn, Literal = (
    value if value is not None else _missing_type(_jaxpr_hook, name)
    for value, name in zip(_jaxpr_values[:4], _JAXPR_NAMES)
)
jaxpr_as_fun = _jaxpr_values[4] or _raising(_jaxpr_hook)
_eval_hook, (eval_jaxpr, Tracer) = _use(
    "jaxpr evaluation", "flash_jit, hlotool rewrite and diff", ("jax.core",),
    ("eval_jaxpr", "Tracer"), params=("jaxpr", "consts"), prefix=True)
eval_jaxpr = eval_jaxpr or _raising(_eval_hook)
Tracer = Tracer or _missing_type(_eval_hook, "Tracer")

def jaxprs_in_params(params: dict[str, Any]) -> Iterator[Any]:
    """The jaxprs nested in an equation's params (a cond's branches, a scan's body, a
    pjit's jaxpr), each as a `Jaxpr`: jax.extend.core has this only from jax 0.10 on."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


# jax 0.9 and older: `Primitive.get_bind_params` returns (subfuns, params); later, the params.
_BIND_SPLITS_SUBFUNS = isinstance(
    jax.extend.core.Primitive("hlotool_probe").get_bind_params({}), tuple)


def bind_params(eqn: Any) -> tuple[list[Any], dict[str, Any]]:
    """(subfuns, params) to re-bind `eqn`: `eqn.primitive.bind(*subfuns, *args, **params)`."""
    got = eqn.primitive.get_bind_params(eqn.params)
    return got if _BIND_SPLITS_SUBFUNS else ([], got)


def scan_groups(eqn: Any) -> tuple[int, int, int] | None:
    """How many of a `scan` equation's operands are loop-invariant consts, carry, and
    scanned xs (its outputs: the carry, then the stacked ys): `num_consts`/`num_carry` up to
    jax 0.11, the groups of `ft_in` (consts, carry, xs) from 0.12 on; None where neither is
    there (nothing is then known about its operands)."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        consts, carry = int(params["num_consts"]), int(params["num_carry"])
        return consts, carry, len(eqn.invars) - consts - carry
    try:
        groups = [len(list(g.vals)) for g in params["ft_in"].unpack()]
    except (AttributeError, KeyError, TypeError):
        return None
    if len(groups) != 3 or sum(groups) != len(eqn.invars):
        return None
    return groups[0], groups[1], groups[2]


# --- shard_map bodies: what their equations and values say, across versions -------------
# Inside a shard_map body (jax >= 0.7 with check_vma) each value's type says over which
# manual mesh axes it differs from device to device, and jax casts a value that does not
# vary to one that does with `pvary`, an identity on values (its transpose is a psum).
SHARD_MAP = "shard_map"
MANUAL_CASTS = ("pvary",)


def varying_axes(aval: Any) -> frozenset:
    """The mesh axes over which a shard_map body's value varies: `aval.vma` up to jax 0.9,
    `aval.manual_axis_type.varying` from 0.10; empty outside a body."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def manual_axes(eqn: Any) -> frozenset:
    """The mesh axes a `shard_map` equation makes manual: `manual_axes` up to jax 0.9,
    `newly_manual_axes` from 0.10 (all of the mesh's where neither is there)."""
    params = eqn.params
    axes = params.get("newly_manual_axes", params.get("manual_axes"))
    return frozenset(params["mesh"].axis_names if axes is None else axes)


# --- evaluation while a caller is traced: private only --------------------------------------
# validate=True runs the naive and rewritten programs on values while the caller may be
# traced (under jit, grad or vmap); their operations must run now, not be staged into the
# caller's program, nor be constant-folded into the traces compared, as the public
# jax.ensure_compile_time_eval would do.
_eval_context_hook, (_eval_context,) = _use(
    "eval context", "flash_jit(validate=True) under jit, grad or vmap", ("jax._src.core",),
    ("eval_context",), without="validate=True checks only calls that are not traced")


def eval_context() -> contextlib.AbstractContextManager:
    """A context that evaluates jax operations eagerly, whatever trace is current (a no-op
    when this jax cannot; see `HOOKS["eval context"]`)."""
    return _eval_context() if _eval_context is not None else contextlib.nullcontext()


# --- dead-code elimination: private only ---------------------------------------------------
# flash_jit drops the equations only the replaced attention read (masks, iotas).
_dce_hook, (dce_jaxpr,) = _use(
    "dead-code elimination", "flash_jit, hlotool rewrite and diff",
    ("jax._src.interpreters.partial_eval",), ("dce_jaxpr",),
    params=("jaxpr", "used_outputs", "instantiate"), prefix=True)
dce_jaxpr = dce_jaxpr or _raising(_dce_hook)

# --- source info: user frames are private; the exclusion list is public --------------------
_frames_hook, (_user_frames,) = _use(
    "source lines", "source lines of flash_jit's sites", ("jax._src.source_info_util",),
    ("user_frames",), params=("traceback",),
    without="flash_jit and explain name no source line for a site")


def user_frames(traceback: Any) -> Iterator[Any]:
    """The user's frames (`file_name`, `start_line`) of an equation's traceback, innermost
    first; none when this jax cannot say (see `HOOKS["source lines"]`)."""
    return iter(_user_frames(traceback)) if _user_frames is not None else iter(())


_exclusion_hook, (_register_exclusion,) = _use(
    "source exclusion", "clean source locations in captured HLO",
    ("jax.extend.source_info_util",), ("register_exclusion",), params=("path",),
    without="captured HLO stack frames also list hlotool's and click's frames")


def register_exclusion(path: str) -> None:
    """Keep frames under `path` out of the source locations jax records (when it can)."""
    if _register_exclusion is not None:
        _register_exclusion(path)


# --- platform names: private; `jax.default_backend()` says "gpu" where the kernels say -----
# "cuda" or "rocm" (the names `lax.platform_dependent` dispatches on).
_platform_hook, (_canonicalize,) = _use(
    "platform names", "pricing for the attached GPU", ("jax._src.xla_bridge",),
    ("canonicalize_platform",), params=("platform",),
    without="an attached GPU is priced as the default chip (h100)")


def canonicalize_platform(platform: str) -> str:
    """jax's canonical name of `platform` ("gpu" → "cuda" or "rocm"); unchanged when this
    jax cannot say."""
    return _canonicalize(platform) if _canonicalize is not None else platform


# --- jax.nn.softmax as plain operations: public, an upgrade flag ---------------------------
# jax 0.12.1 turned `jax_softmax_custom_jvp` on: jax.nn.softmax became a custom_jvp call whose
# rule is softmax's own derivative. A site partly inside a custom_jvp call stays native (the
# kernel's derivative would replace the call's rule), so hlotool analyses programs traced as
# every jax up to 0.12.0 traced them: plain operations, the max shift under stop_gradient,
# differentiated by autodiff (the same derivative, computed as before 0.12.1).
# `jax.softmax_custom_jvp` is jax's scoped switch (the flag is part of jit's cache key); a jax
# that drops it leaves such sites native, saying why.
_softmax_hook, (_softmax_switch,) = _use(
    "softmax switch", "rewriting sites that use jax.nn.softmax (jax >= 0.12.1)", ("jax",),
    ("softmax_custom_jvp",),
    without="a site whose softmax is jax.nn.softmax's custom_jvp call stays native")
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))


def plain_softmax() -> contextlib.AbstractContextManager:
    """While active, jax.nn.softmax traces as plain operations (see above)."""
    return _softmax_switch(False) if _softmax_switch is not None else contextlib.nullcontext()


def _is_jax_softmax(eqn: Any) -> bool:
    body = eqn.params.get("call_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    name, _, where = (getattr(info, "func_src_info", None) or "").partition(" at ")
    return name == "_softmax" and os.path.abspath(where).startswith(_JAX_DIR + os.sep)


def holds_jax_softmax_rule(jaxpr: Any) -> bool:
    """Whether `jaxpr` (or a body nested in it) calls jax.nn.softmax as a custom_jvp call."""
    return any((eqn.primitive.name == "custom_jvp_call" and _is_jax_softmax(eqn))
               or any(holds_jax_softmax_rule(sub) for sub in jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


# --- cuDNN's version, off a GPU: private only -----------------------------------------------
# jax.nn.dot_product_attention(implementation="cudnn") asks cuDNN its version while tracing,
# through jax's CUDA plugin; where that is not installed (any machine without a GPU) the
# question raises, and no program using cuDNN attention can be traced for CUDA there.
# `cudnn_traceable` answers it with ASSUMED_CUDNN: tracing only picks the custom call's
# configuration, and on a GPU, where jax asks cuDNN itself, nothing is assumed.
ASSUMED_CUDNN = 90800  # cuDNN 9.8: what jax's CUDA 12 wheels require at least
_CUDNN_MODULE = "jax._src.cudnn.fused_attention_stablehlo"
_cudnn_hook, (_cudnn_version,) = _use(
    "cuDNN version", "the cudnn kernel traced off a GPU (CUDA exports)", (_CUDNN_MODULE,),
    ("check_cudnn_version",), without="the cudnn kernel is off: CUDA sites run in the next one")


def _assumed_cudnn() -> int:
    return ASSUMED_CUDNN


@functools.cache  # whether jax can ask cuDNN does not change within a process
def _cudnn_askable() -> bool:
    try:
        _cudnn_version()
    except Exception:  # noqa: BLE001 - "cuDNN is not detected", or a plugin that cannot load it
        return False
    return True


def cudnn_untraceable() -> str | None:
    """Why jax's cuDNN attention cannot be traced everywhere (one line), or None when it can.
    A rewritten program holds every platform's kernel, so one that cannot be traced off a GPU
    must not be chosen even for CUDA."""
    return HOOKS[_cudnn_hook.name].reason


@contextlib.contextmanager
def cudnn_traceable() -> Iterator[None]:
    """While active, jax's cuDNN attention traces here even without a CUDA plugin (see
    above); a no-op where jax can ask cuDNN itself."""
    if _cudnn_version is None or _cudnn_askable():
        yield
        return
    module = importlib.import_module(_CUDNN_MODULE)
    module.check_cudnn_version = _assumed_cudnn
    try:
        yield
    finally:
        module.check_cudnn_version = _cudnn_version


# --- deviceless TPU topologies: public but experimental ------------------------------------
_topology_hook, (get_topology_desc, make_mesh) = _use(
    "TPU topologies", "TPU targets (--target tpu-*)", ("jax.experimental.topologies",),
    ("get_topology_desc", "make_mesh"), params=("topology_name", "platform"))
get_topology_desc = get_topology_desc or _raising(_topology_hook)
make_mesh = make_mesh or _raising(_topology_hook)


# --- which TPU a kernel lowers for, off a TPU -----------------------------------------------
# From jax 0.12 on, Mosaic (Pallas TPU) asks at trace and at lowering time which TPU it works
# for: the context mesh's abstract device, else jax's default device. Off a TPU neither names
# one ("Unsupported TPU device kind: cpu"), so the kernels staged only for TPU are traced in
# a jit under an abstract mesh naming a TPU, unless the caller named one already
# (`jax.sharding.use_abstract_mesh`, or a deviceless TPU as default device) or set a mesh with
# axes (whose arrays carry that mesh: naming another device there would contradict them).
# Older jax, whose AbstractDevice has no platform, does not ask.
OFF_TPU_DEVICE_KIND = "TPU v5 lite"  # TPU v5e: the chip hlotool prices TPU sites on by default
try:
    _OFF_TPU_DEVICE = jax.sharding.AbstractDevice(
        device_kind=OFF_TPU_DEVICE_KIND, num_cores=1, platform="tpu")
except TypeError:
    _OFF_TPU_DEVICE = None


def _named_tpu() -> str | None:
    """The `device_kind` of the TPU the context names (its abstract device, else the default
    device, else the default backend), or None where it names none."""
    named = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if named is not None and getattr(named, "platform", None) == "tpu":
        return named.device_kind
    device = jax.config.jax_default_device
    if device is not None and not isinstance(device, str):
        return device.device_kind if device.platform == "tpu" else None
    return jax.devices()[0].device_kind if jax.default_backend() == "tpu" else None


def _tpu_named() -> bool:
    """Whether the context already says which TPU (or, with a mesh of axes, which devices)."""
    return not jax.sharding.get_abstract_mesh().empty or _named_tpu() is not None


@contextlib.contextmanager
def tpu_target() -> Iterator[None]:
    """Trace under an abstract mesh naming a TPU when nothing names one (see above)."""
    if _OFF_TPU_DEVICE is None or _tpu_named():
        yield
        return
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=_OFF_TPU_DEVICE)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def tpu_device_kind() -> str:
    """The `device_kind` of the TPU a kernel traced now is for: the one the context names,
    else the chip hlotool names off a TPU (`OFF_TPU_DEVICE_KIND`, as `tpu_target` does)."""
    return _named_tpu() or OFF_TPU_DEVICE_KIND


def for_tpu(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a kernel that runs only on TPU, positional arguments) as a jit traced in
    `tpu_target()`, so that lowering it later, outside that context, still knows its TPU;
    `fn` itself where nothing needs naming."""
    if _OFF_TPU_DEVICE is None or _tpu_named():
        return fn
    jitted = jax.jit(fn)

    def traced(*args: Any) -> Any:
        with tpu_target():
            return jitted(*args)

    return traced
