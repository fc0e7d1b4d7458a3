"""Give upstream `pallas_call`s that lack one a `cost_estimate`, without forking upstream.

Upstream TPU flash attention passes `cost_estimate` to its forward `pallas_call` but not to
the two backward ones (dK/dV and dQ), so XLA's scheduler and profilers see those as free.
`with_backward_costs` wraps a differentiable function in a custom VJP whose backward traces
upstream's VJP to a jaxpr and re-binds each `pallas_call` without an estimate with one.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.experimental import pallas as pl

from hlotool import jaxcompat

Estimator = Callable[[Any], pl.CostEstimate]  # from a pallas_call jaxpr equation


def _eval(jaxpr: jaxcompat.Jaxpr, consts, args, estimate: Estimator) -> list:
    """`jax.core.eval_jaxpr`, inlining jit calls and filling in missing cost estimates."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jaxcompat.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in ("jit", "pjit"):
            closed = eqn.params["jaxpr"]
            outs = _eval(closed.jaxpr, closed.consts, invals, estimate)
        else:
            subfuns, params = jaxcompat.bind_params(eqn)
            # `in params`: a jax whose pallas_call takes no estimate keeps upstream's call.
            if (name == "pallas_call" and "cost_estimate" in params
                    and params["cost_estimate"] is None):
                params = dict(params, cost_estimate=estimate(eqn))
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def with_backward_costs(fn: Callable, estimate: Estimator) -> Callable:
    """`fn(*diff_args, aux)` with the same values and gradients, whose backward `pallas_call`s
    carry `estimate(eqn)`. `aux` (e.g. integer segment ids) gets no gradient."""

    @jax.custom_vjp
    def run(diff_args, aux):
        return fn(*diff_args, aux)

    def run_fwd(diff_args, aux):
        out, vjp_fn = jax.vjp(lambda *d: fn(*d, aux), *diff_args)
        return out, vjp_fn

    def run_bwd(vjp_fn, cotangent):
        closed, shape = jax.make_jaxpr(vjp_fn, return_shape=True)(cotangent)
        flat = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(cotangent), estimate)
        grads = jax.tree.unflatten(jax.tree.structure(shape), flat)
        return tuple(grads), None

    run.defvjp(run_fwd, run_bwd)
    return lambda *diff_args, aux: run(diff_args, aux)
