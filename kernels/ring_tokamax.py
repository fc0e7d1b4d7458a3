"""tokamax's ring attention on TPU: the whole ring of a sequence-split call in tokamax's ring
splash kernel (`make_ring_attention`, experimental, under tokamax's `_src`), where tokamax is
installed and the kernel computes the call exactly; elsewhere the ring runs its chunked steps
(`hlotool.kernels.ring`). `sharded.on_mesh` decides, for a call whose platform runs a TPU
kernel, by `refusal`; its reason is what reports show.

Inside the `shard_map` body over the ring's mesh axis device r holds block r of q, k, v
([B, L/n, H, D]); tokamax's kernel takes one example as q [Hq, L/n, D], k and v [Hkv, L/n, D]
([L/n, D] with `is_mqa` where Hkv = 1), grouped K/V heads natively, and passes K/V round
with `ppermute`, each step a splash forward (and backward, in its own custom VJP) over the
block it holds. The adapter bridges:
  - batch: `vmap` of the per-example kernel;
  - scale: folded into q (splash has none), as `splash_tpu` does;
  - the mask: tokamax's ring takes a dense numpy [L, L] mask (or no mask), whose block
    structure it precomputes; a causal mask or a sliding window is built as one, up to
    `MAX_MASK_BYTES` (a larger one is refused, saying so);
  - a causal mask deals the sequence zig-zag first (`ring.deal`, the mask permuted to match),
    so that every device computes as many unmasked blocks at every step;
  - the kernel's mask structure ([n·…] arrays split by q shard) is cut to this device's
    share with its axis index, the whole of it a constant of the program.
Splash gives hidden keys its mask value, not the call's fill, and a row that sees no key at
a step averages that step's keys: exact only where every row sees a key, so it takes a -inf
fill and bands that keep each query's own key (a causal mask, a window around the diagonal),
and refuses key and query padding, segment ids, biases, boolean masks, sinks and masks after
the softmax (the chunked ring takes them). Soft-capping is splash's `attn_logits_soft_cap`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hlotool import jaxcompat
from hlotool.kernels import ring
from hlotool.kernels._upstream import Upstream, block_for, probe, tpu_chip
from hlotool.kernels.base import Call, Features
from hlotool.kernels.tokamax import INSTALL, installed
from hlotool.site import AttentionSite, Band
from hlotool.units import format_bytes

NAME = "tokamax ring splash"
MODULE = "tokamax._src.ops.experimental.tpu.splash_attention.ring_attention_kernel"
_PARAMS = ("mask", "config", "is_mqa", "ring_axis", "q_seq_shards", "kv_seq_shards",
           "mask_value", "save_residuals")
_CONFIG = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
           "block_kv_dkv_compute", "use_base2_exp", "fuse_reciprocal",
           "attn_logits_soft_cap", "interpret")
_LANES = 128  # splash's blocks are whole lanes: a device's block must divide into them
MAX_MASK_BYTES = 256 * 2**20  # the dense [L, L] numpy mask built at trace time, at most
_TAKES = ("tokamax's ring splash takes no mask, a causal mask or a window keeping each "
          "query's own key, soft-caps; the chunked ring takes the rest")


@functools.cache
def _probe() -> Upstream:
    """tokamax's ring kernel module, or why not (imported once, on first use: seconds)."""
    found = probe(MODULE, "make_ring_attention", _PARAMS,
                  ("SplashConfig", "RingSplashAttentionKernel", "mask_lib"),
                  distribution="tokamax")
    if found.module is None:
        return found
    fields = {f.name for f in dataclasses.fields(found.module.SplashConfig)}
    missing = [f for f in _CONFIG if f not in fields]
    if not hasattr(found.module.mask_lib, "FullMask"):
        missing.append("mask_lib.FullMask")
    if missing:
        return Upstream(None, f"{MODULE} lacks {', '.join(missing)} (tokamax changed)")
    return found


def refusal(site: AttentionSite, features: Features, n: int) -> str | None:
    """Why tokamax's ring splash does not run `site` (the whole call, `features` what it
    asks for) split n ways along its sequence on TPU; None when it does. The chunked ring
    must take the site (`ring.refusal`)."""
    if not installed():
        return f"tokamax not installed: {INSTALL}"
    if site.dtype not in ("float32", "bfloat16"):
        return f"dtype {site.dtype} (tokamax's ring splash takes float32, bfloat16)"
    asked = [name for name, present in (
        ("an additive bias", features.bias), ("a boolean mask", features.mask),
        ("key lengths", features.kv_lengths), ("segment ids", features.segments),
        ("query padding", features.query_padding), ("sinks", features.sinks),
        ("a mask after the softmax", features.post_mask or features.dropout)) if present]
    if asked:
        return f"{' and '.join(asked)} ({_TAKES})"
    band = site.band
    if band is not None and features.finite_fill:
        return (f"hidden keys keep logit {site.mask_fill:g}: tokamax's ring splash hides "
                "them outright, exact only under a -inf fill")
    if band is not None and any(edge is not None and edge < 0 for edge in band):
        return f"a band {band} that hides a query's own key ({_TAKES})"
    block = site.q_len // n
    if block % _LANES:
        return (f"a device's block of {block} positions is no multiple of splash's "
                f"{_LANES}-position blocks")
    mask_bytes = site.q_len * site.kv_len
    if band is not None and mask_bytes > MAX_MASK_BYTES:
        return (f"its {site.q_len}×{site.kv_len} mask, which tokamax's ring takes as a numpy "
                f"array, would take {format_bytes(mask_bytes)} (hlotool builds one up to "
                f"{format_bytes(MAX_MASK_BYTES)})")
    return _probe().reason


def note(site: AttentionSite, n: int) -> str:
    """What runs the ring of `site` split n ways on TPU, for reports."""
    why = refusal(site, Features.of_site(site), n)
    return f"on TPU in {NAME}" if why is None else f"on TPU too: not {NAME}, {why}"


def attend(call: Call, axis: str, n: int, *, interpret: bool = False) -> jax.Array:
    """[B, L/n, Hq, Dv] for the local blocks of `call` (inside a shard_map body over `axis`,
    `refusal` None for the whole call) in tokamax's ring splash. interpret: Pallas' interpret
    mode (any platform, slowly): for tests."""
    lk, hkv = call.k.shape[1], call.k.shape[2]  # this device's block of keys
    zigzag = n > 1 and ring.dealt_zigzag(call.band, lk)
    kernel = _kernel(n * lk, n, call.band, zigzag, axis, hkv == 1, call.softcap,
                     block_for(lk, tpu_chip()), interpret)

    def per_example(q, k, v):  # [H, L/n, D] (k, v [L/n, D] for MQA)
        return _local(kernel, axis, n)(q, k, v, None)

    def heads_first(x):  # K/V [B, L/n, Hkv, D] → [B, Hkv, L/n, D], or [B, L/n, D] for MQA
        return x[:, :, 0] if hkv == 1 else jnp.swapaxes(x, 1, 2)

    q = call.q * jnp.asarray(call.scale, call.q.dtype)
    q, k, v = (ring.deal(x, 1, axis, n) if zigzag else x for x in (q, call.k, call.v))
    run = jax.vmap(per_example)
    run = run if interpret else jaxcompat.for_tpu(run)
    out = jnp.swapaxes(run(jnp.swapaxes(q, 1, 2), heads_first(k), heads_first(v)), 1, 2)
    if zigzag:
        out = ring.collect(out, 1, axis, n)
    return out.astype(call.result_dtype)


@functools.lru_cache(maxsize=16)
def _kernel(length: int, n: int, band: Band | None, zigzag: bool, axis: str, mqa: bool,
            softcap: float | None, block: int, interpret: bool):
    """tokamax's ring kernel for a sequence of `length` split n ways along `axis` (its mask
    structure computed from the dense mask once per shape)."""
    mod = _probe().module
    if band is None:
        mask = mod.mask_lib.FullMask(_shape=(length, length))
    else:
        at = ring.dealt_positions(n, length, zigzag)  # the position each place holds
        i, j = at[:, None], at[None, :]
        left, right = band
        mask = np.ones((length, length), bool)
        if left is not None:
            mask &= j >= i - left
        if right is not None:
            mask &= j <= i + right
    config = dataclasses.replace(
        mod.SplashConfig.get_default(), block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        # Its ring merges each step's natural-log statistics (as tokamax's own test sets).
        use_base2_exp=False, fuse_reciprocal=True, attn_logits_soft_cap=softcap,
        interpret=interpret)
    with jax.ensure_compile_time_eval():  # constants, not values of the trace that asked
        return mod.make_ring_attention(mask, config=config, is_mqa=mqa, ring_axis=axis,
                                       q_seq_shards=n, kv_seq_shards=n, save_residuals=False)


def _local(kernel, axis: str, n: int):
    """`kernel` with its mask structure cut to this device's share: what tokamax's
    `manual_sharding_spec` splits along the ring axis (every array but the partial mask
    blocks, split along its first axis)."""
    mod = _probe().module
    me = lax.axis_index(axis)

    def share(info):
        if info is None:
            return None
        fields = info._asdict()
        for name, x in fields.items():
            if x is not None and name != "partial_mask_blocks":
                size = x.shape[0] // n
                fields[name] = lax.dynamic_slice_in_dim(x, me * size, size, axis=0)
        return type(info)(**fields)

    return mod.RingSplashAttentionKernel(share(kernel.fwd_mask_info),
                                         share(kernel.dkv_mask_info), ring_axis=axis,
                                         **kernel.kwargs)
