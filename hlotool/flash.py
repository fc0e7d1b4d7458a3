"""`flash_jit`: a `jax.jit` whose attention sites run in a flash kernel; `explain`: why (not).

    fast = hlotool.flash_jit(fn, kernel="auto", validate=False, **jit_kwargs)
    fast(*args)                     # jax.jit(fn) with each safe attention site rewritten
    print(hlotool.explain(fn, *args))

At trace time the wrapper traces `fn` to a jaxpr and, per site: detects it
(`passes.from_jaxpr`), lowers it to a kernel call (`passes.lower`, which refuses what no call
reproduces), decides per platform which kernel runs it (`cost.decision.decide`), and
substitutes it (`passes.rewrite`) before evaluating the program on jit's tracers. A site
whose kernel choice differs between platforms is split with `kernels.per_platform`, so one
traced program runs the chunked kernel (or the native equations) on CPU and exports to TPU
with the Pallas kernel. Every site left native says why in the report.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from hlotool import jaxcompat, kernels
from hlotool.cost.decision import Choice, choose
from hlotool.errors import HlotoolError, first_line
from hlotool.kernels.base import Call
from hlotool.kernels.registry import PLATFORMS
from hlotool.kernels.sharded import mesh_of, on_mesh
from hlotool.passes import lower
from hlotool.passes.from_jaxpr import JaxprSite, describe_path, detect_jaxpr, jaxpr_at
from hlotool.passes.backward import Backward, Recompute
from hlotool.passes.residuals import recompute_in_backward, recomputed_here
from hlotool.passes.tracing import TraceError
from hlotool.passes.rewrite import (
    Replacement, RewriteError, check, derivative, free_inputs, inline_calls, prepare,
    recomputed, rewrite, site_equations,
)
from hlotool.site import AttentionSite
from hlotool.site_report import Report, SiteReport


# ----------------------------------------------------------------------------------------
# One site: its kernel form, the choice per platform, the replacement


def site_key(site: JaxprSite) -> tuple:
    """Identity of a site across traces of the same function and signature."""
    return (site.path, site.eqns)


@dataclasses.dataclass(frozen=True)
class _Form:
    """A site's kernel form, and where the program differentiates it, its derivative:
    beside it (`backward`, a train step) or in `jax.checkpoint` bodies (`recomputes`), with
    `note` saying why a checkpointed recompute stays native."""

    kernel: lower.KernelForm
    backward: Backward | None
    recomputes: tuple[Recompute, ...]
    note: str

    @property
    def trained(self) -> bool:
        """Whether the program differentiates the site (priced forward and backward)."""
        return self.backward is not None or bool(self.recomputes)


def _form(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, skip: frozenset) -> _Form:
    """`RewriteError` when dropping the site's equations would change the program or no
    kernel call reproduces it."""
    backward = derivative(jaxpr, site)
    check(jaxpr, site, backward)
    kernel = lower.lower(site)
    found, missed = recomputed(jaxpr, site, skip)
    note = ""
    if found:
        note = "its backward under jax.checkpoint recomputes it in the kernel too"
    elif missed:
        note = f"its backward under jax.checkpoint stays native: {missed}"
    return _Form(kernel, backward, tuple(found), note)


def _choices(site: JaxprSite, form: _Form, kernel: str) -> dict[str, Choice]:
    """Per platform, the one decision (`cost.decision.choose`) for what the call asks of a
    kernel (`KernelForm.features`), priced forward and backward where the program
    differentiates the site."""
    check_vma = site.manual is not None and site.manual.check_vma
    return {p: choose(site.site, p, kernel, features=form.kernel.features, check_vma=check_vma,
                      backward=form.trained) for p in PLATFORMS}


def scope(index: int, site: AttentionSite) -> str:
    """The name scope a rewritten site runs under: "hlotool/site3:model.py:56"."""
    where = os.path.basename(site.source) if site.source else "?"
    return f"hlotool/site{index}:{where}"


def replacement(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, form: lower.KernelForm,
                plan: Mapping[str, str | None], mesh: Any = None, index: int = 0,
                backward: Backward | None = None, recomputes: Sequence[Recompute] = ()
                ) -> Replacement:
    """The function computing `site.out` under `plan` (platform → kernel name or None).

    It runs under the name scope `scope(index, site)` and each kernel under its own name
    (".../pallas_tpu"), so profiles name the site and the kernel of every op; the scope sits
    around the kernel call, never inside a Pallas kernel body (jax#40637: scopes there can
    constrain scheduling)."""
    inputs = free_inputs(jaxpr, site)
    own = site_equations(jaxpr, site)
    # Differentiated with respect to what the site's equations read (a train step's
    # derivative, `backward.differentiated`): the kernel reads its operands from there.
    direct = backward is not None or bool(recomputes)
    if direct:
        wrt = {*(backward.wrt if backward is not None else ()),
               *(inputs[i] for r in recomputes for i in r.wrt)}
        broadcast = [m for m in (*(b for b, _ in form.biases), *form.operand_masks)
                     if m.direct is not None and m.direct is not m.var]
        if any(m.var in wrt for m in broadcast):
            raise RewriteError("the site reads a bias, sink or head-mask operand both as it "
                               "is and broadcast, and its derivative takes both")

    def branch(name: str | None) -> Callable[..., jax.Array]:
        def run(*xs):
            values = dict(zip(inputs, xs))
            if name is None:
                return own(values)
            with jax.named_scope(name):
                call, after = lower.operands(form, site, values, direct)

                def attend(kernel: str, call: Call, after: lower.After) -> jax.Array:
                    out = on_mesh(kernels.get(kernel).run, call, mesh)
                    return lower.restore(site, out, after)

                if not form.checked:
                    return attend(name, call, after)
                # A bias read as a mask, or a -inf fill for a repeated post-softmax mask,
                # where the reading is exact at this call; else the site as it is, in the
                # exact kernel (or its own equations where no kernel form has it).
                if form.fallback is None:
                    def slow():
                        return own(values)
                else:
                    exact, exact_after = lower.operands(form.fallback, site, values, direct)

                    def slow():
                        return attend("chunked", exact, exact_after)
                return jax.lax.cond(lower.reads_as_mask(form, call),
                                    lambda: attend(name, call, after), slow)
        return run

    def run(values: Mapping[Any, jax.Array]) -> jax.Array:
        return kernels.per_platform(plan, branch, *(values[v] for v in inputs))

    if backward is not None:
        run.backward = backward  # the pass replaces the program's derivative of the site too
    elif all(plan.values()):
        # Kernel branches depend only on this signature; a native branch would carry the
        # site's own source lines, so it is traced per site.
        at = {v: i for i, v in enumerate(inputs)}
        run.cache_key = (
            tuple(sorted(plan.items())), mesh, form.signature(),
            tuple(at.get(m.var) for m, _ in form.biases),
            tuple(at.get(m.var) for m in form.operand_masks),
            at[site.q.var], site.q.layout, at[site.k.var], site.k.layout, at[site.v.var],
            site.v.layout, site.out_layout, site.out.aval)
    run.recomputes = tuple(recomputes)
    run.scope = scope(index, site.site)
    return run


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
            form = _form(jaxpr, site, sited)
            choices = _choices(site, form, kernel)
            plan = {p: c.kernel for p, c in choices.items()}
            notes = ()
            if any(plan.values()):
                # Inside a shard_map body the kernel already sees one device's shard.
                on = mesh if site.manual is None else None
                replacements.append((site, prepare(jaxpr, site, replacement(
                    jaxpr, site, form.kernel, plan, on, index, form.backward,
                    form.recomputes), cache)))
                notes = tuple(filter(None, (form.note, _repeat_note(form.kernel),
                                            _drawing_note(form.kernel, plan))))
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


def _repeat_note(form: lower.KernelForm) -> str:
    """How the call reads a post-softmax where-mask that repeats the logits' mask."""
    if form.hard_fill is None:
        return ""
    return ("its where(mask, p, 0) after the softmax repeats the logits' mask: left out, "
            "hidden keys at -inf, where every row sees a key and the fill "
            f"{form.hard_fill:g} leaves them no weight (checked per call; else the site as it "
            "is, in chunked)")


def _drawing_note(form: lower.KernelForm, plan: Mapping[str, str | None]) -> str:
    """Where a kernel of `plan` draws dropout's keep mask per tile, or why it reads it whole."""
    drawers = sorted({k for k in plan.values() if k is not None and kernels.get(k).draws})
    mask, why_not = lower.drawing(form)
    if not drawers or (mask is None and why_not is None):
        return ""
    if mask is not None:
        return f"{'/'.join(drawers)} draws the keep mask per tile from its key"
    return f"{'/'.join(drawers)} reads the keep mask whole ({why_not})"


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


def trace(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]
          ) -> tuple[jaxcompat.ClosedJaxpr, list[Any], Callable[[list[Any]], Any]]:
    """`fn(*args, **kwargs)` as a ClosedJaxpr over its array leaves (other leaves are closed
    over as static), those leaves, and how to rebuild the output pytree from flat outputs."""
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
        closed, shape = jax.make_jaxpr(flat, return_shape=True)(*dyn)
    except TypeError as err:
        raise HlotoolError(f"cannot trace {name_of(fn)}: {first_line(err)}") from err
    out_tree = jax.tree.structure(shape)
    return closed, dyn, lambda outs: jax.tree.unflatten(out_tree, outs)


def name_of(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class Rewritten:
    """`fn` with its attention sites substituted at trace time; what `flash_jit` jits.

    `disabled(args, kwargs)` names the sites to keep native for a call's signature (site key
    → reason): validation's verdicts.
    """

    def __init__(self, fn: Callable, kernel: str, in_shardings: Any = None,
                 disabled: Callable[[Sequence[Any], Mapping[str, Any]], Mapping[tuple, str]]
                 | None = None):
        if kernel != "auto":
            kernels.get(kernel)  # an unknown name fails here, in one line
        self.fn, self.kernel, self.in_shardings = fn, kernel, in_shardings
        self.disabled = disabled
        self.report: Report | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        closed, dyn, unflatten = trace(self.fn, args, kwargs)  # the user's errors, as jit's
        off = self.disabled(args, kwargs) if self.disabled is not None else None
        try:
            plan = plan_program(closed, name_of(self.fn), self.kernel, off,
                                mesh_of(dyn, self.in_shardings))
            self.report = plan.report
            rewritten = plan.apply()
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


def explain(fn: Callable, *args: Any, kernel: str = "auto", **kwargs: Any) -> Report:
    """Per site of `fn(*args, **kwargs)`: which kernel runs it on each platform, or why it
    stays native. Array leaves of the arguments are traced; everything else is static."""
    if kernel != "auto":
        kernels.get(kernel)
    closed, _, _ = trace(fn, args, kwargs)
    return plan_program(closed, name_of(fn), kernel).report


def flash_jit(fn: Callable, *, kernel: str = "auto", validate: bool = False,
              **jit_kwargs: Any):
    """`jax.jit(fn, **jit_kwargs)` with every attention site `decide` accepts run in a kernel.

    kernel: "auto" (per platform, see `hlotool.cost.decision.decide`) or a kernel name
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
        from hlotool.validate import Validated

        return Validated(fn, kernel, jit_kwargs)
    return jax.jit(Rewritten(fn, kernel, jit_kwargs.get("in_shardings")), **jit_kwargs)


def rewrite_captured(function: Any, kernel: str = "auto") -> tuple[Report, Any]:
    """A function `hlotool.capture` recorded, rewritten: its report, and a copy of the
    `CapturedFunction` whose program (every stage: jaxpr, StableHLO, HLO, optimized) is the
    rewritten one."""
    rewritten = Rewritten(jaxcompat.jaxpr_as_fun(function.closed_jaxpr), kernel)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in function.in_avals]
    closed = jax.make_jaxpr(rewritten)(*args)
    report = dataclasses.replace(rewritten.report, function=function.name)
    return report, function.with_jaxpr(closed)
