"""Recompute in the backward loop the attention a forward loop saves for it.

jax's AD of a `lax.scan` over layers (without `jax.checkpoint`) writes two loops: the
forward loop's body computes each layer and returns, stacked over the iterations, every
value the backward needs, the attention's probabilities among them ([n, B, H, Lq, Lk]); the
backward loop reads them back as scanned operands. A site whose intermediates leave its
body is one no kernel can take: a flash kernel never holds the probabilities.

`recompute_in_backward` moves the site to where `jax.checkpoint` would put it: the forward
loop returns the site's inputs instead (q, k, v and its mask operands, what a flash kernel
saves), and the backward loop's body computes the site again from them, under the name
scope `RECOMPUTED`, before the equations that read its values. The program computes the
same values from the same inputs; afterwards the forward loop's site keeps nothing for the
backward, and the backward loop's site stands beside its derivative, where the rewrite
pass matches it (`passes.backward.find_backward`).

A dropout multiplier the forward body draws from a key is recomputed with the site from
the key rather than saved (`_pulled`): the backward loop then reads the bits it is made of,
as the forward loop does, so its site is detected with its dropout, and no [n, B, H, Lq, Lk]
multiplier is kept. A sink column is recomputed from the per-head logits it broadcasts, for
the same reason: saved, the [B, H, Lq, 1] column would not read as one logit per head.

It leaves a loop pair as it is unless every intermediate the site lets out is a stacked
output of its forward loop read only by one other loop as a scanned operand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax

from hlotool import jaxcompat
from hlotool.passes import tracing
from hlotool.passes.graph import RANDOM_BITS
from hlotool.passes.rewrite import free_inputs
from hlotool.passes.from_jaxpr import (
    JaxprSite, Path, detect_jaxpr, jaxpr_at, manual_at, open_subjaxpr, with_subjaxpr,
)

# The name scope of the recomputed equations (in profiles: ".../hlotool_recompute/...").
RECOMPUTED = "hlotool_recompute"


@dataclasses.dataclass(frozen=True)
class _Moved:
    """What moves of one site: its equations, those of the forward body that read its
    intermediates (jax puts there the part of the derivative it can compute early, such as
    1/sum² of the softmax) and those drawing its dropout multiplier (`_pulled`), in body order;
    what they read; every intermediate they define that the body returns (stacked per
    iteration, for the backward loop); and the producers' values the body returns, which
    the backward loop may read recomputed instead."""

    site: JaxprSite
    eqns: tuple[int, ...]
    inputs: tuple
    leaving: frozenset
    recomputable: frozenset = frozenset()


@dataclasses.dataclass(frozen=True)
class _Loops:
    """A forward loop (`forward`, an equation index in the jaxpr at `level`) whose sites let
    intermediates out only as stacked outputs, and the loop that reads them (`backward`)."""

    level: Path
    forward: int
    backward: int
    moved: tuple[_Moved, ...]


def recomputed_here(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> bool:
    """Whether `site` (of `jaxpr`) is one `recompute_in_backward` put in a backward loop."""
    return any(RECOMPUTED in str(jaxpr.eqns[i].source_info.name_stack) for i in site.eqns)


def recompute_in_backward(closed: jaxcompat.ClosedJaxpr, sites: Sequence[JaxprSite],
                          function: str = "") -> tuple[jaxcompat.ClosedJaxpr, list[JaxprSite], int]:
    """`closed` with each forward loop's saved attention recomputed in its backward loop,
    its sites, and how many sites moved; `closed`, `sites` and 0 when nothing moved.

    `sites` are `detect_jaxpr(closed, function)`."""
    sites, tried, count = list(sites), set(), 0
    while True:
        pending = [g for g in _loop_pairs(closed, sites)
                   if (g.level, g.forward, g.backward) not in tried]
        if not pending:
            return closed, sites, count
        loops = pending[0]
        tried.add((loops.level, loops.forward, loops.backward))
        try:
            moved = _recompute(closed, loops)
        except (tracing.TraceError, TypeError, ValueError):
            continue  # a loop pair that cannot be re-traced where it lives keeps its residuals
        # Equation indices shift where the pair was re-traced: what was tried is new.
        closed, sites, tried = moved, detect_jaxpr(moved, function), set()
        count += len(loops.moved)


def _vars(atoms) -> set:
    return {v for v in atoms if not isinstance(v, jaxcompat.Literal)}


def _loop_pairs(closed: jaxcompat.ClosedJaxpr, sites: Sequence[JaxprSite]) -> list[_Loops]:
    grouped: dict[tuple[Path, int], list[_Moved | None]] = {}
    for site in sites:
        if site.escaping and site.enclosing == "scan" and site.path[-1][1] == "jaxpr":
            level, forward = site.path[:-1], site.path[-1][0]
            grouped.setdefault((level, forward), []).append(
                _moved(jaxpr_at(closed, level).eqns[forward], site))
    pairs = []
    for (level, forward), moved in grouped.items():
        if None in moved or len(set().union(*(m.eqns for m in moved))) < sum(
                len(m.eqns) for m in moved):
            continue
        backward = _reader(jaxpr_at(closed, level), forward,
                           frozenset().union(*(m.leaving for m in moved)))
        if backward is not None:
            pairs.append(_Loops(level, forward, backward, tuple(moved)))
    return pairs


def _moved(loop: jaxcompat.JaxprEqn, site: JaxprSite) -> _Moved | None:
    """None where the site's intermediates feed the loop's carry or effects, so that
    recomputing them elsewhere would not free them."""
    groups = jaxcompat.scan_groups(loop)
    if groups is None:
        return None
    body = loop.params["jaxpr"].jaxpr
    site_inputs = free_inputs(body, site)
    sinks = {m.direct for m in site.masks if m.kind == "sinks"}
    pulled = _pulled(body, site_inputs, groups, sinks)
    own, later, tainted = set(site.eqns), [], set(site.escaping)
    for i, eqn in enumerate(body.eqns):
        if i not in own and _vars(eqn.invars) & tainted:
            later.append(i)
            tainted |= set(eqn.outvars)
    eqns = sorted(own | pulled | set(later))
    if any(body.eqns[i].effects for i in eqns) or tainted & _vars(body.outvars[:groups[1]]) \
            or any(_vars(body.eqns[i].invars) & tainted - site.escaping for i in own):
        return None
    made = {v for i in pulled for v in body.eqns[i].outvars}
    inputs, defined = [v for v in site_inputs if v not in made], set(made)
    for i in eqns:
        for v in body.eqns[i].invars:
            if not isinstance(v, jaxcompat.Literal) and v not in defined and v not in inputs:
                inputs.append(v)
        defined |= set(body.eqns[i].outvars)
    leaving = frozenset(tainted & _vars(body.outvars))
    recomputable = frozenset(made & _vars(body.outvars[groups[1]:]))
    return _Moved(site, tuple(eqns), tuple(inputs), leaving, recomputable - leaving)


# What the backward loop cannot recompute cheaply: contractions (the work a flash kernel
# saves q, k, v to avoid redoing elsewhere) and anything with a body of its own to run.
_COSTLY = frozenset({"dot_general", "conv_general_dilated", "scan", "while", "cond",
                     "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _primitives(eqn: jaxcompat.JaxprEqn) -> set[str]:
    """The primitives `eqn` runs, its own and those of the bodies it holds."""
    names = {eqn.primitive.name}
    for jaxpr in jaxcompat.jaxprs_in_params(eqn.params):
        for inner in jaxpr.eqns:
            names |= _primitives(inner)
    return names


def _nbytes(v) -> int:
    return math.prod(v.aval.shape) * getattr(v.aval.dtype, "itemsize", 8)


def _pulled(body: jaxcompat.Jaxpr, inputs: Sequence, groups: tuple[int, int, int],
            sinks: set) -> set[int]:
    """Indices of the forward body's equations that make a dropout multiplier the site
    reads, to recompute with it: the cheap equations (no contraction, loop or effect) from
    what the backward loop has anyway (the loop's invariant and scanned operands, the
    key's slice among them) to the multiplier, where what they read is smaller than what
    they make. Pure equations recomputed from the same operands give the same values, a
    key's bits included.

    Only a multiplier drawn from bits moves, and the site's `sinks` (the variables its
    concatenate reads): the multiplier's [B, H, Lq, Lk] saved for the backward is what a
    flash kernel is for avoiding, and only from its bits is it detected as dropout there;
    a sink column is detected as one logit per head only from the broadcast that makes it.
    Other inputs keep their way to the backward loop (a mask's broadcast recomputed there
    would show the backward match a second operand for it)."""
    consts, carry, _ = groups
    producer = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}
    given = {*body.constvars, *body.invars[:consts], *body.invars[consts + carry:]}
    best: dict = {}  # var -> (bytes the backward must be handed to have it, recomputed?)
    runs: dict[int, set[str]] = {}

    def ops(i: int) -> set[str]:
        if i not in runs:
            runs[i] = _primitives(body.eqns[i])
        return runs[i]

    def cost(v) -> int:
        if isinstance(v, jaxcompat.Literal) or v in given:
            return 0
        if v not in best:
            i = producer.get(v)
            best[v] = (_nbytes(v), False)
            if i is not None and not (ops(i) & _COSTLY) and not body.eqns[i].effects:
                via = sum(cost(u) for u in body.eqns[i].invars)
                if via < best[v][0]:
                    best[v] = (via, True)
        return best[v][0]

    def cone(v) -> set[int]:
        found, pending = set(), [v]
        while pending:
            u = pending.pop()
            if isinstance(u, jaxcompat.Literal):
                continue
            cost(u)
            if u in best and best[u][1] and producer[u] not in found:
                found.add(producer[u])
                pending.extend(body.eqns[producer[u]].invars)
        return found

    pulled: set[int] = set()
    for v in inputs:
        eqns = cone(v)
        if v in sinks or any(ops(i) & RANDOM_BITS for i in eqns):
            pulled |= eqns
    return pulled


def _reader(jaxpr: jaxcompat.Jaxpr, forward: int, leaving: frozenset) -> int | None:
    """The index of the one loop reading, as scanned operands, the stacked values the
    forward loop's body returns of `leaving`; None unless that loop is all that reads them."""
    loop = jaxpr.eqns[forward]
    body = loop.params["jaxpr"].jaxpr
    stacked = {loop.outvars[p] for p, v in enumerate(body.outvars) if v in leaving}
    if stacked & _vars(jaxpr.outvars):
        return None
    readers = {n for n, e in enumerate(jaxpr.eqns) if stacked & _vars(e.invars)}
    if len(readers) != 1:
        return None
    (n,) = readers
    reader = jaxpr.eqns[n]
    theirs = jaxcompat.scan_groups(reader) if reader.primitive.name == "scan" else None
    if theirs is None or stacked & _vars(reader.invars[:theirs[0] + theirs[1]]):
        return None
    return n


def _scan(eqn: jaxcompat.JaxprEqn, step, init: list, xs: list) -> tuple[list, list]:
    """`lax.scan` of `step` as `eqn` runs its body: same length, direction and unrolling."""
    p = eqn.params
    carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return list(carry), list(ys)


def _recompute(closed: jaxcompat.ClosedJaxpr, loops: _Loops) -> jaxcompat.ClosedJaxpr:
    jaxpr = jaxpr_at(closed, loops.level)
    fwd, bwd = jaxpr.eqns[loops.forward], jaxpr.eqns[loops.backward]
    f_consts, f_carry, _ = jaxcompat.scan_groups(fwd)
    b_consts, b_carry, _ = jaxcompat.scan_groups(bwd)
    f_body, b_body = fwd.params["jaxpr"], bwd.params["jaxpr"]
    invariant = f_body.jaxpr.invars[:f_consts]
    # The forward loop's scanned operands, by the body variable that reads their slices.
    slices = {v: f_consts + f_carry + n
              for n, v in enumerate(f_body.jaxpr.invars[f_consts + f_carry:])}
    own_consts = dict(zip(f_body.jaxpr.constvars, f_body.consts))

    # Forward body outputs no longer returned, and what the backward body reads in their
    # place: for each of its operands at such an output, the intermediate it held.
    leaving = frozenset().union(*(m.leaving for m in loops.moved))
    recomputable = frozenset().union(*(m.recomputable for m in loops.moved))
    # A recomputed producer's value stops being saved where only the backward loop's
    # scanned operands read it.
    read_elsewhere = _vars([*jaxpr.outvars, *bwd.invars[:b_consts + b_carry], *(
        u for n, e in enumerate(jaxpr.eqns) if n != loops.backward for u in e.invars)])
    dropped = {p for p, v in enumerate(f_body.jaxpr.outvars) if v in leaving or (
        p >= f_carry and v in recomputable and fwd.outvars[p] not in read_elsewhere)}
    stacked = {fwd.outvars[p]: f_body.jaxpr.outvars[p] for p in dropped}
    held = {q: stacked[v] for q, v in enumerate(bwd.invars) if v in stacked}
    # The moved equations' inputs, as the backward loop reads them: the forward loop's own
    # operands (loop-invariant, or scanned alike), stacked outputs it already scans, or new
    # stacked outputs (`extra`).
    scanned = {f_body.jaxpr.outvars[p]: bwd.invars.index(fwd.outvars[p])
               for p in range(f_carry, len(fwd.outvars))
               if p not in dropped and fwd.outvars[p] in bwd.invars[b_consts + b_carry:]}
    # A forward operand the backward loop scans too (jax passes q, k, v read from outside
    # the loop to both): the recompute reads the backward body's own slice of it, the
    # variable its derivative reads, not a second slice of the same array.
    b_xs = {v: q for q in range(b_consts + b_carry, len(bwd.invars))
            if q not in held and not isinstance(v := bwd.invars[q], jaxcompat.Literal)}
    shared = {}
    recomputes, extra, sliced = [], [], []
    for m in loops.moved:
        for v in m.inputs:
            if v in slices and not isinstance(fwd.invars[slices[v]], jaxcompat.Literal) \
                    and fwd.invars[slices[v]] in b_xs:
                shared[v] = b_xs[fwd.invars[slices[v]]]
            elif v in slices:
                sliced.append(v)
            elif v not in invariant and v not in own_consts and v not in scanned:
                extra.append(v)
        wanted = [*dict.fromkeys(v for v in held.values()
                                 if v in m.leaving or v in m.recomputable), m.site.out]
        recomputes.append((m.inputs, f_body.jaxpr.replace(
            constvars=[], invars=list(m.inputs), outvars=wanted,
            eqns=[f_body.jaxpr.eqns[i] for i in m.eqns])))
    extra, sliced = list(dict.fromkeys(extra)), list(dict.fromkeys(sliced))
    kept = [p for p in range(f_carry, len(fwd.outvars)) if p not in dropped]
    f_new = f_body.jaxpr.replace(
        outvars=[*f_body.jaxpr.outvars[:f_carry], *(f_body.jaxpr.outvars[p] for p in kept),
                 *extra])
    # What only the dropped outputs read goes with them.
    f_new, _ = jaxcompat.dce_jaxpr(f_new, [True] * len(f_new.outvars), instantiate=True)
    b_scanned = [q for q in range(b_consts + b_carry, len(bwd.invars)) if q not in held]

    def forward(values: list) -> tuple[list, list]:
        def step(carry, x):
            outs = jaxcompat.eval_jaxpr(f_new, f_body.consts, *values[:f_consts], *carry, *x)
            return outs[:f_carry], outs[f_carry:]

        carry, ys = _scan(fwd, step, values[f_consts:f_consts + f_carry],
                          values[f_consts + f_carry:])
        outs: list = [*carry, *([None] * (len(fwd.outvars) - f_carry))]
        for p, y in zip(kept, ys):
            outs[p] = y
        return outs, ys[len(kept):]

    def backward(values: list, outer: list, extras: list) -> list:
        """`outer`: the forward loop's operands; `extras`: its new stacked outputs."""
        def step(carry, x):
            operands = list(values)
            operands[b_consts:b_consts + b_carry] = carry
            for q, value in zip(b_scanned, x):
                operands[q] = value
            known = {**own_consts, **dict(zip(invariant, outer))}
            known.update((v, operands[q]) for v, q in (*scanned.items(), *shared.items()))
            known.update(zip([*extra, *sliced], x[len(b_scanned):]))
            with jax.named_scope(RECOMPUTED):
                for inputs, body in recomputes:
                    known.update(zip(body.outvars, jaxcompat.eval_jaxpr(
                        body, (), *(known[v] for v in inputs))))
            for q, v in held.items():
                operands[q] = known[v]
            outs = jaxcompat.eval_jaxpr(b_body.jaxpr, b_body.consts, *operands)
            return outs[:b_carry], outs[b_carry:]

        carry, ys = _scan(bwd, step, values[b_consts:b_consts + b_carry],
                          [*(values[q] for q in b_scanned), *extras,
                           *(outer[slices[v]] for v in sliced)])
        return [*carry, *ys]

    consts = closed.consts if not loops.level else []

    def program(*args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if isinstance(v, jaxcompat.Literal) else env[v]

        extras: list = []
        for n, eqn in enumerate(jaxpr.eqns):
            if n == loops.forward:
                outs, extras = forward([read(v) for v in eqn.invars])
            elif n == loops.backward:
                # The operands it reads of the dropped outputs are recomputed in its body.
                outs = backward([None if _vars([v]) & stacked.keys() else read(v)
                                 for v in eqn.invars],
                                [read(u) for u in fwd.invars], extras)
            else:
                outs = tracing.evaluate(jaxpr, eqn, env)
            env.update((v, o) for v, o in zip(eqn.outvars, outs) if o is not None)
        return [read(v) for v in jaxpr.outvars]

    if not loops.level:
        return tracing.trace(None, program, closed.in_avals, closed.out_avals)
    if jaxpr.constvars:
        raise tracing.TraceError("the loops' enclosing body has constants of its own")
    where = manual_at(closed, loops.level)
    traced = tracing.trace(where, program, [v.aval for v in jaxpr.invars],
                           [v.aval for v in jaxpr.outvars])
    if traced.consts:
        raise tracing.TraceError("the re-traced loops close over constants")
    return closed.replace(jaxpr=_replaced(closed.jaxpr, loops.level, traced.jaxpr))


def _replaced(jaxpr: jaxcompat.Jaxpr, path: Path, new: jaxcompat.Jaxpr) -> jaxcompat.Jaxpr:
    """`jaxpr` with the jaxpr at `path` replaced by `new` (same interface)."""
    if not path:
        return new
    (index, param), rest = path[0], path[1:]
    eqns = list(jaxpr.eqns)
    eqns[index] = with_subjaxpr(eqns[index], param,
                                _replaced(open_subjaxpr(eqns[index], param), rest, new))
    return jaxpr.replace(eqns=eqns)
