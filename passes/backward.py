"""The backward of an attention site in a program that takes its own gradient (a train step).

`jax.grad` inside the traced function writes, beside the site's equations, the equations of
its derivative: residuals computed from the site's intermediates, and the transposed
equations that turn the cotangent of the site's output into cotangents of its inputs.
`find_backward` finds them without a hand-written backward pattern: it differentiates the
site's own equations with the installed jax (`jax.vjp`, as `jax.grad` does) and matches the
result, equation for equation, in the program, anchored at the site's inputs. What the
match yields, `Backward`, is what a rewrite needs to swap both directions for a kernel's:
the program's cotangent of the output, the variables holding the site's contribution to its
inputs' cotangents, and every equation the pair of kernel calls replaces.

A site whose derivative is not found this way (a backward in another loop body, a program
that differentiates only some of what jax would) is not a site to rewrite: the error says why.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat
from hlotool.errors import HlotoolError
from hlotool.passes import tracing
from hlotool.passes.from_jaxpr import JaxprSite
from hlotool.passes.tracing import Manual

# Backtracking steps one match may take before it gives up (a site's derivative is a few
# dozen equations; an unlucky order of equal candidates costs a few steps each).
_MATCH_BUDGET = 20_000


class NoBackward(HlotoolError):
    """The program's derivative of a site could not be matched; the message says why."""


@dataclasses.dataclass(frozen=True)
class Backward:
    """Where jax's AD of one site lives in the program (variables of the site's jaxpr).

    wrt        the site's inputs the program differentiates, in `free_inputs` order.
    cotangent  the program's cotangent of `site.out` (same shape and dtype).
    grads      per `wrt`, the variable holding the site's contribution to its cotangent.
    forward    indices of the equations computing the site and its residuals.
    backward   indices of the equations that read the cotangent, directly or not.
    """

    wrt: tuple[Any, ...]
    cotangent: Any
    grads: tuple[Any, ...]
    forward: frozenset[int]
    backward: frozenset[int]

    @property
    def equations(self) -> frozenset[int]:
        return self.forward | self.backward


def differentiated(inputs: Sequence[Any], site: JaxprSite, jaxpr: jaxcompat.Jaxpr,
                   constant: Mapping[Any, Any]) -> Iterator[tuple[int, ...]]:
    """Candidate sets of inputs the program differentiates, most likely first: every float
    input, then q, k and v with or without the rest, then smaller subsets of q, k, v.

    An input computed from literals alone (`constant`, as `constants` finds them: a mask's
    fill broadcast to the scores' shape) carries no tangent, so jax never differentiates
    it; counting it would make every candidate with the rest ask for a derivative the
    program does not have (a sink's, say, beside the fill's).

    Only inputs the site's equations read count. A bias, sink or head-mask operand the
    program broadcast before the site (`MaskVar.var`, the kernel's compact operand) is not
    read by them: the program's transpose of the broadcast turns the cotangent of what the
    site reads (`MaskVar.direct`) into its own, and a replacement differentiated this way
    reads the operand from `direct` (`lower.operands`)."""
    read = {v for i in site.eqns for v in jaxpr.eqns[i].invars
            if not isinstance(v, jaxcompat.Literal)}
    floating = [i for i, v in enumerate(inputs)
                if jnp.issubdtype(v.aval.dtype, jnp.inexact) and v in read
                and v not in constant]
    qkv = [inputs.index(o.var) for o in (site.q, site.k, site.v)
           if o.var in inputs and inputs.index(o.var) in floating]
    qkv = list(dict.fromkeys(qkv))
    seen = set()
    rest = [i for i in floating if i not in qkv]
    for n in range(len(qkv), 0, -1):
        for core in itertools.combinations(qkv, n):
            for r in range(len(rest), -1, -1):
                for others in itertools.combinations(rest, r):
                    cand = tuple(sorted((*core, *others)))
                    if cand not in seen:
                        seen.add(cand)
                        yield cand


def with_gradient(fn, inputs: Sequence[Any], wrt: Sequence[int]):
    """(values of `inputs`..., cotangent of the output) → (output, cotangents of inputs[wrt]):
    `fn` (a function of a {input var: value} mapping) with its vjp, as `jax.grad` writes it."""

    def both(*args):
        values, ct = list(args[:-1]), args[-1]

        def f(*d):
            full = list(values)
            for i, x in zip(wrt, d):
                full[i] = x
            return fn(dict(zip(inputs, full)))

        out, pull = jax.vjp(f, *(values[i] for i in wrt))
        return (out, *pull(ct))

    return both


def reference(own, inputs: Sequence[Any], out_aval: Any, wrt: Sequence[int],
              where: Manual | None = None) -> jaxcompat.ClosedJaxpr:
    """jax's AD of the site's own equations `own`, as the program's `jax.grad` writes it:
    a jaxpr from (inputs..., cotangent of out) to (out, cotangents of inputs[wrt]), traced
    at the site's level `where` (`passes.tracing`)."""
    avals = [v.aval for v in inputs]
    return tracing.trace(where, with_gradient(own, inputs, wrt), [*avals, out_aval],
                         [out_aval, *(avals[i] for i in wrt)])


def _matched_reference(own, inputs: Sequence[Any], out_aval: Any, wrt: Sequence[int],
                       where: Manual | None, *, with_output: bool) -> jaxcompat.Jaxpr:
    """`reference`'s jaxpr as the program is searched for it: its outputs the site's output
    (unless not `with_output`, for a recompute that never computes it) and the cotangents,
    its dead equations dropped."""
    try:
        ref = reference(own, inputs, out_aval, wrt, where)
    except tracing.TraceError as err:
        raise NoBackward(str(err)) from None
    if ref.consts:
        raise NoBackward("the site's derivative closes over constants")
    jaxpr = ref.jaxpr if with_output else ref.jaxpr.replace(outvars=ref.jaxpr.outvars[1:])
    # Dead equations dropped at this level only: pruning a call's outputs (as dce_jaxpr
    # does) would change it from the call the program holds.
    live = _live(jaxpr)
    return jaxpr.replace(eqns=[e for i, e in enumerate(jaxpr.eqns) if i in live])


def find_backward(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, inputs: Sequence[Any], own
                  ) -> Backward:
    """The equations of `jaxpr` that are jax's AD of `site`; `NoBackward` says why not.

    inputs: the site's free inputs (`rewrite.free_inputs`); own: its equations as a function
    of them (`rewrite.site_equations`)."""
    program = _Program(jaxpr)
    failures = []
    for wrt in differentiated(inputs, site, jaxpr, program.constant):
        try:
            body = _matched_reference(own, inputs, site.out.aval, wrt, site.manual,
                                      with_output=True)
            env, used = _match(body, program, dict(zip(body.invars[:-1], inputs)))
        except NoBackward as err:
            failures.append(str(err))
            continue
        grads = tuple(env.get(v) for v in body.outvars[1:])
        ct = env.get(body.invars[-1])
        if ct is None or any(g is None or g in program.constant for g in grads):
            failures.append("the program differentiates other inputs of the site")
            continue
        if env.get(body.outvars[0]) is not site.out:
            failures.append("the matched forward computes another output")
            continue
        return program.split(site, tuple(inputs[i] for i in wrt), ct, grads, used)
    reason = min(failures, key=len) if failures else "no input of the site is a float"
    raise NoBackward(reason)


# Primitives of `jax.checkpoint`: under AD, one equation whose body recomputes what the
# forward did not save and runs the backward from it (`differentiated=True`).
REMAT = ("remat2", "checkpoint", "remat")


@dataclasses.dataclass(frozen=True)
class Recompute:
    """jax's AD of a site under `jax.checkpoint` when the checkpointed body recomputes the
    site only for its derivative (the site's output itself is not needed there), so the
    body holds no site of its own: the scores and probabilities are rebuilt from q, k, v
    and turned, with the cotangent, into the inputs' cotangents. Variables of the body.

    path       the body: `site.path + ((index of the remat equation, "jaxpr"),)`.
    inputs     per site input (`free_inputs` order), the body variable holding its value.
    wrt        indices into `inputs` of those the body differentiates.
    cotangent  the body's cotangent of the site's output.
    grads      per `wrt`, the variable holding the site's contribution to its cotangent.
    equations  indices of the body equations this replaces.
    first      where the replacement goes: the first of them to read the cotangent.
    """

    path: tuple
    inputs: tuple[Any, ...]
    wrt: tuple[int, ...]
    cotangent: Any
    grads: tuple[Any, ...]
    equations: frozenset[int]
    first: int


def find_recomputes(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, inputs: Sequence[Any], own,
                    skip: frozenset = frozenset()) -> tuple[list[Recompute], list[str]]:
    """The bodies of `jax.checkpoint` equations in `jaxpr` that recompute `site` for its
    derivative, and why each body that rebuilds the site's scores did not match.

    A body's match binds the site's inputs to body variables. The replacement computes the
    site's function of those values, so each must hold the value the site's own input does
    (or be q, k or v, whose values the form makes no assumption about): the same operand
    passed to the checkpoint, or computed the same way from the same values (a causal
    mask's iotas, a broadcast of a passed padding mask)."""
    found, missed = [], []
    scores = {str(jaxpr.eqns[i].outvars[0].aval) for i in site.eqns
              if jaxpr.eqns[i].primitive.name == "exp"}
    qkv = {o.var for o in (site.q, site.k, site.v)}
    constant = constants(jaxpr)
    for at, eqn in enumerate(jaxpr.eqns):
        path = site.path + ((at, "jaxpr"),)
        if eqn.primitive.name not in REMAT or not eqn.params.get("differentiated") \
                or path in skip:
            continue
        body = eqn.params["jaxpr"]
        body = body.jaxpr if isinstance(body, jaxcompat.ClosedJaxpr) else body
        if not any(e.primitive.name == "exp" and str(e.outvars[0].aval) in scores
                   for e in body.eqns):
            continue
        try:
            found.append(_recompute(jaxpr, eqn, body, path, site, inputs, own, qkv, constant))
        except NoBackward as err:
            missed.append(str(err))
    return found, missed


def _recompute(jaxpr: jaxcompat.Jaxpr, eqn: jaxcompat.JaxprEqn, body: jaxcompat.Jaxpr,
               path: tuple, site: JaxprSite, inputs: Sequence[Any], own, qkv: set,
               constant: Mapping[Any, Any]) -> Recompute:
    program = _Program(body)
    passed = {}
    for outer, inner in zip(eqn.invars, body.invars):
        if not isinstance(outer, jaxcompat.Literal):
            passed.setdefault(outer, inner)
    same = _SameValue(jaxpr, eqn, body)
    failures = []
    for wrt in differentiated(inputs, site, jaxpr, constant):
        try:
            grads_only = _matched_reference(own, inputs, site.out.aval, wrt, site.manual,
                                            with_output=False)
            anchors = {r: passed[v] for r, v in zip(grads_only.invars, inputs) if v in passed}
            env, used = _match(grads_only, program, anchors)
        except NoBackward as err:
            failures.append(str(err))
            continue
        # An input the site's derivative does not read (the key a dropout mask is drawn
        # from, for a kernel that draws it) is bound to the body's value shown to equal it.
        bound = tuple(env.get(r) or same.find(v) for r, v in zip(grads_only.invars, inputs))
        ct = env.get(grads_only.invars[-1])
        grads = tuple(env.get(v) for v in grads_only.outvars)
        if ct is None or any(b is None for b in bound) or any(
                g is None or g in program.constant for g in grads):
            failures.append("the checkpointed body differentiates other inputs of the site")
            continue
        for v, b in zip(inputs, bound):
            if v not in qkv and not same(v, b):
                raise NoBackward(f"the checkpointed body's {v.aval.str_short()} operand is "
                                 "not shown to hold the value the site reads")
        return Recompute(path, bound, tuple(wrt), ct, grads,
                         *program.replaced(used, ct, grads, (*bound, ct)))
    raise NoBackward(min(failures, key=len) if failures else "no input of the site is a float")


class _SameValue:
    """Whether a variable of `jaxpr` and one of the body of its equation `eqn` hold the same
    value: the body's input that `eqn` passes it, or both computed by the same equations from
    values that are the same (a structural proof, not a numerical check)."""

    def __init__(self, jaxpr: jaxcompat.Jaxpr, eqn: jaxcompat.JaxprEqn,
                 body: jaxcompat.Jaxpr):
        self.outer = {v: e for e in jaxpr.eqns for v in e.outvars}
        self.inner = {v: e for e in body.eqns for v in e.outvars}
        self.passed = {b: o for o, b in zip(eqn.invars, body.invars)}
        self.memo: dict[tuple[int, int], bool] = {}

    def find(self, a: Any) -> Any | None:
        """A variable of the body holding the value of `a`, or None."""
        passed = [b for b, o in self.passed.items() if o is a]
        if passed:
            return passed[0]
        return next((b for b in self.inner if str(b.aval) == str(a.aval) and self(a, b)),
                    None)

    def __call__(self, a: Any, b: Any, depth: int = 0) -> bool:
        a_lit, b_lit = isinstance(a, jaxcompat.Literal), isinstance(b, jaxcompat.Literal)
        if a_lit or b_lit:
            return a_lit and b_lit and _literal(a) == _literal(b)
        if b in self.passed:
            return self.passed[b] is a
        key = (id(a), id(b))
        if key not in self.memo:
            self.memo[key] = depth < 32 and self._same_equation(a, b, depth)
        return self.memo[key]

    def _same_equation(self, a, b, depth) -> bool:
        ea, eb = self.outer.get(a), self.inner.get(b)
        if ea is None or eb is None or ea.primitive is not eb.primitive or ea.effects \
                or len(ea.invars) != len(eb.invars) or not _same_params(ea.params, eb.params):
            return False
        if ea.outvars.index(a) != eb.outvars.index(b):
            return False
        return all(self(x, y, depth + 1) for x, y in zip(ea.invars, eb.invars))


class _Program:
    """The jaxpr being searched, indexed: readers per variable, definitions, liveness, and
    a structural key for variables that hold constants (broadcast zeros, iotas), so a
    constant computed twice matches either copy."""

    def __init__(self, jaxpr: jaxcompat.Jaxpr):
        self.jaxpr = jaxpr
        self.readers: dict[Any, list[int]] = {}
        self.definer: dict[Any, int] = {}
        self.constant = constants(jaxpr)
        for i, e in enumerate(jaxpr.eqns):
            for v in e.invars:
                if not isinstance(v, jaxcompat.Literal):
                    self.readers.setdefault(v, []).append(i)
            for v in e.outvars:
                self.definer[v] = i
        self.by_primitive: dict[str, list[int]] = {}
        for i, e in enumerate(jaxpr.eqns):
            self.by_primitive.setdefault(e.primitive.name, []).append(i)
        self.live = _live(jaxpr)

    def split(self, site: JaxprSite, wrt, ct, grads, used: frozenset[int]) -> Backward:
        """The matched equations as forward and backward; `NoBackward` where dropping them
        would change the program."""
        backward = self._reading(used, ct)
        forward = (used - backward) | set(site.eqns)
        at = next(i for i in site.eqns if site.out in self.jaxpr.eqns[i].outvars)
        if at > min(backward):
            raise NoBackward("the backward starts before the forward ends")
        self._read_only_inside(forward | backward, {site.out, *grads})
        return Backward(tuple(wrt), ct, tuple(grads), frozenset(forward), frozenset(backward))

    def replaced(self, used: frozenset[int], ct, grads, reads) -> tuple[frozenset[int], int]:
        """The matched equations of a recompute, and where one call replacing them goes;
        `NoBackward` where dropping them would change the program or that call would read
        a value defined after it."""
        first = min(self._reading(used, ct))
        self._read_only_inside(used, set(grads))
        for v in reads:
            at = self.definer.get(v)
            if at is not None and (at in used or at >= first):
                raise NoBackward("the recompute reads a value defined after its backward begins")
        return frozenset(used), first

    def _reading(self, used: frozenset[int], ct) -> set[int]:
        """The equations of `used` that read the cotangent `ct`, directly or not."""
        tainted, reading = {ct}, set()
        for i in sorted(used):
            eqn = self.jaxpr.eqns[i]
            if any(v in tainted for v in eqn.invars if not isinstance(v, jaxcompat.Literal)):
                reading.add(i)
                tainted.update(eqn.outvars)
        if not reading:
            raise NoBackward("the site's derivative does not read the output's cotangent")
        return reading

    def _read_only_inside(self, dropped: set[int], keep: set) -> None:
        """`NoBackward` unless every value the `dropped` equations define, but those in
        `keep`, is read by dropped equations only (or dead code) and is no output."""
        outputs = {v for v in self.jaxpr.outvars if not isinstance(v, jaxcompat.Literal)}
        for i in dropped:
            for v in self.jaxpr.eqns[i].outvars:
                if v in keep:
                    continue
                if v in outputs or any(r not in dropped and r in self.live
                                       for r in self.readers.get(v, ())):
                    raise NoBackward(
                        f"a value of the site's derivative ({v.aval.str_short()}) is also "
                        "used outside it")


def _live(jaxpr: jaxcompat.Jaxpr) -> set[int]:
    """Indices of the equations the outputs (or effects) depend on."""
    need = {v for v in jaxpr.outvars if not isinstance(v, jaxcompat.Literal)}
    live = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        if e.effects or any(v in need for v in e.outvars):
            live.add(i)
            need.update(v for v in e.invars if not isinstance(v, jaxcompat.Literal))
    return live


def constants(jaxpr: jaxcompat.Jaxpr) -> dict[Any, Any]:
    """The variables of `jaxpr` computed from literals alone, each with its `constant_key`
    (and output index), so a constant computed twice has one key."""
    constant: dict[Any, Any] = {}
    for e in jaxpr.eqns:
        key = constant_key(e, constant)
        if key is not None:
            for n, v in enumerate(e.outvars):
                constant[v] = (key, n)
    return constant


def constant_key(eqn: jaxcompat.JaxprEqn, constant: Mapping[Any, Any]) -> Any | None:
    """A hashable description of what `eqn` computes when it reads only literals and
    constants (`constant`: var → key), else None."""
    args = []
    for v in eqn.invars:
        if isinstance(v, jaxcompat.Literal):
            args.append(("literal", _literal(v)))
        elif v in constant:
            args.append(constant[v])
        else:
            return None
    if eqn.effects or any(True for _ in jaxcompat.jaxprs_in_params(eqn.params)):
        return None
    return (eqn.primitive.name, _params_key(eqn.params), tuple(args),
            tuple(str(v.aval) for v in eqn.outvars))


def _literal(v: Any) -> Any:
    return (str(v.aval), np.asarray(v.val).tobytes())


def _params_key(params: Mapping[str, Any]) -> str:
    return repr(sorted((k, _param(p)) for k, p in params.items()))


def _param(p: Any) -> Any:
    if isinstance(p, (jaxcompat.ClosedJaxpr, jaxcompat.Jaxpr)):
        return str(p)
    if isinstance(p, (tuple, list)):
        return tuple(_param(x) for x in p)
    if isinstance(p, np.ndarray):
        return (p.dtype.str, p.shape, p.tobytes())
    return repr(p)


def _same_params(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[k] is b[k] or _param(a[k]) == _param(b[k]) for k in a)


def _match(ref: jaxcompat.Jaxpr, program: _Program, anchors: dict[Any, Any]
           ) -> tuple[dict[Any, Any], frozenset[int]]:
    """Map every equation of `ref` to its own equation of the program, each reading what
    the mapping says (`anchors`: ref inputs → program variables; the cotangent is bound by
    the first equation that reads it). Returns the variable map and the program equations
    used; `NoBackward` names the first ref equation without a counterpart."""
    ref_constant: dict[Any, Any] = {}
    work = []
    for e in ref.eqns:
        key = constant_key(e, ref_constant)
        if key is not None:
            for n, v in enumerate(e.outvars):
                ref_constant[v] = (key, n)
        else:
            work.append(e)
    budget = [_MATCH_BUDGET]
    deepest = [0, work[0] if work else None]

    def matches(e, p: int, env: dict) -> dict | None:
        pe = program.jaxpr.eqns[p]
        if (pe.primitive is not e.primitive or len(pe.invars) != len(e.invars)
                or len(pe.outvars) != len(e.outvars) or not _same_params(e.params, pe.params)):
            return None
        new = {}
        for rv, pv in zip(e.invars, pe.invars):
            if isinstance(rv, jaxcompat.Literal):
                if not isinstance(pv, jaxcompat.Literal) or _literal(rv) != _literal(pv):
                    return None
            elif rv in ref_constant:
                if isinstance(pv, jaxcompat.Literal) or program.constant.get(pv) != ref_constant[rv]:
                    return None
            else:
                have = env.get(rv, new.get(rv))
                if have is None:
                    if isinstance(pv, jaxcompat.Literal) or rv.aval.shape != pv.aval.shape \
                            or rv.aval.dtype != pv.aval.dtype:
                        return None
                    new[rv] = pv
                elif have is not pv:
                    return None
        for rv, pv in zip(e.outvars, pe.outvars):
            have = env.get(rv)
            if have is not None and have is not pv:
                return None
            new[rv] = pv
        return new

    def candidates(e, env: dict, used: set) -> list[int]:
        for rv in e.outvars:
            if rv in env:
                p = program.definer.get(env[rv])
                return [] if p is None or p in used else [p]
        pools = [program.readers.get(env[rv], []) for rv in e.invars
                 if not isinstance(rv, jaxcompat.Literal) and rv in env]
        pool = min(pools, key=len) if pools else program.by_primitive.get(e.primitive.name, [])
        return [p for p in pool if p not in used]

    def anchored(e, env: dict) -> bool:
        return any(rv in env for rv in e.outvars) or any(
            not isinstance(rv, jaxcompat.Literal) and rv in env for rv in e.invars)

    def solve(todo: list, env: dict, used: set) -> tuple[dict, set] | None:
        if not todo:
            return env, used
        budget[0] -= 1
        if budget[0] < 0:
            raise NoBackward("the search for the site's derivative took too many steps")
        pick = next((n for n, e in enumerate(todo) if anchored(e, env)), 0)
        e = todo[pick]
        rest = todo[:pick] + todo[pick + 1:]
        if len(work) - len(todo) > deepest[0]:
            deepest[:] = [len(work) - len(todo), e]
        for p in candidates(e, env, used):
            new = matches(e, p, env)
            if new is not None:
                got = solve(rest, {**env, **new}, used | {p})
                if got is not None:
                    return got
        return None

    got = solve(work, dict(anchors), set())
    if got is None:
        e = deepest[1]
        raise NoBackward(f"the program has no counterpart of its derivative's `{e.primitive}` "
                         "equation")
    env, used = got
    return env, frozenset(used)
