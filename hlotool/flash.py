"""`flash_jit`: a `jax.jit` whose attention sites run in a flash kernel; `explain`: why (not).

    fast = hlotool.flash_jit(fn, kernel="auto", validate=False, **jit_kwargs)
    fast(*args)                     # jax.jit(fn) with each safe attention site rewritten
    print(hlotool.explain(fn, *args))

At trace time the wrapper traces `fn` to a jaxpr, detects the naive attention sites
(`passes.from_jaxpr`), decides per site and per platform which kernel runs it (`decide`), and
substitutes the sites (`passes.rewrite`) before evaluating the program on jit's tracers. A site
whose kernel choice differs between platforms becomes `lax.platform_dependent`, so one traced
program runs the chunked kernel (or the native equations) on CPU and exports to TPU with the
Pallas kernel. A site stays native, with the reason in the report, when its intermediates are
used elsewhere, when its masks could make a row differ from the naive program, or when no
kernel pays on a platform.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hlotool import jaxcompat, kernels
from hlotool.cost.decision import verdict
from hlotool.errors import HlotoolError
from hlotool.hardware import get_hardware
from hlotool.passes.attention import Layout
from hlotool.passes.from_jaxpr import JaxprSite, MaskVar, detect_jaxpr, jaxpr_at
from hlotool.passes.graph import Node, uniform_value
from hlotool.passes.rewrite import Replacement, RewriteError, check, free_inputs, native, rewrite
from hlotool.site import AttentionSite

# Platforms a decision is made for; "cpu" stands for every platform without its own kernel.
PLATFORMS = ("cpu", "tpu", "cuda")

# Chip priced for each platform when the process does not run on one (see `target_for`).
DEFAULT_TARGET = {"cpu": "cpu", "tpu": "tpu-v5e", "cuda": "h100"}
# Substrings of `Device.device_kind` naming a chip in `hlotool.hardware.HARDWARE`, most
# specific first ("TPU v5 lite" is a v5e, plain "TPU v5" a v5p; see jax's tpu_info.py).
_DEVICE_KINDS = {
    "tpu": (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6 lite", "tpu-v6e"),
            ("v6e", "tpu-v6e"), ("v5", "tpu-v5p"), ("v4", "tpu-v4")),
    "cuda": (("a100", "a100"), ("h100", "h100"), ("h200", "h200")),
}

# Relative tolerance (max |a - b| / max |b|) for validation, by dtype of the compared output.
TOLERANCE = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Choice:
    """What runs a site on one platform: a kernel name, or None for XLA's native path."""

    kernel: str | None
    reason: str


def running_platform() -> str:
    """The platform jax executes on in this process, as `lax.platform_dependent` names it
    ("cpu", "tpu", "cuda", "rocm", ...)."""
    return jaxcompat.canonicalize_platform(jax.default_backend())


@functools.cache
def target_for(platform: str) -> str:
    """The `hlotool.hardware` chip that prices `platform`: the attached chip when jax runs on
    that platform and its `device_kind` names a known one, else `DEFAULT_TARGET[platform]`."""
    if platform != "cpu" and platform == running_platform():
        kind = jax.devices()[0].device_kind.lower()
        for part, target in _DEVICE_KINDS.get(platform, ()):
            if part in kind:
                return target
    return DEFAULT_TARGET[platform]


def decide(site: AttentionSite, platform: str, kernel: str = "auto") -> Choice:
    """The single policy deciding whether a kernel runs `site` on `platform`.

    `kernel="auto"`: the cost model's verdict (`hlotool.cost.decision.verdict`) for the
    platform's chip (`target_for`); the kernel it prices runs the site where it pays. XLA:TPU's
    own attention fusion is probed (a deviceless compile, seconds per new shape) only for the
    platform this process runs on; elsewhere the reason says it was not checked. A kernel
    name: that kernel where it runs and supports the site.
    """
    if kernel != "auto":
        chosen = kernels.get(kernel)
        if platform not in chosen.platforms:
            return Choice(None, f"{kernel} does not run on {platform}")
        support = chosen.supports(site)
        return Choice(kernel, f"{kernel} requested") if support else Choice(None, support.reason)
    hw = get_hardware(target_for(platform))
    checked = platform == running_platform()
    v = verdict(site, hw, check_fusion=checked)
    reason = v.reason if hw.name == platform else f"{v.reason} on {hw.name}"
    if v.pays and not checked and hw.platform == "tpu" and hw.compile_target is not None:
        reason += (f", XLA:TPU's own fusion not checked off-TPU (run "
                   f"`hlotool cost SCRIPT --target {hw.name}`)")
    return Choice(v.kernel_name if v.pays else None, reason)


@dataclasses.dataclass(frozen=True)
class SiteReport:
    """One site's outcome. `kernels[platform]` is the kernel name, None where native."""

    site: AttentionSite
    where: str
    kernels: Mapping[str, str | None]
    reason: str

    @property
    def rewritten(self) -> bool:
        return any(self.kernels.values())

    def to_json(self) -> dict[str, Any]:
        return {"site": self.site.to_json(), "where": self.where, "kernels": dict(self.kernels),
                "rewritten": self.rewritten, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-site decisions for one traced function; `str()` is a table."""

    function: str
    sites: tuple[SiteReport, ...]

    @property
    def rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def to_json(self) -> dict[str, Any]:
        return {"function": self.function, "sites": [s.to_json() for s in self.sites]}

    def __str__(self) -> str:
        if not self.sites:
            return f"{self.function}: no attention site"
        lines = [f"{self.function}: {len(self.sites)} site(s), {self.rewritten} rewritten"]
        for i, s in enumerate(self.sites):
            a = s.site
            per = ", ".join(f"{p}: {k or 'native'}" for p, k in s.kernels.items())
            lines.append(
                f"  [{i}] {a.source or '?'} ({s.where}) q{list(a.q_shape)} k{list(a.k_shape)} "
                f"{a.dtype} mask={a.mask}\n      {per}\n      {s.reason}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# One site: blockers, operands in kernel terms, the replacement


def _where(closed: jaxcompat.ClosedJaxpr, site: JaxprSite) -> str:
    """Where a site sits: "top level", or the enclosing equations, e.g. "scan.jaxpr"."""
    steps = []
    for depth, (index, param) in enumerate(site.path):
        eqn = jaxpr_at(closed, site.path[:depth]).eqns[index]
        steps.append(f"{eqn.primitive.name}.{param}")
    return " > ".join(steps) or "top level"


def _chain_input(node: Node, site: JaxprSite) -> Node | None:
    """The input of a logits-chain node that carries the scores down to the dot."""
    for term in site.match.masks:
        if term.at is node:
            if node.op == "select":
                return node.inputs[1] if term.keep_when else node.inputs[2]
            return next((i for i in node.inputs if i is not term.operand), None)
    if node.op in ("mul", "div"):
        free = [i for i in node.inputs if uniform_value(i) is None]
        return free[0] if len(free) == 1 else None
    if len(node.inputs) == 1:
        return node.inputs[0]
    return None


def _bias_scales(site: JaxprSite) -> dict[int, float]:
    """For each additive mask step (by id of its node), the scaling applied after it:
    (s + b)·c is the kernel's c·s + (b·c)."""
    node, after, out = site.match.internals["logits"], 1.0, {}
    scores = site.match.internals["scores"]
    while node is not None:
        if node is scores:
            return out
        if any(t.at is node and t.kind == "additive" for t in site.match.masks):
            out[id(node)] = after
        elif node.op in ("mul", "div") and not any(t.at is node for t in site.match.masks):
            value = next((uniform_value(i) for i in node.inputs if uniform_value(i) is not None),
                         None)
            if value is not None:
                after = after * value if node.op == "mul" else after / value
        node = _chain_input(node, site)
    raise RewriteError("the order of the scale and bias steps could not be followed")


def blocker(jaxpr: jaxcompat.Jaxpr, site: JaxprSite) -> str | None:
    """Why `site` must stay native on every platform, or None if a kernel can take it."""
    try:
        check(jaxpr, site)
        _bias_scales(site)
    except RewriteError as err:
        return str(err)
    operands = [m for m in site.masks if m.kind != "causal"]
    if len(operands) > 1:
        return f"{len(operands)} mask/bias operands on one site (a kernel takes one)"
    if operands and operands[0].kind == "boolean" and site.causal:
        return ("a causal and a boolean mask together: rows with every key masked would not "
                "match the naive program")
    return None


def _compact(m: MaskVar, x: jax.Array) -> jax.Array:
    """The mask operand `x` (value of `m.var`) brought to the scores' rank by `m.replay`,
    with 1 on every axis the program broadcast, so a [B, 1, 1, Lk] padding mask is not
    expanded to [B, H, Lq, Lk]."""
    for node in m.replay:
        if node.op == "broadcast":
            compact = [1] * len(node.shape)
            for i, d in enumerate(node.params["dims"]):
                compact[d] = x.shape[i]
            x = x.reshape(compact)
        elif node.op == "transpose":
            x = x.transpose(node.params["perm"])
        elif node.op == "reshape":
            x = jnp.broadcast_to(x, node.inputs[0].shape).reshape(node.shape)
        else:
            x = x.astype(node.dtype)
    rank = len(m.at_shape)
    return x.reshape((1,) * (rank - x.ndim) + tuple(x.shape)) if x.ndim < rank else x


def _to_canonical(layout: Layout, x: jax.Array) -> jax.Array:
    """`layout.to_canonical` for an operand with 1 on broadcast axes; a canonical axis comes
    out 1 where the operand does not vary along it."""
    from hlotool.passes.axes import reshape_groups

    if tuple(x.shape) == layout.shape:
        return layout.to_canonical(x)
    split = list(layout.split)
    small = [1] * len(split)
    for ga, gb in reshape_groups(layout.shape, layout.split) or ():
        if any(x.shape[a] != 1 for a in ga):
            for j in gb:
                small[j] = split[j]
    x = x.reshape(small).transpose(layout.perm)
    full = [split[p] for p in layout.perm]
    for ga, _ in reshape_groups(tuple(full), layout.canonical) or ():
        if len({x.shape[a] == 1 for a in ga}) > 1:
            target = list(x.shape)
            for a in ga:
                target[a] = full[a]
            x = jnp.broadcast_to(x, target)
    groups = reshape_groups(tuple(full), layout.canonical) or []
    canonical = [1] * len(layout.canonical)
    for ga, gb in groups:
        (c,) = gb
        canonical[c] = int(np.prod([x.shape[a] for a in ga]))
    return x.reshape(canonical)


@dataclasses.dataclass(frozen=True)
class _Operands:
    """A site's call in kernel terms (see `hlotool.kernels.base`), plus how to restore rows
    the naive program computes differently (rows whose every key is masked)."""

    q: jax.Array  # [B, Lq, Hq, D]
    k: jax.Array  # [B, Lk, Hkv, D]
    v: jax.Array  # [B, Lk, Hkv, Dv]
    scale: float
    causal: bool
    bias: jax.Array | None  # [B|1, Hq|1, Lq|1, Lk|1]
    mask: jax.Array | None  # bool, same shape rule; True = attend
    empty_rows: jax.Array | None  # bool [B|1, Hq|1, Lq|1, 1]: rows with no visible key
    empty_value: jax.Array | None  # what the naive program gives there, [B, 1|Lq, Hq, Dv]


def _operands(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, values: Mapping[Any, jax.Array]
              ) -> _Operands:
    q = site.q.layout.to_canonical(values[site.q.var])
    k = site.k.layout.to_canonical(values[site.k.var]).astype(q.dtype)
    v = site.v.layout.to_canonical(values[site.v.var]).astype(q.dtype)
    scales = _bias_scales(site)
    bias = mask = empty = empty_value = None
    for m in site.masks:
        if m.kind == "causal":
            continue
        x = _to_canonical(m.scores_layout, _compact(m, values[m.var]))
        if m.kind == "additive":
            at = next(t.at for t in site.match.masks if t.kind == "additive")
            bias = x.astype(jnp.float32) * (m.sign * scales[id(at)])
            hidden = jnp.isneginf(bias)
            if site.causal:
                lq, lk = q.shape[1], k.shape[1]
                hidden = hidden | (np.arange(lk)[None, :] > np.arange(lq)[:, None])
            empty = jnp.all(hidden, axis=-1, keepdims=True)
            empty_value = jnp.full((), jnp.nan, q.dtype)
        else:
            mask = x if m.keep_when else ~x
            empty = ~jnp.any(mask, axis=-1, keepdims=True)
            if m.fill is None or math.isinf(m.fill):
                empty_value = jnp.full((), jnp.nan, q.dtype)
            else:
                # Every logit of such a row equals the fill: softmax is uniform over all keys.
                g = q.shape[2] // k.shape[2]
                mean = jnp.mean(v.astype(jnp.float32), axis=1, keepdims=True)
                empty_value = jnp.repeat(mean, g, axis=2).astype(q.dtype)
    return _Operands(q, k, v, site.scale, site.causal, bias, mask, empty, empty_value)


def _kernel_output(name: str, ops: _Operands, mesh: Any = None) -> jax.Array:
    """[B, Lq, Hq, Dv] from kernel `name`, with empty rows as the naive program has them.

    With a `mesh`, the kernel runs under `jax.shard_map` split along batch and heads: Pallas
    kernels cannot be partitioned automatically, and attention is independent per (b, h).
    """
    kernel = kernels.get(name)

    def call(q, k, v, bias, mask):
        return kernel(q, k, v, scale=ops.scale, bias=bias, mask=mask, causal=ops.causal)

    args = (ops.q, ops.k, ops.v, ops.bias, ops.mask)
    if mesh is not None:
        batch, heads = _mesh_split(mesh, ops.q.shape[0], ops.q.shape[2], ops.k.shape[2])
        if batch or heads:
            spec = jax.sharding.PartitionSpec
            qkv = spec(batch or None, None, heads or None, None)
            scores = [None if x is None else spec(batch if x.shape[0] > 1 else None,
                                                  heads if x.shape[1] > 1 else None)
                      for x in (ops.bias, ops.mask)]
            specs = (qkv, qkv, qkv, *scores)
            call = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=qkv,
                                 check_vma=False)
            # Explicit-axis meshes type values with their sharding: shard_map wants them
            # already split as `specs` says.
            if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
                args = tuple(x if x is None else jax.sharding.reshard(
                    x, jax.sharding.NamedSharding(mesh, spec)) for x, spec in zip(args, specs))
    out = call(*args)
    if ops.empty_rows is not None:
        out = jnp.where(jnp.swapaxes(ops.empty_rows, 1, 2), ops.empty_value, out)
    return out


def _mesh_split(mesh: Any, batch: int, q_heads: int, kv_heads: int
                ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Mesh axes that split the batch, and those that split the heads (query and key/value
    heads alike, so each shard keeps whole GQA groups); other axes replicate the kernel."""
    on_batch, on_heads, nb, nh = [], [], 1, 1
    for axis, size in mesh.shape.items():
        if size == 1:
            continue
        if batch % (nb * size) == 0:
            on_batch.append(axis)
            nb *= size
        elif q_heads % (nh * size) == 0 and kv_heads % (nh * size) == 0:
            on_heads.append(axis)
            nh *= size
    return tuple(on_batch), tuple(on_heads)


def mesh_of(leaves: Sequence[Any], in_shardings: Any = None) -> Any:
    """The device mesh the program is sharded over, or None: from the arguments' shardings
    (explicit-axis meshes show on traced values), jit's `in_shardings`, or the context mesh."""
    named = jax.sharding.NamedSharding
    found = [getattr(getattr(x, "aval", None), "sharding", None) for x in leaves]
    found += [x.sharding for x in leaves if isinstance(x, jax.Array)
              and not isinstance(x, jaxcompat.Tracer)]
    found += jax.tree.leaves(in_shardings, is_leaf=lambda x: isinstance(x, named))
    for s in found:
        if isinstance(s, named) and not s.mesh.empty and s.mesh.size > 1:
            return s.mesh
    context = jax.sharding.get_abstract_mesh()
    return None if context.empty or context.size == 1 else context


def replacement(jaxpr: jaxcompat.Jaxpr, site: JaxprSite, plan: Mapping[str, str | None],
                mesh: Any = None) -> Replacement:
    """The function computing `site.out` under `plan` (platform → kernel name or None)."""
    inputs = free_inputs(jaxpr, site)
    naive = native(jaxpr, site)
    out_aval = site.out.aval

    def branch(name: str | None) -> Callable[..., jax.Array]:
        def run(*xs):
            values = dict(zip(inputs, xs))
            if name is None:
                return naive(values)
            ops = _operands(jaxpr, site, values)
            y = _kernel_output(name, ops, mesh)
            return site.out_layout.from_canonical(y).astype(out_aval.dtype)
        return run

    def run(values: Mapping[Any, jax.Array]) -> jax.Array:
        xs = [values[v] for v in inputs]
        if len(set(plan.values())) == 1:
            return branch(plan["cpu"])(*xs)
        # Only platforms that differ from the CPU's choice get a branch of their own, so a
        # site native on two platforms carries one naive copy, not two.
        own = {p: branch(plan[p]) for p in ("tpu", "cuda") if plan[p] != plan["cpu"]}
        return jax.lax.platform_dependent(*xs, **own, default=branch(plan["cpu"]))

    if all(plan.values()):
        # Kernel branches depend only on this signature; a native branch would carry the
        # site's own source lines, so it is traced per site.
        run.cache_key = (tuple(sorted(plan.items())), mesh, _signature(site, inputs))
    return run


def _signature(site: JaxprSite, inputs: list[Any]) -> tuple:
    """Everything the kernel branches of `replacement` read from a site, with variables as
    positions in `inputs`: equal signatures trace to equal programs."""
    at = {v: i for i, v in enumerate(inputs)}
    scales = _bias_scales(site)
    masks = tuple(
        (m.kind, at.get(m.var), m.at_shape, m.scores_layout, m.sign, m.fill, m.keep_when,
         tuple((n.op, n.shape, n.dtype, repr(sorted(n.params.items()))) for n in m.replay))
        for m in site.masks)
    return (at[site.q.var], site.q.layout, at[site.k.var], site.k.layout, at[site.v.var],
            site.v.layout, site.out_layout, site.out.aval, site.scale, site.causal, masks,
            tuple(scales.get(id(t.at)) for t in site.match.masks))


# ----------------------------------------------------------------------------------------
# Whole programs


def site_key(site: JaxprSite) -> tuple:
    """Identity of a site across traces of the same function and signature."""
    return (site.path, site.eqns)


def plan_program(closed: jaxcompat.ClosedJaxpr, function: str, kernel: str = "auto",
                 disabled: Mapping[tuple, str] | None = None,
                 mesh: Any = None,
                 ) -> tuple[Report, list[tuple[JaxprSite, Replacement]]]:
    """Detect and decide every site of `closed`: the report and the replacements to apply."""
    disabled = disabled or {}
    reports, replacements = [], []
    for site in detect_jaxpr(closed, function):
        jaxpr = jaxpr_at(closed, site.path)
        reason = disabled.get(site_key(site)) or blocker(jaxpr, site)
        if reason is None:
            choices = {p: decide(site.site, p, kernel) for p in PLATFORMS}
            plan = {p: c.kernel for p, c in choices.items()}
            reason = "; ".join(f"{p}: {c.reason}" for p, c in choices.items())
            if any(plan.values()):
                replacements.append((site, replacement(jaxpr, site, plan, mesh)))
        else:
            plan = dict.fromkeys(PLATFORMS)
        reports.append(SiteReport(site.site, _where(closed, site), plan, reason))
    return Report(function, tuple(reports)), replacements


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
        raise HlotoolError(f"cannot trace {_name(fn)}: {err}".splitlines()[0]) from err
    out_tree = jax.tree.structure(shape)
    return closed, dyn, lambda outs: jax.tree.unflatten(out_tree, outs)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class _Rewritten:
    """`fn` with its attention sites substituted at trace time; what `flash_jit` jits."""

    def __init__(self, fn: Callable, kernel: str, in_shardings: Any = None):
        if kernel != "auto":
            kernels.get(kernel)  # an unknown name fails here, in one line
        self.fn, self.kernel, self.in_shardings = fn, kernel, in_shardings
        self.disabled: dict[tuple, str] = {}
        self.report: Report | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        closed, dyn, unflatten = trace(self.fn, args, kwargs)
        self.report, replacements = plan_program(closed, _name(self.fn), self.kernel,
                                                 self.disabled,
                                                 mesh_of(dyn, self.in_shardings))
        closed = rewrite(closed, replacements)
        return unflatten(jaxcompat.eval_jaxpr(closed.jaxpr, closed.consts, *dyn))


def explain(fn: Callable, *args: Any, kernel: str = "auto", **kwargs: Any) -> Report:
    """Per site of `fn(*args, **kwargs)`: which kernel runs it on each platform, or why it
    stays native. Array leaves of the arguments are traced; everything else is static."""
    if kernel != "auto":
        kernels.get(kernel)
    closed, _, _ = trace(fn, args, kwargs)
    report, _ = plan_program(closed, _name(fn), kernel)
    return report


def flash_jit(fn: Callable, *, kernel: str = "auto", validate: bool = False,
              **jit_kwargs: Any):
    """`jax.jit(fn, **jit_kwargs)` with every attention site `decide` accepts run in a kernel.

    kernel: "auto" (per platform, see `decide`) or a kernel name (`hlotool.kernels.names()`).
    validate: on the first call, compare outputs and gradients with `jax.jit(fn)` and fall
    back to native, with a warning naming the site and the error, where they differ.
    Returns a `jax.jit`-wrapped function (`.lower`, `.trace`, `jax.export` work).
    """
    unavailable = jaxcompat.missing("flash_jit")
    if unavailable is not None:
        warnings.warn(f"{unavailable}; flash_jit returns plain jax.jit", stacklevel=2)
        return jax.jit(fn, **jit_kwargs)
    rewritten = _Rewritten(fn, kernel, jit_kwargs.get("in_shardings"))
    jitted = jax.jit(rewritten, **jit_kwargs)
    if not validate:
        return jitted
    return _Validated(fn, rewritten, jit_kwargs)


def _worst_error(got: Any, want: Any) -> tuple[float, str] | None:
    """(error, dtype) of the leaf furthest beyond its dtype's tolerance, or None when every
    leaf is within it. The error is max|a - b| over the largest |b| of the whole tree (at
    least 1, so a gradient that is zero up to rounding is not compared to its own noise).
    NaN must sit where the reference has NaN."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64), jnp.result_type(b).name)
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    scale = max((np.max(np.abs(np.nan_to_num(b)), initial=0.0) for _, b, _ in pairs),
                default=1.0)
    worst = None
    for a, b, dtype in pairs:
        if not np.array_equal(np.isnan(a), np.isnan(b)):
            err = math.inf
        else:
            diff = np.abs(np.nan_to_num(a) - np.nan_to_num(b))
            err = float(np.max(diff, initial=0.0) / max(scale, 1.0))
        tol = TOLERANCE.get(dtype, 0.0)
        if err > tol and (worst is None or err / max(tol, 1e-30) > worst[0] / max(
                TOLERANCE.get(worst[1], 0.0), 1e-30)):
            worst = (err, dtype)
    return worst


def _outputs_and_grads(f: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """f's outputs, and the gradient of a fixed random projection of its float outputs with
    respect to its float array arguments (None when there is nothing to differentiate)."""
    out = f(*args, **kwargs)
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


class _Validated:
    """flash_jit(validate=True): checks the first call against jax.jit(fn), per site."""

    def __init__(self, fn: Callable, rewritten: _Rewritten, jit_kwargs: Mapping[str, Any]):
        self._fn, self._rewritten, self._jit_kwargs = fn, rewritten, dict(jit_kwargs)
        self._jitted = jax.jit(rewritten, **jit_kwargs)
        self._validated = False
        functools.update_wrapper(self, fn)

    def __getattr__(self, name: str) -> Any:  # .eval_shape, ...
        return getattr(self._jitted, name)

    # Spelled out: jax.export takes only a `jax.stages.Wrapped`, a runtime protocol that
    # Python >= 3.12 checks without calling __getattr__.
    def trace(self, *args, **kwargs):
        return self._jitted.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted.lower(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not self._validated:
            self._validate(args, kwargs)
            self._validated = True
        return self._jitted(*args, **kwargs)

    def _run(self, args, kwargs, only: tuple | None, keys: Sequence[tuple]) -> Any:
        rewritten = _Rewritten(self._fn, self._rewritten.kernel, self._rewritten.in_shardings)
        rewritten.disabled = {k: "validation" for k in keys if k != only}
        return _outputs_and_grads(jax.jit(rewritten, **self._jit_kwargs), args, kwargs)

    def _validate(self, args, kwargs) -> None:
        closed, _, _ = trace(self._fn, args, kwargs)
        _, replacements = plan_program(closed, _name(self._fn), self._rewritten.kernel)
        keys = [site_key(s) for s, _ in replacements]
        if not keys:
            return
        want = _outputs_and_grads(jax.jit(self._fn, **self._jit_kwargs), args, kwargs)
        for (site, _), key in zip(replacements, keys):
            try:
                got = self._run(args, kwargs, key, keys)
                worst = _worst_error(got[0], want[0]) or _worst_error(got[1], want[1])
                problem = worst and (
                    f"outputs or gradients differ from jax.jit by {worst[0]:.3g} (relative; "
                    f"{worst[1]} tolerance {TOLERANCE.get(worst[1], 0.0):g})")
            except Exception as exc:  # noqa: BLE001 - any kernel failure means: keep native
                problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if problem:
                where = site.site.source or str(key)
                warnings.warn(f"flash_jit: attention at {where} stays native: {problem}",
                              stacklevel=3)
                self._rewritten.disabled[key] = f"validation failed: {problem}"
        if self._rewritten.disabled:
            self._jitted = jax.jit(self._rewritten, **self._jit_kwargs)


def rewrite_captured(function: Any, kernel: str = "auto") -> tuple[Report, Any]:
    """A function `hlotool.capture` recorded, rewritten: its report, and a copy of the
    `CapturedFunction` whose program (every stage: jaxpr, StableHLO, HLO, optimized) is the
    rewritten one."""
    rewritten = _Rewritten(jaxcompat.jaxpr_as_fun(function.closed_jaxpr), kernel)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type)
            for a in function.in_avals]
    closed = jax.make_jaxpr(rewritten)(*args)
    report = dataclasses.replace(rewritten.report, function=function.name)
    return report, dataclasses.replace(function, closed_jaxpr=closed, _lowered={},
                                       _compiled={})
