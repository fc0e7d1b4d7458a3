"""Tracing a piece of a program (a site's reference derivative, a kernel call) at the level
where the site lives: the top level, or the body of a `shard_map`.

A shard_map body holds per-device values: local shapes, and types saying over which manual
mesh axes each value varies, with `pvary` casts where jax meets one that does not vary with
one that does (and psums where it transposes them). A piece traced at the top level has
neither, so it would neither match the body's equations nor splice into it. `trace` traces
it inside a `jax.shard_map` over the body's mesh instead, with each value varying over the
same axes as the body's, and returns that shard_map's body.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hlotool import jaxcompat
from hlotool.errors import HlotoolError


class TraceError(HlotoolError):
    """A piece cannot be traced where its site lives; the message says why."""


def spec(aval: Any) -> jax.ShapeDtypeStruct:
    """A value of type `aval` to trace with at the top level, keeping the sharding an
    explicit-axis mesh puts in the type."""
    sharding = getattr(aval, "sharding", None)
    if sharding is not None and sharding.mesh.empty:
        sharding = None
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                sharding=sharding)


@dataclasses.dataclass(frozen=True)
class Manual:
    """The shard_map body a site lives in: its mesh, the axes manual there, whether jax
    checks which values vary over them; `nested` when another shard_map encloses it."""

    mesh: Any
    axes: frozenset
    check_vma: bool
    nested: bool = False

    @classmethod
    def of(cls, eqn: jaxcompat.JaxprEqn, outer: Manual | None = None) -> Manual:
        """The body of the shard_map `eqn`, inside the body `outer` (None: at the top)."""
        return cls(eqn.params["mesh"], jaxcompat.manual_axes(eqn),
                   bool(eqn.params.get("check_vma", True)), nested=outer is not None)

    def _varying(self, aval: Any) -> tuple[str, ...]:
        """The manual axes `aval` varies over, in mesh order."""
        varying = jaxcompat.varying_axes(aval)
        if not varying <= self.axes:
            raise TraceError(f"a {aval.str_short()} value varies over mesh axes of an "
                             "enclosing shard_map")
        return tuple(a for a in self.mesh.axis_names if a in varying)

    def _replicated(self, aval: Any) -> jax.ShapeDtypeStruct:
        """A global value whose copy on every device has `aval`'s shape."""
        explicit = jax.sharding.AxisType.Explicit in getattr(self.mesh, "axis_types", ())
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                                    sharding=NamedSharding(self.mesh, P()) if explicit else None)


def evaluate(jaxpr: jaxcompat.Jaxpr, eqn: jaxcompat.JaxprEqn, env: Mapping[Any, Any]
             ) -> list[Any]:
    """The outputs of `eqn` (of `jaxpr`) on the values `env` holds for its operands, bound
    as jax's own evaluator binds it (on tracers: the equation again in the traced program)."""
    reads = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, jaxcompat.Literal)))
    one = jaxpr.replace(constvars=[], invars=reads, outvars=list(eqn.outvars), eqns=[eqn],
                        effects=eqn.effects)
    return jaxcompat.eval_jaxpr(one, (), *(env[v] for v in reads))


def trace(where: Manual | None, fn: Callable[..., Any], in_avals: Sequence[Any],
          out_avals: Sequence[Any]) -> jaxcompat.ClosedJaxpr:
    """`fn` (values of `in_avals` → a tuple of values of `out_avals`) as a ClosedJaxpr at the
    level `where` (None: the top level). `TraceError` where that level cannot be reproduced:
    a nested shard_map, a scalar varying over mesh axes, a body that hoists constants."""
    if where is None or not where.check_vma:
        # Without check_vma a body's values have local shapes and no axis types: a piece
        # traced at the top level is what the body holds.
        return jax.make_jaxpr(fn)(*(spec(a) for a in in_avals))
    if where.nested:
        raise TraceError("the site is inside nested shard_maps")
    # Inputs enter replicated and are cast to vary as the body's do; outputs leave split
    # along their leading axis (a scalar along a new one). The casts and those new axes are
    # then taken off the traced body, so its interface is the body's own.
    casts = [where._varying(a) for a in in_avals]
    leaving = [where._varying(a) for a in out_avals]

    def flat(*xs):
        xs = [jax.lax.pcast(x, axes, to="varying") if axes else x for x, axes in zip(xs, casts)]
        outs = tuple(fn(*xs))
        return tuple(o[None] if axes and not a.shape else o
                     for o, a, axes in zip(outs, out_avals, leaving))

    mapped = jax.shard_map(flat, mesh=where.mesh, in_specs=(P(),) * len(in_avals),
                           out_specs=tuple(P(axes) if axes else P() for axes in leaving),
                           axis_names=set(where.axes), check_vma=where.check_vma)
    try:
        outer = jax.make_jaxpr(mapped)(*(where._replicated(a) for a in in_avals))
    except ValueError as err:  # a body nested in one already traced under its mesh (a cond's
        raise TraceError(f"cannot trace the piece under the body's mesh: {err}") from None
    (eqn,) = [e for e in outer.jaxpr.eqns if e.primitive.name == jaxcompat.SHARD_MAP]
    body = eqn.params["jaxpr"]
    body = body.jaxpr if isinstance(body, jaxcompat.ClosedJaxpr) else body
    if len(body.invars) != len(in_avals) or outer.consts:
        raise TraceError("the piece closes over constants, which a shard_map body takes as "
                         "operands")
    return jaxcompat.ClosedJaxpr(_without_casts(body, casts, leaving, out_avals), [])


def _without_casts(body: jaxcompat.Jaxpr, casts: list, leaving: list, out_avals: Sequence[Any]
                   ) -> jaxcompat.Jaxpr:
    """`body` with the casts of its inputs (the first reader of each, a `pvary`) and the
    new leading axes of its scalar outputs (their last definition) removed."""
    invars, eqns = list(body.invars), list(body.eqns)
    drop = set()
    for n, axes in enumerate(casts):
        if not axes:
            continue
        at = next(i for i, e in enumerate(eqns) if body.invars[n] in e.invars)
        if eqns[at].primitive.name not in jaxcompat.MANUAL_CASTS or len(eqns[at].invars) != 1:
            raise TraceError(f"jax wrote {eqns[at].primitive} where a cast was expected")
        invars[n] = eqns[at].outvars[0]
        drop.add(at)
    outvars = list(body.outvars)
    for n, (axes, aval) in enumerate(zip(leaving, out_avals)):
        if not axes or aval.shape:
            continue
        at = next(i for i, e in enumerate(eqns) if outvars[n] in e.outvars)
        outvars[n] = eqns[at].invars[0]
        drop.add(at)
    return body.replace(invars=invars, outvars=outvars,
                        eqns=[e for i, e in enumerate(eqns) if i not in drop])
