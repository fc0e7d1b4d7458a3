"""A kernel call on a device mesh: split over batch and heads with `jax.shard_map`, and over
an axis left over along the sequence, as ring attention (`hlotool.kernels.ring`).

Pallas TPU kernels cannot be auto-partitioned ("Mosaic kernels cannot be automatically
partitioned"), so a program sharded over a mesh runs each kernel call per shard: the batch
axis over mesh axes that divide it, the heads over axes that divide both the query and the
key/value heads (each shard keeps whole GQA groups). A mesh axis left over splits the
sequence: each device keeps its block of queries and the key/value blocks go round the ring,
where `ring.refusal` takes the call; elsewhere that axis replicates the call. The ring's steps
are the chunked kernel's, except where the call's platform runs a TPU kernel and tokamax's
ring splash takes the call (`ring_tokamax.refusal`): there tokamax's kernel runs the ring.
Whether the ring pays against XLA's all-gather is priced above this layer
(`hlotool.cost.split`): with `kernel="auto"` flash_jit keeps such a site native where it
does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from hlotool import jaxcompat
from hlotool.kernels import ring, ring_tokamax
from hlotool.kernels.base import AttentionKernel, Call, Features
from hlotool.kernels.drawn import DrawnMask
from hlotool.site import AttentionSite


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


def mesh_split(mesh: Any, batch: int, q_heads: int, kv_heads: int
               ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Mesh axes that split the batch, and those that split the heads."""
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


def left_over(mesh: Any, batch: Sequence[str], heads: Sequence[str]) -> str | None:
    """The first mesh axis of size > 1 that splits neither the batch nor the heads: the one a
    ring over the sequence runs along; None where there is none."""
    return next((axis for axis, size in mesh.shape.items()
                 if size > 1 and axis not in (*batch, *heads)), None)


def split(mesh: Any, site: AttentionSite
          ) -> tuple[tuple[str, ...], tuple[str, ...], str | None, str]:
    """How a call of `site` is split over `mesh`: the axes splitting the batch and the heads
    (`mesh_split`), the axis a ring over the sequence runs along (the first left over, of
    size > 1, where `ring.refusal` takes the site split that many ways), and why no ring
    where an axis is left over but the ring refuses ("" otherwise)."""
    batch, heads = mesh_split(mesh, site.batch, site.num_q_heads, site.num_kv_heads)
    axis = left_over(mesh, batch, heads)
    why = None if axis is None else ring.refusal(site, mesh.shape[axis])
    return batch, heads, (None if why else axis), why or ""


def split_note(mesh: Any, site: AttentionSite, on_tpu: bool = True) -> str:
    """How a kernel call of `site` is split over `mesh`, for reports ("" where it is not).
    on_tpu: whether a TPU kernel runs the call (then the note says whether tokamax's ring
    runs it there)."""
    if mesh is None:
        return ""
    batch, heads, seq, why = split(mesh, site)
    parts = [f"{name} over mesh axes {', '.join(axes)}"
             for name, axes in (("batch", batch), ("heads", heads)) if axes]
    if seq:
        n = mesh.shape[seq]
        dealt = (", dealt zig-zag so every device computes as much of the causal mask"
                 if ring.dealt_zigzag(site.band, site.q_len // n) else "")
        parts.append(f"sequence over mesh axis {seq} ({n} devices) as ring attention: K/V "
                     "blocks passed round, none gathered, each step in the chunked kernel"
                     + (f" ({ring_tokamax.note(site, n)})" if on_tpu else "") + dealt)
    elif why:
        parts.append(f"not the sequence as a ring ({why}): a mesh axis left over holds the "
                     "call whole")
    return "on the mesh: " + "; ".join(parts) if parts else ""


def on_mesh(kernel: AttentionKernel, call: Call, mesh: Any) -> jax.Array:
    """`kernel.run(call)` ([B, Lq, Hq, Dv]), per shard of `mesh` when it splits batch or heads; over
    a mesh axis left over, the sequence split along it and computed as a ring (`ring`), where
    the ring takes the call (else that axis replicates it)."""
    run = kernel.run
    if mesh is None:
        return run(call)
    site = call.site()
    batch, heads, seq, _ = split(mesh, site)
    if not (batch or heads or seq):
        return run(call)
    if isinstance(call.post_mask, DrawnMask):  # its tiles count positions of the whole call
        call = dataclasses.replace(call, post_mask=call.post_mask.dense())
    spec = jax.sharding.PartitionSpec
    qkv = spec(batch or None, seq, heads or None, None)
    scores = [None if x is None else spec(batch if x.shape[0] > 1 else None,
                                          heads if x.shape[1] > 1 else None, None,
                                          seq if x.shape[3] > 1 else None)
              for x in (call.bias, call.mask)]
    lengths = None if call.kv_lengths is None else spec(batch or None)
    # [B, L] per row of the batch (segment ids), [B|1, Lq] (the query mask).
    rows = [None if x is None else spec(batch if x.shape[0] > 1 else None, seq)
            for x in (*(call.segments or (None, None)), call.query_mask)]
    specs = (qkv, qkv, qkv, *scores, lengths, *rows)
    args = (call.q, call.k, call.v, call.bias, call.mask, call.kv_lengths,
            *(call.segments or (None, None)), call.query_mask)

    tokamax = bool(seq) and _tokamax_ring(kernel, site, call.features, mesh.shape[seq])

    def shard(q, k, v, bias, mask, kv_lengths, q_ids, kv_ids, query_mask):
        local = dataclasses.replace(
            call, q=q, k=k, v=v, bias=bias, mask=mask, kv_lengths=kv_lengths,
            segments=None if q_ids is None else (q_ids, kv_ids), query_mask=query_mask)
        if not seq:
            return run(local)
        if tokamax:
            return ring_tokamax.attend(local, seq, mesh.shape[seq],
                                       interpret=getattr(kernel, "interpret", False))
        return ring.attend(local, seq, mesh.shape[seq])

    # Explicit-axis meshes type values with their sharding: shard_map wants them already
    # split as `specs` says.
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        args = tuple(x if x is None else jax.sharding.reshard(
            x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, specs))
    return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=qkv,
                         check_vma=False)(*args)


def _tokamax_ring(kernel: AttentionKernel, site: AttentionSite, features: Features,
                  n: int) -> bool:
    """Whether the ring of a call of `site` (asking for `features`, split n ways) runs in
    tokamax's ring splash instead of chunked steps: `kernel` is a TPU kernel (`per_platform`
    stages it on TPU alone) and tokamax's ring takes the call (`ring_tokamax.refusal`, whose
    reason `split_note` shows)."""
    return (tuple(kernel.platforms) == ("tpu",)
            and ring_tokamax.refusal(site, features, n) is None)
