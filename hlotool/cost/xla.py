"""XLA's own numbers: `cost_analysis()` and `memory_analysis()` of a compiled program, the
Pallas kernels' `cost_estimate`s from their `tpu_custom_call`s, and the caveats that say where
those numbers are known to be wrong.

Per site, two probe programs stand for the two sides: the naive formula with the site's
shapes, dtype, layout and mask (`naive_program`), and the flash kernel the registry picks for
the target (`kernel_program`). Both compile for the host CPU or deviceless for TPU targets.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hlotool.capture import check_host_memory
from hlotool.errors import HlotoolError, first_line
from hlotool.kernels import AttentionKernel
from hlotool.kernels.base import band_mask
from hlotool.passes.native import ONLINE_SOFTMAX
from hlotool.site import AttentionSite
from hlotool.targets import get_target

_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_COST_ESTIMATE = re.compile(r'"cost_estimate":\s*(\{[^}]*\})')


@dataclasses.dataclass(frozen=True)
class XlaFigures:
    """What XLA reports for one compiled program on one target (None: XLA reported nothing).

    flops, transcendentals, bytes_accessed: `cost_analysis()`. temp_bytes, argument_bytes,
    output_bytes: `memory_analysis()`. custom_calls: count per custom-call target.
    kernel_estimates: each Pallas `tpu_custom_call`'s own cost_estimate (flops,
    transcendentals, bytes_accessed). caveats: where these numbers are known to mislead.
    """

    target: str
    flops: float | None
    transcendentals: float | None
    bytes_accessed: float | None
    temp_bytes: int | None
    argument_bytes: int | None
    output_bytes: int | None
    custom_calls: dict[str, int]
    kernel_estimates: tuple[dict[str, int], ...]
    caveats: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kernel_estimates"] = list(self.kernel_estimates)
        out["caveats"] = list(self.caveats)
        return out


def figures(compiled: jax.stages.Compiled, target: str) -> XlaFigures:
    """XLA's cost and memory analyses of `compiled`, with caveats read from its HLO text."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})
    mem = compiled.memory_analysis()
    text = compiled.as_text()
    calls = dict(Counter(_CUSTOM_CALL.findall(text)))
    estimates = tuple(
        {k: int(v) for k, v in json.loads(m).items() if k != "remote_bytes_transferred"}
        for m in _COST_ESTIMATE.findall(text)
    )

    def num(key: str) -> float | None:
        return float(cost[key]) if key in cost else None

    flops = num("flops")
    return XlaFigures(
        target=target,
        flops=flops,
        transcendentals=num("transcendentals"),
        bytes_accessed=num("bytes accessed"),
        temp_bytes=None if mem is None else int(mem.temp_size_in_bytes),
        argument_bytes=None if mem is None else int(mem.argument_size_in_bytes),
        output_bytes=None if mem is None else int(mem.output_size_in_bytes),
        custom_calls=calls,
        kernel_estimates=estimates,
        caveats=tuple(_caveats(text, calls, flops, estimates)),
    )


def _caveats(text: str, calls: dict[str, int], flops: float | None,
             estimates: tuple[dict[str, int], ...]) -> list[str]:
    notes = []
    if re.search(r"\swhile\(", text):
        notes.append("while loop: cost_analysis counts its body once, not once per iteration")
    if ONLINE_SOFTMAX in text:
        notes.append("XLA:TPU rewrote the attention into its own online-softmax custom call: "
                     "cost_analysis counts only the QKᵀ matmul; the rest of its work is hidden")
    if "ynn_fusion" in text:
        notes.append("XLA:CPU folded the attention into one ynn_fusion: memory_analysis shows "
                     "no temporaries although the scores are materialized")
    if flops is not None and flops < 0:
        notes.append("cost_analysis reports negative flops: a custom call counted as -1")
    opaque = {t: n for t, n in calls.items() if t == "tpu_custom_call"}
    if opaque and len(estimates) < sum(opaque.values()) and ONLINE_SOFTMAX not in text:
        notes.append("a tpu_custom_call without cost_estimate: counted as nothing")
    if estimates:
        notes.append("Pallas cost_estimate is the kernel author's formula: it reads Q, K, V "
                     "and writes O once (no K/V re-reads per query block) and may not halve "
                     "causal work; compare with the analytic model")
    return notes


def compile_for(fn: Callable[..., Any], args: tuple[jax.ShapeDtypeStruct, ...],
                target: str) -> jax.stages.Compiled:
    """`jax.jit(fn)` compiled for `target` ("cpu" or a deviceless TPU target) from shapes."""
    t = get_target(target)
    sharding = t.sharding()
    if sharding is None:
        jitted = jax.jit(fn)
    else:
        args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args)
        jitted = jax.jit(fn, in_shardings=sharding, out_shardings=sharding)
    traced = jitted.trace(*args)
    check_host_memory(t, traced.jaxpr.jaxpr)
    try:
        return traced.lower().compile()
    except Exception as e:
        raise HlotoolError(f"cannot compile the probe program for {t.name}: "
                           f"{first_line(e)}") from e


def _operand_shapes(site: AttentionSite) -> tuple[tuple[int, ...], ...]:
    """q, k, v shapes in the site's layout when it is BLHD or BHLD, else canonical BLHD."""
    b, lq, lk = site.batch, site.q_len, site.kv_len
    hq, hkv, d, dv = site.num_q_heads, site.num_kv_heads, site.head_dim, site.v_head_dim
    shapes = ((b, lq, hq, d), (b, lk, hkv, d), (b, lk, hkv, dv))
    if site.layout == "BHLD":
        shapes = tuple((s[0], s[2], s[1], s[3]) for s in shapes)
    return shapes


def _mask_shape(site: AttentionSite) -> tuple[int, ...]:
    full = (site.batch, site.num_q_heads, site.q_len, site.kv_len)
    if site.mask_shape is None or len(site.mask_shape) != 4:
        return full
    return tuple(site.mask_shape)


def naive_program(site: AttentionSite) -> tuple[Callable[..., Any], tuple[jax.ShapeDtypeStruct, ...]]:
    """The naive formula for `site` (its layout, dtype, softmax dtype, mask) and its
    argument shapes: q, k, v and, for additive or boolean masks, the mask operand."""
    bhld = site.layout == "BHLD"
    group = site.num_q_heads // site.num_kv_heads
    soft = jnp.dtype(site.softmax_dtype or site.dtype)
    scale = 1.0 if site.scale is None else site.scale

    def attend(q, k, v, *mask):
        if group > 1:
            k, v = (jnp.repeat(x, group, axis=1 if bhld else 2) for x in (k, v))
        spec = "bhqd,bhkd->bhqk" if bhld else "bqhd,bkhd->bhqk"
        s = jnp.einsum(spec, q, k).astype(soft) * scale
        if site.mask == "additive":
            s = s + mask[0].astype(soft)
        elif site.mask == "boolean":
            s = jnp.where(mask[0], s, -jnp.inf)
        if site.band is not None:  # causal, a window, or both
            s = jnp.where(band_mask(site.q_len, site.kv_len, site.band), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bhkd->bhqd" if bhld else "bhqk,bkhd->bqhd", p, v)

    args = [jax.ShapeDtypeStruct(s, jnp.dtype(site.dtype)) for s in _operand_shapes(site)]
    if site.mask == "additive":
        args.append(jax.ShapeDtypeStruct(_mask_shape(site), jnp.float32))
    elif site.mask == "boolean":
        args.append(jax.ShapeDtypeStruct(_mask_shape(site), jnp.bool_))
    return attend, tuple(args)


def kernel_program(site: AttentionSite, kernel: AttentionKernel
                   ) -> tuple[Callable[..., Any], tuple[jax.ShapeDtypeStruct, ...]]:
    """`kernel` called on the site's operands (same arguments as `naive_program`)."""
    _, args = naive_program(site)
    layout = "BHLD" if site.layout == "BHLD" else "BLHD"
    mask_arg = {"additive": "bias", "boolean": "mask"}.get(site.mask)

    def attend(q, k, v, *mask):
        extra = {mask_arg: mask[0]} if mask_arg else {}
        return kernel(q, k, v, scale=site.scale, causal=site.causal, window=site.window,
                      layout=layout, **extra)

    return attend, args


@functools.cache
def _fuses(site: AttentionSite, target: str) -> bool:
    fn, args = naive_program(site)
    return ONLINE_SOFTMAX in compile_for(fn, args, target).as_text()


def xla_fuses_natively(site: AttentionSite, target: str | None) -> bool | None:
    """Whether XLA:TPU rewrites `site`'s naive formula into its own online-softmax kernel on
    `target`, found by compiling the naive program deviceless; None when no TPU compile
    target exists for it here. XLA:CPU never does (its ynn_fusion still materializes the
    scores)."""
    if target is None:
        return None
    if get_target(target).platform != "tpu":
        return False
    return _fuses(dataclasses.replace(site, function="", source=""), target)


def with_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A probe program's forward and backward, as a train step runs them: the gradient of
    its output's sum with respect to q, k and v."""
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))


@functools.cache
def _host_temporaries(site: AttentionSite, backward: bool) -> int | None:
    fn, args = naive_program(site)
    if backward:
        fn = with_backward(fn)
    try:
        compiled = compile_for(fn, args, "cpu")
    except HlotoolError:
        return None  # too large for this host, or no compile: the caller's formula stands
    memory = compiled.memory_analysis()
    if memory is None or memory.temp_size_in_bytes < site.score_bytes:
        # Less than the one score matrix the unfused program holds: the attention went into
        # one fusion (XLA:CPU's ynn_fusion) whose own buffers memory_analysis leaves out.
        return None
    return int(memory.temp_size_in_bytes)


def host_temporaries(site: AttentionSite, backward: bool = False) -> int | None:
    """The temporaries XLA:CPU allocates for `site`'s naive program (with its gradient where
    `backward`): `memory_analysis()` of that program compiled for this host, once per shape.
    None where XLA does not report them (less than one score matrix: the forward folded
    into one `ynn_fusion`) or the program does not compile here."""
    return _host_temporaries(dataclasses.replace(site, function="", source=""), backward)


def site_figures(site: AttentionSite, target: str, kernel: AttentionKernel
                 ) -> dict[str, XlaFigures]:
    """XLA's figures for the naive and the kernel probe programs of `site` on `target`."""
    out = {}
    for side, (fn, args) in (("native", naive_program(site)),
                             ("kernel", kernel_program(site, kernel))):
        out[side] = figures(compile_for(fn, args, target), target)
    return out


def example_arrays(args: tuple[jax.ShapeDtypeStruct, ...], seed: int = 0) -> list[jax.Array]:
    """Random arrays for probe arguments (booleans: mostly True)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.random(a.shape) > 0.1) if a.dtype == jnp.bool_ else
            jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in args]
