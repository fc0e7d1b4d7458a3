"""`flash_jit(fn, validate=True)`: each input signature is checked before its first use.

A signature is the pytree structure of the arguments, the shape and dtype of each array leaf
and the value of every other leaf: what makes jax trace anew. The first time one is seen, the
wrapper compares `jax.jit(fn)` with the rewritten program — outputs, and the gradient of a
fixed random projection of the float outputs with respect to every float argument — on

  - the call's own values when it has them (a plain call), or
  - generated values of the same shapes and dtypes when the call is being traced (under
    `jax.jit`, `jax.grad`, `jax.vmap`: the values do not exist yet). Floats are standard
    normal, integers zero, booleans random; the report says so.

Outputs equal within the dtype's tolerance (`TOLERANCE`, relative to the largest magnitude of
the whole output or gradient tree) pass; so do positions where the naive program is NaN or
infinite and the kernel finite (softmax over a fully -inf row; noted, not failed). A kernel
that is non-finite where the naive program is finite fails. When the whole program fails,
each site is checked alone; a failing site stays native for that signature only, with a
warning naming it, the error and the tolerance.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat
from hlotool.errors import first_line
from hlotool.flash import Rewritten, for_analysis, name_of, plan_program, site_key, trace

# Relative tolerance (max |a - b| / max |b|) by dtype of the compared value.
TOLERANCE = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


def compare(got: Any, want: Any) -> tuple[tuple[float, str] | None, bool]:
    """((error, dtype) of the leaf furthest beyond its tolerance, or None when all are within
    it; whether the naive side had non-finite values where the kernel's are finite).

    The error is max|a - b| over the largest finite |b| of the whole tree (at least 1, so a
    gradient that is zero up to rounding is not compared to its own noise)."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64), jnp.result_type(b).name)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    scale = max((np.max(np.abs(b[np.isfinite(b)]), initial=0.0) for _, b, _ in pairs),
                default=1.0)
    worst, rescued = None, False
    for a, b, dtype in pairs:
        a_ok, b_ok = np.isfinite(a), np.isfinite(b)
        rescued = rescued or bool(np.any(a_ok & ~b_ok))
        opposite = np.isinf(a) & np.isinf(b) & (np.sign(a) != np.sign(b))
        if np.any(~a_ok & b_ok) or np.any(opposite):
            err = np.inf  # non-finite where native is finite, or the other infinity
        else:
            both = a_ok & b_ok
            err = float(np.max(np.abs(a[both] - b[both]), initial=0.0) / max(scale, 1.0))
        tol = TOLERANCE.get(dtype, 0.0)
        if err > tol and (worst is None or err / max(tol, 1e-30) > worst[0] / max(
                TOLERANCE.get(worst[1], 0.0), 1e-30)):
            worst = (err, dtype)
    return worst, rescued


def outputs_and_grads(f: Callable, args: Sequence[Any], kwargs: Mapping[str, Any],
                      grads: bool = True) -> Any:
    """f's outputs, and the gradient of a fixed random projection of its float outputs with
    respect to its float array arguments (None when there is nothing to differentiate, or
    `grads` is False: a train step's outputs are its gradients already, and the kernels'
    backward passes have no derivative of their own)."""
    out = f(*args, **kwargs)
    if not grads:
        return out, None
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
    at = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))
          and jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    floats = [x for x in jax.tree.leaves(out) if jnp.issubdtype(jnp.result_type(x),
                                                                 jnp.floating)]
    if not at or not floats:
        return out, None
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal(np.shape(x)), jnp.float32) for x in floats]

    def projected(*xs):
        full = list(leaves)
        for i, x in zip(at, xs):
            full[i] = x
        a, kw = jax.tree.unflatten(tree, full)
        outs = [x for x in jax.tree.leaves(f(*a, **kw))
                if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
        return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, weights))

    return out, jax.grad(projected, argnums=tuple(range(len(at))))(*[leaves[i] for i in at])


def signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple:
    """What makes jax trace anew: tree structure, array shapes and dtypes, other leaves."""
    leaves, tree = jax.tree.flatten((tuple(args), dict(kwargs)))
    parts = []
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            parts.append(("array", tuple(x.shape), str(x.dtype),
                          bool(getattr(getattr(x, "aval", x), "weak_type", False))))
        else:
            try:
                hash(x)
                parts.append(("static", x))
            except TypeError:
                parts.append(("static", id(x)))
    return (tree, tuple(parts))


def _concrete(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, bool]:
    """The call's arguments with every traced array leaf replaced by generated values of its
    shape and dtype; and whether any was."""
    rng = np.random.default_rng(0)
    generated = False

    def stand_in(x):
        nonlocal generated
        if not isinstance(x, jaxcompat.Tracer):
            return x
        generated = True
        dtype = np.dtype(x.dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            return jnp.asarray(rng.standard_normal(x.shape), dtype)
        if dtype == np.bool_:
            return jnp.asarray(rng.random(x.shape) < 0.5)
        return jnp.zeros(x.shape, dtype)

    args, kwargs = jax.tree.map(stand_in, (tuple(args), dict(kwargs)))
    return args, kwargs, generated


class Validated:
    """flash_jit(validate=True): `jax.jit` of the rewritten `fn`, each signature checked
    against `jax.jit(fn)` before its first use."""

    def __init__(self, fn: Callable, kernel: str, jit_kwargs: Mapping[str, Any]):
        self._fn, self._kernel, self._jit_kwargs = fn, kernel, dict(jit_kwargs)
        # signature -> sites kept native (site key -> reason); notes per signature
        self.verdicts: dict[tuple, dict[tuple, str]] = {}
        self.notes: dict[tuple, list[str]] = {}
        self._grads = True  # whether validation differentiates (not a train step's own)
        self._rewritten = Rewritten(fn, kernel, jit_kwargs.get("in_shardings"),
                                    disabled=self._disabled)
        self._jitted = jax.jit(self._rewritten, **jit_kwargs)
        functools.update_wrapper(self, fn)

    def __getattr__(self, name: str) -> Any:  # .eval_shape, ...
        return getattr(self._jitted, name)

    # Spelled out: jax.export takes only a `jax.stages.Wrapped`, a runtime protocol that
    # Python >= 3.12 checks without calling __getattr__.
    def trace(self, *args, **kwargs):
        return self._jitted.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)

    @property
    def report(self):
        return self._rewritten.report

    def __call__(self, *args, **kwargs):
        self._disabled(args, kwargs)
        return self._jitted(*args, **kwargs)

    def _disabled(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mapping[tuple, str]:
        """The sites kept native for this call's signature, validating it the first time."""
        key = signature(args, kwargs)
        if key not in self.verdicts:
            # Under jit, grad or vmap this runs while the caller is traced: on values, which
            # must be computed now rather than staged into the caller's program (and not
            # constant-folded into the traces being compared, as ensure_compile_time_eval
            # would).
            with jaxcompat.eval_context():
                self.verdicts[key], self.notes[key] = self._validate(args, kwargs)
        return self.verdicts[key]

    def _run(self, args, kwargs, off: Mapping[tuple, str]) -> Any:
        rewritten = Rewritten(self._fn, self._kernel, self._jit_kwargs.get("in_shardings"),
                              disabled=lambda *_: off)
        return outputs_and_grads(jax.jit(rewritten, **self._jit_kwargs), args, kwargs,
                                 self._grads)

    def _validate(self, args, kwargs) -> tuple[dict[tuple, str], list[str]]:
        args, kwargs, generated = _concrete(args, kwargs)
        closed, _, _ = trace(self._fn, args, kwargs)
        replacements = plan_program(for_analysis(closed, self._fn, args, kwargs),
                                    name_of(self._fn), self._kernel).replacements
        keys = [site_key(s) for s, _ in replacements]
        if not keys:
            return {}, []
        self._grads = not any(getattr(r, "backward", None) or getattr(r, "recomputes", ())
                             for _, r in replacements)
        source = "generated values (the call was traced)" if generated else "the call's values"
        notes = [f"validated on {source}"]
        want = outputs_and_grads(jax.jit(self._fn, **self._jit_kwargs), args, kwargs,
                                 self._grads)
        problem, rescued = self._problem(args, kwargs, {}, want)
        if problem is None:
            if rescued:
                notes.append("native has NaN or inf where the kernels are finite")
            return {}, notes
        off = {}
        for (site, _), key in zip(replacements, keys):
            alone = {k: "validation" for k in keys if k != key}
            problem, rescued = self._problem(args, kwargs, alone, want)
            if problem is None:
                continue
            where = site.site.source or str(key)
            warnings.warn(f"flash_jit: attention at {where} stays native for this signature: "
                          f"{problem}", stacklevel=4)
            off[key] = f"validation failed: {problem}"
        return off, notes

    def _problem(self, args, kwargs, off, want) -> tuple[str | None, bool]:
        try:
            got = self._run(args, kwargs, off)
            worst, rescued = compare(got[0], want[0])
            worst_grad, rescued_grad = compare(got[1], want[1])
        except Exception as exc:  # noqa: BLE001 - any kernel failure means: keep native
            return f"{type(exc).__name__}: {first_line(exc)}", False
        worst = worst or worst_grad
        if worst is None:
            return None, rescued or rescued_grad
        err, dtype = worst
        return (f"outputs or gradients differ from jax.jit by {err:.3g} (relative; {dtype} "
                f"tolerance {TOLERANCE.get(dtype, 0.0):g})"), False
