"""hlotool's public functions: `flash_jit`, `explain`, and `rewrite_captured` for the CLI.

    fast = hlotool.flash_jit(fn, kernel="auto", validate=False, **jit_kwargs)
    fast(*args)                     # jax.jit(fn) with each safe attention site rewritten
    print(hlotool.explain(fn, *args))

The stages they run are wired in `hlotool.flash`; `hlotool.validate` compares a rewritten
program with the native one before its first use.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax

from hlotool import jaxcompat, kernels
from hlotool.flash import Rewritten, for_analysis, name_of, plan_program, trace
from hlotool.kernels.sharded import mesh_of
from hlotool.site_report import Report
from hlotool.validate import Validated


def explain(fn: Callable, *args: Any, kernel: str = "auto", **kwargs: Any) -> Report:
    """Per site of `fn(*args, **kwargs)`: which kernel runs it on each platform, or why it
    stays native. Array leaves of the arguments are traced; everything else is static."""
    if kernel != "auto":
        kernels.get(kernel)
    closed, dyn, _ = trace(fn, args, kwargs)
    return plan_program(for_analysis(closed, fn, args, kwargs), name_of(fn), kernel,
                        mesh=mesh_of(dyn)).report


def flash_jit(fn: Callable, *, kernel: str = "auto", validate: bool = False,
              **jit_kwargs: Any):
    """`jax.jit(fn, **jit_kwargs)` with every attention site a kernel pays for run in it.

    kernel: "auto" (per platform, `hlotool.cost.decision.choose`) or a kernel name
    (`hlotool.kernels.names()`).
    validate: before the first use of each input signature, compare outputs and gradients
    with `jax.jit(fn)` and keep native, with a warning naming the site and the error, the
    sites that differ (see `hlotool.validate`).
    Returns a `jax.jit`-wrapped function (`.lower`, `.trace`, `jax.export` work).
    """
    unavailable = jaxcompat.missing("flash_jit")
    if unavailable is not None:
        warnings.warn(f"{unavailable}; flash_jit returns plain jax.jit", stacklevel=2)
        return jax.jit(fn, **jit_kwargs)
    if validate:
        return Validated(fn, kernel, jit_kwargs)
    return jax.jit(Rewritten(fn, kernel, jit_kwargs.get("in_shardings")), **jit_kwargs)


def rewrite_captured(function: Any, kernel: str = "auto") -> tuple[Report, Any]:
    """A function `hlotool.capture` recorded, rewritten: its report, and a copy of the
    `CapturedFunction` whose program (every stage: jaxpr, StableHLO, HLO, optimized) is the
    rewritten one."""
    # A program the run split over devices: kernel calls split over the same mesh, abstract
    # so that each target's lowering lays it onto its own devices.
    mesh = mesh_of((), function.shardings[0]) if function.shardings else None
    rewritten = Rewritten(jaxcompat.jaxpr_as_fun(function.closed_jaxpr), kernel,
                          mesh=None if mesh is None else mesh.abstract_mesh)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in function.in_avals]
    closed = jax.make_jaxpr(rewritten)(*args)
    report = dataclasses.replace(rewritten.report, function=function.name)
    return report, function.with_jaxpr(closed)
