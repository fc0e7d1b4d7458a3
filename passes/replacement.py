"""The replacement of one site: its kernel call per platform, as `passes.rewrite` splices it.

    lower_site(jaxpr, site) -> Lowered                     # the kernel form, its derivative
    replacement(jaxpr, site, lowered, plan) -> Replacement # plan: platform -> kernel or None

The call reads the site's free inputs, shapes them into the kernel's canonical call
(`passes.lower.operands`), runs the kernel each platform's plan names (`kernels.per_platform`:
one traced program runs chunked on CPU and exports the Pallas kernel to TPU) and restores the
site's output layout; a platform whose plan is None runs the site's own equations.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

import jax

from hlotool import jaxcompat, kernels
from hlotool.kernels.base import Call
from hlotool.kernels.sharded import on_mesh
from hlotool.passes import lower
from hlotool.passes.backward import Backward, Recompute
from hlotool.passes.from_jaxpr import JaxprSite
from hlotool.passes.rewrite import (
    Replacement, RewriteError, check, derivative, free_inputs, recomputed, site_equations,
)
from hlotool.site import AttentionSite


def scope(index: int, site: AttentionSite) -> str:
    """The name scope a rewritten site runs under: "hlotool/site3:model.py:56"."""
    where = os.path.basename(site.source) if site.source else "?"
    return f"hlotool/site{index}:{where}"


@dataclasses.dataclass(frozen=True)
class Lowered:
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


def lower_site(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, skip: frozenset = frozenset()
               ) -> Lowered:
    """`site` of `jaxpr` as a kernel call and its derivative; `RewriteError` when dropping
    the site's equations would change the program or no kernel call reproduces it. Bodies
    at a path in `skip` are sites of their own, not recomputes of this one."""
    backward = derivative(jaxpr, site)
    check(jaxpr, site, backward)
    kernel = lower.lower(site)
    found, missed = recomputed(jaxpr, site, skip)
    note = ""
    if found:
        note = "its backward under jax.checkpoint recomputes it in the kernel too"
    elif missed:
        note = f"its backward under jax.checkpoint stays native: {missed}"
    return Lowered(kernel, backward, tuple(found), note)


def replacement(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, lowered: Lowered,
                plan: Mapping[str, str | None], mesh: Any = None, index: int = 0
                ) -> Replacement:
    """The function computing `site.out` under `plan` (platform → kernel name or None).

    It runs under the name scope `scope(index, site)` and each kernel under its own name
    (".../pallas_tpu"), so profiles name the site and the kernel of every op; the scope sits
    around the kernel call, never inside a Pallas kernel body (jax#40637: scopes there can
    constrain scheduling)."""
    form, backward, recomputes = lowered.kernel, lowered.backward, lowered.recomputes
    inputs = free_inputs(jaxpr, site)
    own = site_equations(jaxpr, site)
    # Differentiated with respect to what the site's equations read (a train step's
    # derivative, `backward.differentiated`): the kernel reads its operands from there.
    direct = lowered.trained
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
                    out = on_mesh(kernels.get(kernel), call, mesh)
                    return lower.restore(site, out, after)

                if not form.checked:
                    return attend(name, call, after)
                # A bias read as a mask, a -inf fill for a repeated post-softmax mask, or a
                # band read from positions, where the reading is exact at this call; else
                # the site as it is, in the exact kernel (or its own equations where no
                # kernel form has it).
                # The fallback's operands are computed inside its branch: a dense mask
                # computed from positions (`MaskVar.cone`) is then never passed whole to the
                # cond; the check computes it again, into its reduction.
                exact = None
                if form.fallback is None:
                    def slow():
                        return own(values)
                else:
                    def slow():
                        return attend("chunked", *lower.operands(form.fallback, site, values,
                                                                 direct))

                    if form.positions:
                        exact, _ = lower.operands(form.fallback, site, values, direct)
                return jax.lax.cond(lower.reads_as_mask(form, call, exact),
                                    lambda: attend(name, call, after), slow)
        return run

    def run(values: Mapping[Any, jax.Array]) -> jax.Array:
        return kernels.per_platform(plan, branch, *(values[v] for v in inputs))

    cache_key = None
    if backward is None and all(plan.values()):
        # Kernel branches depend only on this signature; a native branch would carry the
        # site's own source lines, so it is traced per site (and a derivative replaced
        # beside the site is traced with it).
        at = {v: i for i, v in enumerate(inputs)}
        forms = (form,) if form.fallback is None else (form, form.fallback)
        cache_key = (
            tuple(sorted(plan.items())), mesh, form.signature(),
            tuple(at.get(v) for f in forms for m, _ in f.biases for v in _reads(m)),
            tuple(at.get(v) for f in forms for m in f.operand_masks for v in _reads(m)),
            at[site.q.var], site.q.layout, at[site.k.var], site.k.layout, at[site.v.var],
            site.v.layout, site.out_layout, site.out.aval)
    return Replacement(run, scope=scope(index, site.site), backward=backward,
                       recomputes=recomputes, cache_key=cache_key)



def _reads(m) -> tuple:
    """The variables a replacement reads for the operand `m` (`lower.mask_value`)."""
    return (m.var,) if m.cone is None else tuple(m.cone.invars)


def repeat_note(form: lower.KernelForm) -> str:
    """How the call reads a post-softmax where-mask that repeats the logits' mask."""
    if form.hard_fill is None:
        return ""
    return ("its where(mask, p, 0) after the softmax repeats the logits' mask: left out, "
            "hidden keys at -inf, where every row sees a key and the fill "
            f"{form.hard_fill:g} leaves them no weight (checked per call; else the site as it "
            "is, in chunked)")


def positions_note(form: lower.KernelForm) -> str:
    """How the call reads a band built from run-time positions."""
    if not form.positions:
        return ""
    return ("its band is read from positions the program computes, as if each were its "
            "index (true for left padding or none): checked per call against the program's "
            "own mask; else the site as it is, with its dense mask, in chunked")


def drawing_note(form: lower.KernelForm, plan: Mapping[str, str | None]) -> str:
    """Where a kernel of `plan` draws dropout's keep mask per tile, or why it reads it whole."""
    drawers = sorted({k for k in plan.values() if k is not None and kernels.get(k).draws})
    mask, why_not = lower.drawing(form)
    if not drawers or (mask is None and why_not is None):
        return ""
    if mask is not None:
        return f"{'/'.join(drawers)} draws the keep mask per tile from its key"
    return f"{'/'.join(drawers)} reads the keep mask whole ({why_not})"
