"""The stages of `flash_jit`, wired: trace, detect, lower, choose, replace, splice.

    plan = plan_program(closed_jaxpr, "train_step")   # per site: SiteReport + Replacement
    plan.report; plan.apply()                         # the rewritten ClosedJaxpr

Per site, one direction: `passes.from_jaxpr.detect_jaxpr` (JaxprSite) → `passes.lower.lower`
(KernelForm, or RewriteError when no kernel call reproduces the site) → `cost.decision.choose`
per platform (Choice: the kernel, each refusal, the verdict) → `passes.replacement`
(Replacement: the kernel call per platform) → `passes.rewrite` (splices it, and its
derivative where the program differentiates the site). Every site left native says why in
its `SiteReport`. `Rewritten` runs this at trace time; `hlotool.api` is the public face.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from hlotool import jaxcompat, kernels
from hlotool.cost import split
from hlotool.cost.decision import Choice, choose
from hlotool.errors import HlotoolError, first_line
from hlotool.kernels.registry import PLATFORMS
from hlotool.kernels.sharded import mesh_of, split_note
from hlotool.passes.from_jaxpr import JaxprSite, describe_path, detect_jaxpr, jaxpr_at
from hlotool.passes.replacement import (Lowered, drawing_note, lower_site, positions_note,
                                        repeat_note, replacement)
from hlotool.passes.residuals import recompute_in_backward, recomputed_here
from hlotool.passes.rewrite import Replacement, RewriteError, inline_calls, prepare, rewrite
from hlotool.passes.tracing import TraceError
from hlotool.site_report import Report, SiteReport


# ----------------------------------------------------------------------------------------
# One site: its kernel form, the choice per platform, the replacement


def site_key(site: JaxprSite) -> tuple:
    """Identity of a site across traces of the same function and signature."""
    return (site.path, site.eqns)


def _choices(site: JaxprSite, form: Lowered, kernel: str) -> dict[str, Choice]:
    """Per platform, the one decision (`cost.decision.choose`) for what the call asks of a
    kernel (`KernelForm.features`), priced forward and backward where the program
    differentiates the site."""
    check_vma = site.manual is not None and site.manual.check_vma
    return {p: choose(site.site, p, kernel, features=form.kernel.features, check_vma=check_vma,
                      backward=form.trained) for p in PLATFORMS}


# ----------------------------------------------------------------------------------------
# Whole programs


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan_program` decided for a program: the report, the program the sites were
    found in (`closed` with its nested jits inlined where it differentiates a site), and the
    replacements, each traced already, for `apply`."""

    report: Report
    program: jaxcompat.ClosedJaxpr
    replacements: list[tuple[JaxprSite, Replacement]]

    def apply(self) -> jaxcompat.ClosedJaxpr:
        return rewrite(self.program, self.replacements)


def plan_program(closed: jaxcompat.ClosedJaxpr, function: str, kernel: str = "auto",
                 disabled: Mapping[tuple, str] | None = None, mesh: Any = None) -> Plan:
    """Detect and decide every site of `closed`. A site whose replacement cannot be traced
    or spliced is reported native with the reason, here rather than when it is applied."""
    symbolic = symbolic_dims(closed)
    if symbolic:
        return Plan(Report(function, (), note=(
            f"symbolic dimension{'s' if len(symbolic) > 1 else ''} {', '.join(symbolic)} "
            "(shape polymorphism): attention is detected and rewritten for concrete shapes "
            "only")), closed, [])
    try:
        sites = detect_jaxpr(closed, function)
    except HlotoolError as err:  # a bug of the detection: the program is left as it is
        return Plan(Report(function, (), note=first_line(err)), closed, [])
    if any(site.escaping for site in sites):
        # jax's AD of a site inside a nested jit lands in two bodies; inlined, the site's
        # derivative is beside it (`passes.rewrite.inline_calls`).
        inlined = inline_calls(closed)
        if inlined is not closed:
            closed, sites = inlined, detect_jaxpr(inlined, function)
    moved, moved_sites, count = recompute_in_backward(closed, sites, function)
    if count:
        plan = _plan(moved, moved_sites, function, kernel, disabled, mesh)
        recomputed = [r for r, s in zip(plan.report.sites, moved_sites)
                      if recomputed_here(jaxpr_at(moved, s.path), s)]
        left = [r.reason for r in recomputed if not r.rewritten]
        if len(recomputed) < count:  # a recompute that no longer reads as attention
            left.append("its recomputed equations are not detected as attention there")
        if not left:
            return plan
        unmoved = _plan(closed, sites, function, kernel, disabled, mesh)
        return dataclasses.replace(unmoved, report=dataclasses.replace(unmoved.report, sites=tuple(
            dataclasses.replace(r, notes=(*r.notes, f"recomputed in the backward loop, it "
                                          f"would stay native there: {left[0]}"))
            if not r.rewritten and s.enclosing == "scan" and s.escaping else r
            for r, s in zip(unmoved.report.sites, sites))))
    return _plan(closed, sites, function, kernel, disabled, mesh)


def _plan(closed: jaxcompat.ClosedJaxpr, sites: list[JaxprSite], function: str, kernel: str,
          disabled: Mapping[tuple, str] | None, mesh: Any) -> Plan:
    disabled = disabled or {}
    reports, replacements, cache = [], [], {}
    sited = frozenset(site.path for site in sites)
    for index, site in enumerate(sites, 1):
        jaxpr = jaxpr_at(closed, site.path)
        where = describe_path(closed, site.path)
        blocker = disabled.get(site_key(site))
        if blocker is not None:
            reports.append(SiteReport.native(site.site, where, PLATFORMS, blocker))
            continue
        try:
            form = lower_site(jaxpr, site, sited)
            # Inside a shard_map body the kernel already sees one device's shard.
            on = mesh if site.manual is None else None
            choices = split.gathered_where_cheaper(_choices(site, form, kernel), site.site, on,
                                                   form.trained)
            plan = {p: c.kernel for p, c in choices.items()}
            notes = ()
            if any(plan.values()):
                replacements.append((site, prepare(jaxpr, site, replacement(
                    jaxpr, site, form, plan, on, index), cache)))
                notes = tuple(filter(None, (form.note, repeat_note(form.kernel),
                                            positions_note(form.kernel),
                                            drawing_note(form.kernel, plan),
                                            split_note(on, site.site, bool(plan.get("tpu"))))))
                if recomputed_here(jaxpr, site):
                    notes += ("recomputed in the backward loop from its inputs, which the "
                              "forward loop saves in place of its probabilities",)
            reports.append(SiteReport(site.site, where, choices, notes=notes,
                                      trained=form.trained))
        except (RewriteError, TraceError) as err:
            reports.append(SiteReport.native(site.site, where, PLATFORMS, str(err)))
        except Exception as err:  # noqa: BLE001 - a kernel that cannot trace: keep native
            reports.append(SiteReport.native(
                site.site, where, PLATFORMS, f"the replacement could not be traced "
                f"({type(err).__name__}: {first_line(err)})"))
    return Plan(Report(function, tuple(reports)), closed, replacements)


def symbolic_dims(closed: jaxcompat.ClosedJaxpr) -> list[str]:
    """The symbolic dimensions (jax.export shape polymorphism) among the program's inputs."""
    names = []
    for aval in closed.in_avals:
        for d in getattr(aval, "shape", ()):
            if not isinstance(d, (int, np.integer)) and str(d) not in names:
                names.append(str(d))
    return names


def _is_dynamic(leaf: Any) -> bool:
    return isinstance(leaf, (jaxcompat.Tracer, jax.Array, np.ndarray, np.generic,
                             jax.ShapeDtypeStruct))


def trace(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], *,
          plain_softmax: bool = False
          ) -> tuple[jaxcompat.ClosedJaxpr, list[Any], Callable[[list[Any]], Any]]:
    """`fn(*args, **kwargs)` as a ClosedJaxpr over its array leaves (other leaves are closed
    over as static), those leaves, and how to rebuild the output pytree from flat outputs;
    jax.nn.softmax as plain operations with `plain_softmax` (see `for_analysis`)."""
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
    at = [i for i, leaf in enumerate(leaves) if _is_dynamic(leaf)]

    def flat(*dyn):
        full = list(leaves)
        for i, x in zip(at, dyn):
            full[i] = x
        a, kw = jax.tree.unflatten(tree, full)
        return fn(*a, **kw)

    dyn = [leaves[i] for i in at]
    try:
        with jaxcompat.plain_softmax() if plain_softmax else contextlib.nullcontext():
            closed, shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
    except TypeError as err:
        raise HlotoolError(f"cannot trace {name_of(fn)}: {first_line(err)}") from err
    out_tree = jax.tree.structure(shape)
    return closed, dyn, lambda outs: jax.tree.unflatten(out_tree, outs)


def for_analysis(closed: jaxcompat.ClosedJaxpr, fn: Callable, args: Sequence[Any],
                 kwargs: Mapping[str, Any]) -> jaxcompat.ClosedJaxpr:
    """The program to find and rewrite sites in: `closed` (`fn` traced), or, where it calls
    jax.nn.softmax as a custom_jvp call (jax >= 0.12.1), `fn` traced again with that softmax
    as plain operations (`jaxcompat.plain_softmax`). A program whose sites all stay native
    runs as `closed`."""
    if not jaxcompat.holds_jax_softmax_rule(closed.jaxpr):
        return closed
    return trace(fn, args, kwargs, plain_softmax=True)[0]


def name_of(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class Rewritten:
    """`fn` with its attention sites substituted at trace time; what `flash_jit` jits.

    `disabled(args, kwargs)` names the sites to keep native for a call's signature (site key
    → reason): validation's verdicts. `mesh`: the mesh kernel calls are split over, where
    the arguments do not carry it (a captured program's abstract mesh, lowered later for a
    host or a pod slice).
    """

    def __init__(self, fn: Callable, kernel: str, in_shardings: Any = None,
                 disabled: Callable[[Sequence[Any], Mapping[str, Any]], Mapping[tuple, str]]
                 | None = None, mesh: Any = None):
        if kernel != "auto":
            kernels.get(kernel)  # an unknown name fails here, in one line
        self.fn, self.kernel, self.in_shardings = fn, kernel, in_shardings
        self.disabled, self.mesh = disabled, mesh
        self.report: Report | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        closed, dyn, unflatten = trace(self.fn, args, kwargs)  # the user's errors, as jit's
        off = self.disabled(args, kwargs) if self.disabled is not None else None
        try:
            plan = plan_program(for_analysis(closed, self.fn, args, kwargs), name_of(self.fn),
                                self.kernel, off,
                                self.mesh or mesh_of(dyn, self.in_shardings))
            self.report = plan.report
            rewritten = plan.apply() if plan.replacements else closed
            outs = jaxcompat.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *dyn)
        except jaxcompat.MissingHook:  # this jax lacks what rewriting needs: said in one line
            raise
        except Exception as err:  # noqa: BLE001 - hlotool's own failure: run it as written
            self.report = Report(name_of(self.fn), (), note=(
                f"hlotool failed on this program ({type(err).__name__}: {first_line(err)}); "
                "it runs as written"))
            outs = jaxcompat.eval_jaxpr(closed.jaxpr, closed.consts, *dyn)
        if self.report.note:
            warnings.warn(f"flash_jit: {self.report}", stacklevel=2)
        return unflatten(outs)
