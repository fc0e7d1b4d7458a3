"""Rewrite pass: substitute attention sites of a traced program, then drop what they left dead.

One entry point, `rewrite(closed, replacements)`. Each replacement pairs a `JaxprSite` (from
`passes.from_jaxpr.detect_jaxpr`) with a function that computes the site's output from the
values the site reads. The pass

  1. traces that function into a single `jit` equation (its constants stay inside it, so it
     can be spliced into any body, including scan/while/cond bodies and remat jaxprs that
     have no constants of their own),
  2. puts it where the site's output was defined and removes the site's equations,
  3. rebuilds every enclosing equation on the path to the site (pjit, scan, while, cond,
     checkpoint, custom_jvp/vjp calls) with the new body, keeping its interface,
  4. runs dead-code elimination, so operands only the naive equations read (a broadcast
     mask, the causal iota) are gone too.

A site whose intermediates the program's own `jax.grad` reads (a train step) is replaced in
both directions: `derivative` finds the equations jax's AD wrote for it (`passes.backward`),
and the pass splits jax's AD of the replacement into a forward call, placed where the site's
output was defined, and a backward call, placed where its backward began, reading the
program's cotangent and defining the variables the rest of the backward reads.

Everything else in the program is left as it was. The pass refuses (raises `RewriteError`) a
site whose intermediates are read outside it other than by its derivative, or whose inputs
are not visible at its level: dropping its equations would change the program.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import jax

from hlotool import jaxcompat
from hlotool.errors import HlotoolError
from hlotool.passes import tracing
from hlotool.passes.backward import (
    REMAT, Backward, NoBackward, Recompute, find_backward, find_recomputes, with_gradient,
)
from hlotool.passes.from_jaxpr import (
    JaxprSite, Path, jaxpr_at, open_subjaxpr, with_subjaxpr,
)
from hlotool.passes.logits import STRUCTURAL
from hlotool.passes.tracing import Manual

# The name of every call the pass splices: `jit(hlotool_flash)` in HLO and in profiles.
CALL = "hlotool_flash"


class RewriteError(HlotoolError):
    """A site cannot be substituted without changing the program; the message says why."""


@dataclasses.dataclass(frozen=True)
class Splice:
    """One edit of the jaxpr at `path`: drop the equations `drop`, put `calls[i]` at i."""

    path: Path
    drop: frozenset[int]
    calls: Mapping[int, jaxcompat.JaxprEqn]


@dataclasses.dataclass(frozen=True)
class Replacement:
    """What computes a site's output [the out var's shape] from the site's free inputs
    (`free_inputs`), keyed by variable, and how the pass splices it.

    scope: the name scope the spliced call runs under (on top of the site's own), so XProf,
        TensorBoard and HLO op_name metadata name the site of each op.
    backward: where the program differentiates the site beside it (a train step): the pass
        replaces that derivative by the replacement's too.
    recomputes: `jax.checkpoint` bodies that recompute the site for its derivative, each
        replaced by the replacement's derivative.
    cache_key: identical keys (with the inputs' types) share one traced call: a model's 24
        identical layers trace the kernel once.
    splices: the traced edits (`prepare`), None until traced.
    """

    run: Callable[[Mapping[Any, jax.Array]], jax.Array]
    scope: str | None = None
    backward: Backward | None = None
    recomputes: tuple[Recompute, ...] = ()
    cache_key: tuple | None = None
    splices: tuple[Splice, ...] | None = None

    def __call__(self, values: Mapping[Any, jax.Array]) -> jax.Array:
        return self.run(values)


def free_inputs(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> list[Any]:
    """Variables a replacement may read: those the site's equations read but do not define,
    in first-use order, then the masks' own operands (`MaskVar.var`, before the program
    broadcast them, the keys a drawn one comes from, the small values a mask's `cone`
    computes it from, in its place), all defined before the site's output."""
    defined, seen, out = set(), set(), []
    for i in site.eqns:
        for v in jaxpr.eqns[i].invars:
            if isinstance(v, jaxcompat.Literal) or v in defined or v in seen:
                continue
            seen.add(v)
            out.append(v)
        defined.update(jaxpr.eqns[i].outvars)
    for m in (*site.masks, *site.multipliers):
        drawn_from = () if m.drawn is None else m.drawn.invars
        own = (m.var,) if m.cone is None else tuple(m.cone.invars)
        for v in (*own, m.key_lengths, *drawn_from):
            if v is not None and v not in seen and v not in defined:
                seen.add(v)
                out.append(v)
    return out


def site_equations(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> Replacement:
    """The site's own equations as a replacement: evaluating it reproduces the naive output
    (the branch of a platform that keeps the site as the program wrote it)."""
    inputs = free_inputs(jaxpr, site)
    body = jaxpr.replace(invars=inputs, outvars=[site.out], constvars=[],
                         eqns=[jaxpr.eqns[i] for i in site.eqns])

    def run(values: Mapping[Any, jax.Array]) -> jax.Array:
        (out,) = jaxcompat.eval_jaxpr(body, (), *(values[v] for v in inputs))
        return out

    return Replacement(run)


def derivative(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> Backward | None:
    """Where the program's own gradient reads the site's intermediates, the equations of
    that gradient (`passes.backward`); None when nothing outside the site reads them.
    `RewriteError` when something else does."""
    if not site.escaping:
        return None
    saved = [e for e in jaxpr.eqns if e.primitive.name in REMAT
             and any(v in site.escaping for v in e.invars)]
    if saved:
        raise RewriteError(
            "jax.checkpoint's policy saves intermediate values of the attention for the "
            "backward inside the checkpointed body, where the kernel's backward cannot "
            "replace it: use a policy that recomputes the attention (nothing_saveable, "
            "dots_with_no_batch_dims_saveable, or save_only_these_names without them)")
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jaxcompat.Literal)}
    if site.path and site.escaping & outputs and site.enclosing == jaxcompat.SHARD_MAP:
        raise RewriteError(
            "intermediate values of the attention leave the shard_map body as residuals for "
            "its transpose (jax.grad taken outside the shard_map), which is not matched: take "
            "the gradient inside the shard_map (a per-device train step that psums its "
            "gradients), or rewrite the loss: jax.grad(flash_jit(loss))")
    if site.path and site.escaping & outputs:
        raise RewriteError(
            "intermediate values of the attention leave the loop body as residuals for a "
            "backward in another body (jax.grad of a lax.scan over layers), which is not "
            "matched: put the layer under jax.checkpoint (flax nn.remat), whose backward "
            "recomputes it beside its derivative, or rewrite the loss: "
            "jax.grad(flash_jit(loss))")
    try:
        return find_backward(jaxpr, site, free_inputs(jaxpr, site), site_equations(jaxpr, site))
    except NoBackward as err:
        names = ", ".join(sorted(v.aval.str_short(short_dtypes=True) for v in site.escaping))
        raise RewriteError(
            f"intermediate values of the attention ({names}) are used outside it, and not "
            f"as jax's gradient of it: {err} (to rewrite a train step whose gradient cannot "
            "be matched, rewrite the loss instead: jax.grad(flash_jit(loss)))") from None


def recomputed(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, skip: frozenset = frozenset()
               ) -> tuple[list[Recompute], str | None]:
    """Where the program differentiates `site` under `jax.checkpoint`, the checkpointed
    bodies that recompute it for its derivative (`passes.backward.find_recomputes`), and,
    when a body rebuilds its scores but did not match, why. Bodies at a path in `skip` hold
    a site of their own, rewritten as one."""
    if site.escaping:
        return [], None
    found, missed = find_recomputes(jaxpr, site, free_inputs(jaxpr, site),
                                    site_equations(jaxpr, site), skip)
    return found, (min(missed, key=len) if missed else None)


def check(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, backward: Backward | None = None) -> None:
    """Raise `RewriteError` if dropping the site's equations (and `backward`'s, its
    derivative in the program) would change the program."""
    if site.escaping and backward is None:
        names = ", ".join(sorted(v.aval.str_short(short_dtypes=True) for v in site.escaping))
        raise RewriteError(
            f"intermediate values of the attention ({names}) are used outside it: returned, "
            "logged, or saved for a gradient taken inside the function (for a train step, "
            "rewrite the loss instead: jax.grad(flash_jit(loss)))")
    for name, operand in (("q", site.q), ("k", site.k), ("v", site.v)):
        if operand.var is None:
            raise RewriteError(f"{name} is computed inside a call the site only partly covers")
    for m in (*site.masks, *site.multipliers):
        if m.kind not in STRUCTURAL and m.var is None:
            raise RewriteError(f"the {m.kind} operand is computed inside a call the site only "
                               "partly covers")
    if site.out is None:
        raise RewriteError("the attention output is not visible at the site's level")
    for i in site.eqns:
        eqn = jaxpr.eqns[i]
        if eqn.effects:
            raise RewriteError(f"equation {eqn.primitive} of the site has effects")
        if eqn.primitive.name in CUSTOM_DERIVATIVES:
            # Part of the site is inside it (the whole site inside would sit at its level):
            # dropping it would replace the user's derivative rule with the kernel's.
            raise RewriteError(
                f"part of the attention is inside a {eqn.primitive.name} "
                f"({_callee_name(eqn)}), whose own derivative rule the kernel's would replace")


# Calls with a derivative rule of their own (jax.custom_jvp / jax.custom_vjp).
CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _callee_name(eqn: jaxcompat.JaxprEqn) -> str:
    """"mysm at model.py:3": the user's function of a custom_jvp/custom_vjp call, where
    jax's debug info keeps it."""
    body = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    info = getattr(getattr(body, "jaxpr", body), "debug_info", None)
    return getattr(info, "func_src_info", None) or "a user function"


def _plain_call(eqn: jaxcompat.JaxprEqn) -> bool:
    """A `jit` nested in the program that only groups equations: no shardings, no options."""
    p = eqn.params
    return (eqn.primitive.name in ("pjit", "jit") and not p.get("compiler_options_kvs")
            and all(type(s).__name__ == "UnspecifiedValue"
                    for s in (*p.get("in_shardings", ()), *p.get("out_shardings", ()))))


def _has_plain_call(jaxpr: jaxcompat.Jaxpr) -> bool:
    return any(_plain_call(e) or any(_has_plain_call(j) for j in jaxcompat.jaxprs_in_params(
        e.params)) for e in jaxpr.eqns)


# Bodies traced only under their mesh axes: re-tracing them alone fails on their collectives
# (a shard_map body is re-traced under jax.shard_map: `_shard_mapped`; a pmap's is kept).
_NAMED_AXES = (jaxcompat.SHARD_MAP, "xla_pmap")


def _open(body: Any) -> jaxcompat.Jaxpr:
    return body.jaxpr if isinstance(body, jaxcompat.ClosedJaxpr) else body


def _shard_mapped(eqn: jaxcompat.JaxprEqn, run: Callable, where: Manual | None) -> Callable:
    """The shard_map `eqn` (in the body `where`) as a function of its operands, its body
    evaluated by `run` (jaxpr, consts, args, its level → outputs) under the same mesh axes."""
    body = eqn.params["jaxpr"]
    consts = list(body.consts) if isinstance(body, jaxcompat.ClosedJaxpr) else []
    inside = Manual.of(eqn, where)

    def local(*xs):
        return tuple(run(_open(body), consts, xs, inside))

    return jax.shard_map(local, mesh=eqn.params["mesh"], in_specs=eqn.params["in_specs"],
                         out_specs=eqn.params["out_specs"], axis_names=set(inside.axes),
                         check_vma=inside.check_vma)


def inline_calls(closed: jaxcompat.ClosedJaxpr, where: Manual | None = None
                 ) -> jaxcompat.ClosedJaxpr:
    """`closed` (a program, or a body at the level `where`) with its plain nested `jit`s
    inlined, in every body (their equations keep their source lines and run under the
    jit's name as a scope; `shard_map` bodies, and the bodies nested in them, are re-traced
    under their mesh axes).

    jax's AD splits a jit into a forward jit and a transposed one, so a site inside a jit
    and its derivative end up in two bodies; and it writes a jit the site holds (`jnp.where`'s)
    with outputs that depend on what else the jit's caller differentiates. Inlined, the
    derivative of a site is the same equations wherever the site was written."""
    if not _has_plain_call(closed.jaxpr):
        return closed

    def inlined(param: Any, where: Manual | None) -> Any:
        try:
            if isinstance(param, jaxcompat.ClosedJaxpr) and _has_plain_call(param.jaxpr):
                return inline_calls(param, where)
            if isinstance(param, jaxcompat.Jaxpr) and not param.constvars \
                    and _has_plain_call(param):
                new = inline_calls(jaxcompat.ClosedJaxpr(param, []), where)
                return new.jaxpr if not new.consts else param
        except tracing.TraceError:
            return param  # a body that cannot be re-traced where it lives keeps its calls
        if isinstance(param, (tuple, list)) and any(
                isinstance(x, (jaxcompat.ClosedJaxpr, jaxcompat.Jaxpr)) for x in param):
            return type(param)(inlined(x, where) for x in param)
        return param

    def run(jaxpr: jaxcompat.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
            where: Manual | None) -> list[Any]:
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if isinstance(v, jaxcompat.Literal) else env[v]

        for eqn in jaxpr.eqns:
            if _plain_call(eqn):
                body = eqn.params["jaxpr"]
                scope = "/".join(x for x in (str(eqn.source_info.name_stack),
                                             eqn.params["name"]) if x)
                with jax.named_scope(scope):
                    outs = run(body.jaxpr, body.consts, [read(v) for v in eqn.invars], where)
            elif eqn.primitive.name == jaxcompat.SHARD_MAP and _has_plain_call(
                    _open(eqn.params["jaxpr"])):
                outs = _shard_mapped(eqn, run, where)(*(read(v) for v in eqn.invars))
            else:
                if eqn.primitive.name not in _NAMED_AXES:
                    eqn = eqn.replace(params={k: inlined(p, where)
                                              for k, p in eqn.params.items()})
                outs = tracing.evaluate(jaxpr, eqn, env)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def program(*args):
        return run(closed.jaxpr, closed.consts, args, where)

    return tracing.trace(where, program, closed.in_avals, closed.out_avals)


def _traced_eqn(fn: Replacement, inputs: list[Any], out: Any, where: Manual | None,
                cache: dict[Any, jaxcompat.JaxprEqn]) -> jaxcompat.JaxprEqn:
    """`fn` traced into one `jit` equation reading `inputs` and defining `out`, at the
    site's level `where`.

    A replacement with a `cache_key` is traced once per key and input types: the 24
    identical layers of a model share one traced kernel.
    """
    key = fn.cache_key
    if key is not None:
        key = (key, where, tuple(v.aval for v in inputs))
        if key in cache:
            return cache[key].replace(invars=list(inputs), outvars=[out])

    def flat(*xs):
        return (fn(dict(zip(inputs, xs))),)

    flat.__name__ = CALL
    eqn = _one_call(tracing.trace(where, jax.jit(flat), [v.aval for v in inputs], [out.aval]))
    got, want = eqn.outvars[0].aval, out.aval
    if (got.shape, got.dtype) != (want.shape, want.dtype):
        raise RewriteError(f"replacement returns {got.str_short()}, the site defines "
                           f"{want.str_short()}")
    if key is not None:
        cache[key] = eqn
    return eqn.replace(invars=list(inputs), outvars=[out])


def _one_call(closed: jaxcompat.ClosedJaxpr) -> jaxcompat.JaxprEqn:
    """The `jit` equation a traced `jax.jit(...)` consists of."""
    calls = closed.jaxpr.eqns
    if len(calls) != 1:
        raise RewriteError(f"the replacement traced to {len(calls)} equations, not one call: "
                           f"{', '.join(str(e.primitive) for e in calls[:4])}")
    return calls[0]


def _split(joint: jaxcompat.ClosedJaxpr) -> tuple[jaxcompat.ClosedJaxpr, jaxcompat.ClosedJaxpr,
                                                   list[int]]:
    """`joint` (inputs..., cotangent) → (out, grads...) as a forward (inputs → out,
    residuals...) and a backward (residuals..., inputs[i] for i in the list, cotangent →
    grads...): the backward holds every equation that reads the cotangent, directly or not."""
    jaxpr = joint.jaxpr
    *inputs, ct = jaxpr.invars
    tainted, fwd, bwd = {ct}, [], []
    for e in jaxpr.eqns:
        if any(v in tainted for v in e.invars if not isinstance(v, jaxcompat.Literal)):
            bwd.append(e)
            tainted.update(e.outvars)
        else:
            fwd.append(e)
    if jaxpr.outvars[0] in tainted:
        raise RewriteError("the replacement's output depends on its own cotangent")
    read = [v for e in bwd for v in e.invars] + list(jaxpr.outvars[1:])
    read = [v for v in dict.fromkeys(v for v in read if not isinstance(v, jaxcompat.Literal))
            if v not in tainted and v not in jaxpr.constvars]
    passed = [i for i, v in enumerate(inputs) if v in read]
    residuals = [v for v in read if v not in inputs]
    forward = jaxpr.replace(invars=inputs, outvars=[jaxpr.outvars[0], *residuals], eqns=fwd)
    backward = jaxpr.replace(invars=[*residuals, *(inputs[i] for i in passed), ct],
                             outvars=list(jaxpr.outvars[1:]), eqns=bwd)
    forward, _ = jaxcompat.dce_jaxpr(forward, [True] * len(forward.outvars), instantiate=True)
    return (joint.replace(jaxpr=forward), joint.replace(jaxpr=backward), passed)


def _as_eqn(body: jaxcompat.ClosedJaxpr, name: str, where: Manual | None
            ) -> jaxcompat.JaxprEqn:
    """`body` as one `jit` equation (fresh output variables) named `name`."""
    def flat(*xs):
        return jaxcompat.eval_jaxpr(body.jaxpr, body.consts, *xs)

    flat.__name__ = name
    return _one_call(tracing.trace(where, jax.jit(flat), [v.aval for v in body.jaxpr.invars],
                                   [v.aval for v in body.jaxpr.outvars]))


def _traced_pair(fn: Replacement, inputs: list[Any], site: JaxprSite, backward: Backward
                 ) -> tuple[jaxcompat.JaxprEqn, jaxcompat.JaxprEqn]:
    """jax's AD of `fn` as two equations: the forward, defining `site.out` and residuals,
    and the backward, reading them and `backward.cotangent` and defining `backward.grads`."""
    wrt = [inputs.index(v) for v in backward.wrt]
    ct_aval = backward.cotangent.aval
    if (ct_aval.shape, ct_aval.dtype) != (site.out.aval.shape, site.out.aval.dtype):
        raise RewriteError(f"the program's cotangent {ct_aval.str_short()} does not match the "
                           f"site's output {site.out.aval.str_short()}")
    avals = [v.aval for v in inputs]
    traced = tracing.trace(site.manual, with_gradient(fn, inputs, wrt), [*avals, ct_aval],
                           [site.out.aval, *(avals[i] for i in wrt)])
    for got, want in zip(traced.jaxpr.outvars, (site.out, *backward.grads)):
        if (got.aval.shape, got.aval.dtype) != (want.aval.shape, want.aval.dtype):
            raise RewriteError(f"replacement's derivative gives {got.aval.str_short()} where "
                               f"the program has {want.aval.str_short()}")
    forward, back, passed = _split(traced)
    fwd = _as_eqn(forward, CALL, site.manual)
    fwd = fwd.replace(invars=list(inputs), outvars=[site.out, *fwd.outvars[1:]])
    bwd = _as_eqn(back, f"{CALL}_backward", site.manual)
    bwd = bwd.replace(invars=[*fwd.outvars[1:], *(inputs[i] for i in passed),
                              backward.cotangent], outvars=list(backward.grads))
    return fwd, bwd


def prepare(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, fn: Replacement,
            cache: dict[Any, jaxcompat.JaxprEqn] | None = None) -> Replacement:
    """`fn`, checked and traced for `site` of `jaxpr` now (`.splices`), so that a
    replacement which cannot be spliced raises `RewriteError` while the site can still be
    reported native, not later in `rewrite`. `cache` is shared by the sites of a program."""
    return dataclasses.replace(
        fn, splices=_splices(jaxpr, site, fn, {} if cache is None else cache))


def _splices(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, fn: Replacement,
             cache: dict[Any, jaxcompat.JaxprEqn]) -> tuple[Splice, ...]:
    backward = fn.backward
    check(jaxpr, site, backward)
    at = next(i for i in site.eqns if site.out in jaxpr.eqns[i].outvars)
    inputs = free_inputs(jaxpr, site)
    if backward is None:
        calls = {at: _traced_eqn(fn, inputs, site.out, site.manual, cache)}
    else:
        fwd, bwd = _traced_pair(fn, inputs, site, backward)
        calls = {at: fwd, min(backward.backward): bwd}
    # The calls carry the site's own source line, so HLO metadata points at the user, and
    # its scope; set here, not while tracing, so identical sites share one trace.
    info = _info(jaxpr.eqns[at], fn.scope)
    scope = fn.scope
    own = set(site.eqns) | (backward.equations if backward is not None else set())
    splices = [Splice(site.path, frozenset(own),
                      {i: _scoped(e, scope).replace(source_info=info)
                       for i, e in calls.items()})]
    for r in fn.recomputes:
        call = _scoped(_traced_recompute(fn, inputs, r, site.manual), scope)
        splices.append(Splice(r.path, r.equations, {r.first: call.replace(source_info=info)}))
    return tuple(splices)


def _scoped(eqn: jaxcompat.JaxprEqn, scope: str | None) -> jaxcompat.JaxprEqn:
    """`eqn` with every op inside it (the kernel's loops and their bodies included) under
    the name scope `scope`, so a profile attributes each one to the site. jax lowers the
    body of a call (jit, closed_call) as a function whose ops carry only their own names
    (a scan's body too: it becomes a call in a while loop; measured on jax 0.10), while the
    bodies of while loops, conds, custom_vjp calls and checkpoints take their equation's
    names too. So the scope goes on each equation of a call's body; the others inherit it."""
    if not scope:
        return eqn

    def inside(jaxpr: jaxcompat.Jaxpr, fresh: bool) -> jaxcompat.Jaxpr:
        eqns = []
        for e in jaxpr.eqns:
            if fresh:
                stack = e.source_info.name_stack
                e = e.replace(source_info=e.source_info.replace(
                    name_stack=stack[:0].extend(scope) + stack))
            inline = e.primitive.name in _INLINE_BODIES
            eqns.append(_with_bodies(e, lambda body, inline=inline: inside(body, not inline)))
        return jaxpr.replace(eqns=eqns)

    return _with_bodies(eqn, lambda body: inside(body, True))


# Equations whose bodies jax lowers in place, under the equation's own names.
_INLINE_BODIES = frozenset({"while", "cond", "custom_jvp_call", "custom_vjp_call",
                            "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2"})


def _with_bodies(eqn: jaxcompat.JaxprEqn, change: Callable[[jaxcompat.Jaxpr], jaxcompat.Jaxpr]
                 ) -> jaxcompat.JaxprEqn:
    """`eqn` with `change` applied to each jaxpr nested in its params (closed ones keep
    their consts)."""
    def one(item: Any) -> Any:
        if isinstance(item, jaxcompat.ClosedJaxpr):
            return item.replace(jaxpr=change(item.jaxpr))
        if isinstance(item, jaxcompat.Jaxpr):
            return change(item)
        return item

    params = {}
    for key, value in eqn.params.items():
        if isinstance(value, (tuple, list)) and any(
                isinstance(x, (jaxcompat.ClosedJaxpr, jaxcompat.Jaxpr)) for x in value):
            params[key] = type(value)(one(x) for x in value)
        else:
            params[key] = one(value)
    return eqn.replace(params=params)


def _info(eqn: jaxcompat.JaxprEqn, scope: str | None) -> Any:
    info = eqn.source_info
    return info.replace(name_stack=info.name_stack.extend(scope)) if scope else info


def _traced_recompute(fn: Replacement, inputs: list[Any], r: Recompute, where: Manual | None
                      ) -> jaxcompat.JaxprEqn:
    """jax's AD of `fn` as one call reading the body's values of the site's inputs and its
    cotangent, defining the body's gradient variables: the kernel recomputes its forward."""
    both = with_gradient(fn, inputs, r.wrt)

    def grads(*args):
        return both(*args)[1:]

    grads.__name__ = f"{CALL}_recompute"
    eqn = _one_call(tracing.trace(where, jax.jit(grads),
                                  [v.aval for v in (*r.inputs, r.cotangent)],
                                  [v.aval for v in r.grads]))
    for got, want in zip(eqn.outvars, r.grads):
        if (got.aval.shape, got.aval.dtype) != (want.aval.shape, want.aval.dtype):
            raise RewriteError(f"replacement's derivative gives {got.aval.str_short()} where "
                               f"the checkpointed body has {want.aval.str_short()}")
    return eqn.replace(invars=[*r.inputs, r.cotangent], outvars=list(r.grads))


def _substitute(jaxpr: jaxcompat.Jaxpr, splices: Sequence[Splice]) -> jaxcompat.Jaxpr:
    drop: set[int] = set()
    placed: dict[int, jaxcompat.JaxprEqn] = {}
    for splice in splices:
        if drop & splice.drop or placed.keys() & splice.calls.keys():
            raise RewriteError("two sites share equations")
        drop.update(splice.drop)
        placed.update(splice.calls)
    eqns = [placed[i] if i in placed else e for i, e in enumerate(jaxpr.eqns)
            if i in placed or i not in drop]
    return jaxpr.replace(eqns=eqns)


def _rebuild(jaxpr: jaxcompat.Jaxpr, here: Path, by_path: Mapping[Path, list[Splice]]
             ) -> jaxcompat.Jaxpr:
    """`jaxpr` (at `here`) with the splices at and below it applied; interface kept."""
    deeper: dict[tuple[int, str], None] = {}
    for path in by_path:
        if len(path) > len(here) and path[:len(here)] == here:
            deeper[path[len(here)]] = None
    if deeper:
        eqns = list(jaxpr.eqns)
        for index, param in deeper:
            new = _rebuild(open_subjaxpr(eqns[index], param), here + ((index, param),), by_path)
            eqns[index] = with_subjaxpr(eqns[index], param, new)
        jaxpr = jaxpr.replace(eqns=eqns)
    if here in by_path:
        jaxpr = _substitute(jaxpr, by_path[here])
    jaxpr, _ = jaxcompat.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return jaxpr


def rewrite(closed: jaxcompat.ClosedJaxpr, replacements: Sequence[tuple[JaxprSite, Replacement]]
            ) -> jaxcompat.ClosedJaxpr:
    """`closed` with each site computed by its replacement (traced as a `jit` named `CALL`,
    or as `prepare` traced it).

    Sites must come from `detect_jaxpr(closed)`; their paths and equation indices refer to it.
    Raises `RewriteError` naming the reason when a site cannot be dropped safely.
    """
    if not replacements:
        return closed
    by_path: dict[Path, list[Splice]] = defaultdict(list)
    cache: dict[Any, jaxcompat.JaxprEqn] = {}
    for site, fn in replacements:
        splices = fn.splices
        if splices is None:
            splices = _splices(jaxpr_at(closed, site.path), site, fn, cache)
        for splice in splices:
            by_path[splice.path].append(splice)
    return closed.replace(jaxpr=_rebuild(closed.jaxpr, (), by_path))
