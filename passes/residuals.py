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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a loop pair runs once its sites move: the forward loop (`fwd`) returns its body's
    kept outputs (`f_new`: the carry, the stacked outputs at `kept`, then `extra`), and the
    backward loop (`bwd`) recomputes the moved equations (`recomputes`: their inputs and a
    jaxpr of them) in its body from what it reads of the forward loop."""

    fwd: jaxcompat.JaxprEqn
    bwd: jaxcompat.JaxprEqn
    f_new: jaxcompat.Jaxpr
    kept: list[int]  # forward loop outputs past the carry still returned
    # Forward loop outputs no longer returned, to the forward body variable each stacked.
    stacked: dict
    held: dict  # backward operand index -> the forward body variable it held
    invariant: list  # the forward body's loop-invariant operands
    own_consts: dict  # the forward body's constants, by variable
    slices: dict  # forward body variable -> index of the scanned forward operand it slices
    # Moved inputs the backward body reads as it is: a forward body variable -> the index of
    # the backward operand holding it, stacked (`scanned`) or scanned from the same array
    # (`shared`).
    scanned: dict
    shared: dict
    extra: list  # moved inputs the forward loop returns stacked anew
    sliced: list  # moved inputs the backward loop slices anew from the forward's operand
    recomputes: list[tuple[tuple, jaxcompat.Jaxpr]]
    b_scanned: list[int]  # the backward loop's scanned operands it still reads


def _recompute(closed: jaxcompat.ClosedJaxpr, loops: _Loops) -> jaxcompat.ClosedJaxpr:
    """`closed` with the loop pair `loops` re-traced: the forward loop returning its moved
    sites' inputs instead of their intermediates, the backward loop recomputing those."""
    jaxpr = jaxpr_at(closed, loops.level)
    plan = _plan(jaxpr, loops)
    consts = closed.consts if not loops.level else []

    def program(*args):
        return _run_pair(jaxpr, consts, loops, plan, args)

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


def _plan(jaxpr: jaxcompat.Jaxpr, loops: _Loops) -> _Plan:
    """What the loop pair at `loops` in `jaxpr` drops, keeps and recomputes."""
    fwd, bwd = jaxpr.eqns[loops.forward], jaxpr.eqns[loops.backward]
    f_consts, f_carry, _ = jaxcompat.scan_groups(fwd)
    b_consts, b_carry, _ = jaxcompat.scan_groups(bwd)
    f_body = fwd.params["jaxpr"].jaxpr
    dropped = _dropped(jaxpr, loops)
    stacked = {fwd.outvars[p]: f_body.outvars[p] for p in dropped}
    # For each backward operand at a dropped output, the intermediate it held.
    held = {q: stacked[v] for q, v in enumerate(bwd.invars) if v in stacked}
    # Forward body values the backward loop already scans, by its operand index.
    scanned = {f_body.outvars[p]: bwd.invars.index(fwd.outvars[p])
               for p in range(f_carry, len(fwd.outvars))
               if p not in dropped and fwd.outvars[p] in bwd.invars[b_consts + b_carry:]}
    # The forward loop's scanned operands, by the body variable that reads their slices.
    slices = {v: f_consts + f_carry + n
              for n, v in enumerate(f_body.invars[f_consts + f_carry:])}
    invariant = f_body.invars[:f_consts]
    own_consts = dict(zip(f_body.constvars, fwd.params["jaxpr"].consts))
    shared, extra, sliced = _sources(loops, fwd, bwd, held, scanned, slices, invariant,
                                     own_consts)
    kept = [p for p in range(f_carry, len(fwd.outvars)) if p not in dropped]
    f_new = f_body.replace(outvars=[*f_body.outvars[:f_carry],
                                    *(f_body.outvars[p] for p in kept), *extra])
    # What only the dropped outputs read goes with them.
    f_new, _ = jaxcompat.dce_jaxpr(f_new, [True] * len(f_new.outvars), instantiate=True)
    return _Plan(
        fwd=fwd, bwd=bwd, f_new=f_new, kept=kept, stacked=stacked, held=held,
        invariant=invariant, own_consts=own_consts, slices=slices, scanned=scanned,
        shared=shared, extra=extra, sliced=sliced,
        recomputes=[_recomputation(f_body, m, held) for m in loops.moved],
        b_scanned=[q for q in range(b_consts + b_carry, len(bwd.invars)) if q not in held])


def _dropped(jaxpr: jaxcompat.Jaxpr, loops: _Loops) -> set[int]:
    """Positions of the forward body's outputs the forward loop stops returning: the moved
    sites' intermediates, and the stacked values of producers the backward loop recomputes
    that nothing but its scanned operands reads."""
    fwd, bwd = jaxpr.eqns[loops.forward], jaxpr.eqns[loops.backward]
    _, f_carry, _ = jaxcompat.scan_groups(fwd)
    b_consts, b_carry, _ = jaxcompat.scan_groups(bwd)
    leaving = frozenset().union(*(m.leaving for m in loops.moved))
    recomputable = frozenset().union(*(m.recomputable for m in loops.moved))
    read_elsewhere = _vars([*jaxpr.outvars, *bwd.invars[:b_consts + b_carry], *(
        u for n, e in enumerate(jaxpr.eqns) if n != loops.backward for u in e.invars)])
    return {p for p, v in enumerate(fwd.params["jaxpr"].jaxpr.outvars) if v in leaving or (
        p >= f_carry and v in recomputable and fwd.outvars[p] not in read_elsewhere)}


def _sources(loops: _Loops, fwd: jaxcompat.JaxprEqn, bwd: jaxcompat.JaxprEqn, held: dict,
             scanned: dict, slices: dict, invariant: list, own_consts: dict
             ) -> tuple[dict, list, list]:
    """Where the backward body finds the moved equations' inputs that neither the forward
    loop's invariant operands and constants nor its stacked outputs (`scanned`) give it:
    (`shared`, `extra`, `sliced`) of `_Plan`."""
    b_consts, b_carry, _ = jaxcompat.scan_groups(bwd)
    # A forward operand the backward loop scans too (jax passes q, k, v read from outside
    # the loop to both): the recompute reads the backward body's own slice of it, the
    # variable its derivative reads, not a second slice of the same array.
    b_xs = {v: q for q in range(b_consts + b_carry, len(bwd.invars))
            if q not in held and not isinstance(v := bwd.invars[q], jaxcompat.Literal)}
    shared, extra, sliced = {}, [], []
    for m in loops.moved:
        for v in m.inputs:
            if v in slices and not isinstance(fwd.invars[slices[v]], jaxcompat.Literal) \
                    and fwd.invars[slices[v]] in b_xs:
                shared[v] = b_xs[fwd.invars[slices[v]]]
            elif v in slices:
                sliced.append(v)
            elif v not in invariant and v not in own_consts and v not in scanned:
                extra.append(v)
    return shared, list(dict.fromkeys(extra)), list(dict.fromkeys(sliced))


def _recomputation(body: jaxcompat.Jaxpr, moved: _Moved, held: dict
                   ) -> tuple[tuple, jaxcompat.Jaxpr]:
    """The moved equations of the forward `body` as a jaxpr of their own, from the site's
    inputs to the intermediates the backward loop read (`held`) and the site's output."""
    wanted = [*dict.fromkeys(v for v in held.values()
                             if v in moved.leaving or v in moved.recomputable), moved.site.out]
    return moved.inputs, body.replace(constvars=[], invars=list(moved.inputs), outvars=wanted,
                                      eqns=[body.eqns[i] for i in moved.eqns])


def _run_pair(jaxpr: jaxcompat.Jaxpr, consts: list, loops: _Loops, plan: _Plan,
              args: Sequence) -> list:
    """`jaxpr` evaluated on `args`, its loop pair run as `plan` says."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jaxcompat.Literal) else env[v]

    extras: list = []
    for n, eqn in enumerate(jaxpr.eqns):
        if n == loops.forward:
            outs, extras = _run_forward(plan, [read(v) for v in eqn.invars])
        elif n == loops.backward:
            # The operands it reads of the dropped outputs are recomputed in its body.
            outs = _run_backward(plan, [None if _vars([v]) & plan.stacked.keys() else read(v)
                                        for v in eqn.invars],
                                 [read(u) for u in plan.fwd.invars], extras)
        else:
            outs = tracing.evaluate(jaxpr, eqn, env)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if o is not None)
    return [read(v) for v in jaxpr.outvars]


def _run_forward(plan: _Plan, values: list) -> tuple[list, list]:
    """The forward loop on its operands `values`: its outputs (None where dropped), and its
    new stacked outputs (`plan.extra`)."""
    fwd = plan.fwd
    f_consts, f_carry, _ = jaxcompat.scan_groups(fwd)

    def step(carry, x):
        outs = jaxcompat.eval_jaxpr(plan.f_new, fwd.params["jaxpr"].consts, *values[:f_consts],
                                    *carry, *x)
        return outs[:f_carry], outs[f_carry:]

    carry, ys = _scan(fwd, step, values[f_consts:f_consts + f_carry],
                      values[f_consts + f_carry:])
    outs: list = [*carry, *([None] * (len(fwd.outvars) - f_carry))]
    for p, y in zip(plan.kept, ys):
        outs[p] = y
    return outs, ys[len(plan.kept):]


def _run_backward(plan: _Plan, values: list, outer: list, extras: list) -> list:
    """The backward loop on its operands `values` (None where dropped), its body first
    recomputing the moved sites under the name scope `RECOMPUTED`. `outer`: the forward
    loop's operands; `extras`: its new stacked outputs."""
    bwd = plan.bwd
    b_consts, b_carry, _ = jaxcompat.scan_groups(bwd)
    b_body = bwd.params["jaxpr"]

    def step(carry, x):
        operands = list(values)
        operands[b_consts:b_consts + b_carry] = carry
        for q, value in zip(plan.b_scanned, x):
            operands[q] = value
        known = {**plan.own_consts, **dict(zip(plan.invariant, outer))}
        known.update((v, operands[q]) for v, q in (*plan.scanned.items(),
                                                   *plan.shared.items()))
        known.update(zip([*plan.extra, *plan.sliced], x[len(plan.b_scanned):]))
        with jax.named_scope(RECOMPUTED):
            for inputs, body in plan.recomputes:
                known.update(zip(body.outvars, jaxcompat.eval_jaxpr(
                    body, (), *(known[v] for v in inputs))))
        for q, v in plan.held.items():
            operands[q] = known[v]
        outs = jaxcompat.eval_jaxpr(b_body.jaxpr, b_body.consts, *operands)
        return outs[:b_carry], outs[b_carry:]

    carry, ys = _scan(bwd, step, values[b_consts:b_consts + b_carry],
                      [*(values[q] for q in plan.b_scanned), *extras,
                       *(outer[plan.slices[v]] for v in plan.sliced)])
    return [*carry, *ys]


def _replaced(jaxpr: jaxcompat.Jaxpr, path: Path, new: jaxcompat.Jaxpr) -> jaxcompat.Jaxpr:
    """`jaxpr` with the jaxpr at `path` replaced by `new` (same interface)."""
    if not path:
        return new
    (index, param), rest = path[0], path[1:]
    eqns = list(jaxpr.eqns)
    eqns[index] = with_subjaxpr(eqns[index], param,
                                _replaced(open_subjaxpr(eqns[index], param), rest, new))
    return jaxpr.replace(eqns=eqns)
