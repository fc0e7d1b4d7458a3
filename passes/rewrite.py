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

Everything else in the program is left as it was. The pass refuses (raises `RewriteError`) a
site whose intermediates are read outside it, or whose inputs are not visible at its level:
dropping its equations would change the program.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import jax

from hlotool import jaxcompat
from hlotool.errors import HlotoolError
from hlotool.passes.from_jaxpr import JaxprSite, Path, subjaxpr
from hlotool.passes.logits import STRUCTURAL

# Computes a site's output [out var's shape] from the site's free inputs, keyed by variable.
# A `scope` attribute names the site in profiles: the spliced call runs under that name
# scope (on top of the site's own), so XProf, TensorBoard and HLO op_name metadata show
# which site each op belongs to.
Replacement = Callable[[Mapping[Any, jax.Array]], jax.Array]


class RewriteError(HlotoolError):
    """A site cannot be substituted without changing the program; the message says why."""


def free_inputs(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> list[Any]:
    """Variables a replacement may read: those the site's equations read but do not define,
    in first-use order, then the masks' own operands (`MaskVar.var`, before the program
    broadcast them), all defined before the site's output."""
    defined, seen, out = set(), set(), []
    for i in site.eqns:
        for v in jaxpr.eqns[i].invars:
            if isinstance(v, jaxcompat.Literal) or v in defined or v in seen:
                continue
            seen.add(v)
            out.append(v)
        defined.update(jaxpr.eqns[i].outvars)
    for m in (*site.masks, *site.multipliers):
        for v in (m.var, m.key_lengths):
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

    return run


def check(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> None:
    """Raise `RewriteError` if dropping the site's equations would change the program."""
    if site.escaping:
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
        if jaxpr.eqns[i].effects:
            raise RewriteError(f"equation {jaxpr.eqns[i].primitive} of the site has effects")


def _explicit_sharding(aval: Any) -> Any:
    """The sharding an aval carries in its type (explicit-axis meshes), else None."""
    sharding = getattr(aval, "sharding", None)
    return sharding if sharding is not None and not sharding.mesh.empty else None


def _traced_eqn(fn: Replacement, inputs: list[Any], out: Any, name: str,
                cache: dict[Any, jaxcompat.JaxprEqn]) -> jaxcompat.JaxprEqn:
    """`fn` traced into one `jit` equation reading `inputs` and defining `out`.

    A replacement with a `cache_key` attribute is traced once per key and input types:
    the 24 identical layers of a model share one traced kernel.
    """
    key = getattr(fn, "cache_key", None)
    if key is not None:
        key = (key, name, tuple(v.aval for v in inputs))
        if key in cache:
            return cache[key].replace(invars=list(inputs), outvars=[out])

    def flat(*xs):
        return fn(dict(zip(inputs, xs)))

    flat.__name__ = name
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type,
                                  sharding=_explicit_sharding(v.aval))
             for v in inputs]
    closed = jax.make_jaxpr(jax.jit(flat))(*specs)
    (eqn,) = closed.jaxpr.eqns
    got, want = eqn.outvars[0].aval, out.aval
    if (got.shape, got.dtype) != (want.shape, want.dtype):
        raise RewriteError(f"replacement returns {got.str_short()}, the site defines "
                           f"{want.str_short()}")
    if key is not None:
        cache[key] = eqn
    return eqn.replace(invars=list(inputs), outvars=[out])


def _substitute(jaxpr: jaxcompat.Jaxpr, sites: Sequence[tuple[JaxprSite, Replacement]],
                name: str, cache: dict[Any, jaxcompat.JaxprEqn]) -> jaxcompat.Jaxpr:
    drop: set[int] = set()
    placed: dict[int, jaxcompat.JaxprEqn] = {}
    for site, fn in sites:
        check(jaxpr, site)
        if drop & set(site.eqns):
            raise RewriteError("two sites share equations")
        at = next(i for i in site.eqns if site.out in jaxpr.eqns[i].outvars)
        traced = _traced_eqn(fn, free_inputs(jaxpr, site), site.out, name, cache)
        # The call carries the site's own source line, so HLO metadata points at the user,
        # and its scope; set here, not while tracing, so identical sites share one trace.
        info = jaxpr.eqns[at].source_info
        scope = getattr(fn, "scope", None)
        if scope:
            info = info.replace(name_stack=info.name_stack.extend(scope))
        placed[at] = traced.replace(source_info=info)
        drop.update(site.eqns)
    eqns = [placed[i] if i in placed else e for i, e in enumerate(jaxpr.eqns)
            if i in placed or i not in drop]
    return jaxpr.replace(eqns=eqns)


def _with_sub(eqn: jaxcompat.JaxprEqn, param: str, new) -> jaxcompat.JaxprEqn:
    if param.startswith("branches["):
        branches = list(eqn.params["branches"])
        branches[int(param[9:-1])] = new
        return eqn.replace(params={**eqn.params, "branches": tuple(branches)})
    return eqn.replace(params={**eqn.params, param: new})


def _rebuild(jaxpr: jaxcompat.Jaxpr, here: Path,
             by_path: Mapping[Path, list[tuple[JaxprSite, Replacement]]], name: str,
             cache: dict[Any, jaxcompat.JaxprEqn]) -> jaxcompat.Jaxpr:
    """`jaxpr` (at `here`) with the sites at and below it substituted; interface kept."""
    deeper: dict[tuple[int, str], None] = {}
    for path in by_path:
        if len(path) > len(here) and path[:len(here)] == here:
            deeper[path[len(here)]] = None
    if deeper:
        eqns = list(jaxpr.eqns)
        for index, param in deeper:
            sub = subjaxpr(eqns[index], param)
            inner = sub.jaxpr if isinstance(sub, jaxcompat.ClosedJaxpr) else sub
            new = _rebuild(inner, here + ((index, param),), by_path, name, cache)
            new = sub.replace(jaxpr=new) if isinstance(sub, jaxcompat.ClosedJaxpr) else new
            eqns[index] = _with_sub(eqns[index], param, new)
        jaxpr = jaxpr.replace(eqns=eqns)
    if here in by_path:
        jaxpr = _substitute(jaxpr, by_path[here], name, cache)
    jaxpr, _ = jaxcompat.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    return jaxpr


def rewrite(closed: jaxcompat.ClosedJaxpr, replacements: Sequence[tuple[JaxprSite, Replacement]],
            name: str = "hlotool_flash") -> jaxcompat.ClosedJaxpr:
    """`closed` with each site computed by its replacement (traced as a `jit` named `name`).

    Sites must come from `detect_jaxpr(closed)`; their paths and equation indices refer to it.
    Raises `RewriteError` naming the reason when a site cannot be dropped safely.
    """
    if not replacements:
        return closed
    by_path: dict[Path, list[tuple[JaxprSite, Replacement]]] = defaultdict(list)
    for site, fn in replacements:
        by_path[site.path].append((site, fn))
    return closed.replace(jaxpr=_rebuild(closed.jaxpr, (), by_path, name, {}))
