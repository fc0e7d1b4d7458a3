"""A kernel call on a device mesh: split over batch and heads with `jax.shard_map`.

Pallas TPU kernels cannot be auto-partitioned ("Mosaic kernels cannot be automatically
partitioned"), so a program sharded over a mesh runs each kernel call per shard: the batch
axis over mesh axes that divide it, the heads over axes that divide both the query and the
key/value heads (each shard keeps whole GQA groups); other mesh axes replicate the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from hlotool import jaxcompat
from hlotool.kernels.base import Call
from hlotool.kernels.drawn import DrawnMask


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


def on_mesh(run: Callable[[Call], jax.Array], call: Call, mesh: Any) -> jax.Array:
    """`run(call)` ([B, Lq, Hq, Dv]), per shard of `mesh` when it splits batch or heads."""
    if mesh is None:
        return run(call)
    batch, heads = mesh_split(mesh, call.q.shape[0], call.q.shape[2], call.k.shape[2])
    if not (batch or heads):
        return run(call)
    if isinstance(call.post_mask, DrawnMask):  # its tiles count positions of the whole call
        call = dataclasses.replace(call, post_mask=call.post_mask.dense())
    spec = jax.sharding.PartitionSpec
    qkv = spec(batch or None, None, heads or None, None)
    scores = [None if x is None else spec(batch if x.shape[0] > 1 else None,
                                          heads if x.shape[1] > 1 else None)
              for x in (call.bias, call.mask)]
    lengths = None if call.kv_lengths is None else spec(batch or None)
    specs = (qkv, qkv, qkv, *scores, lengths)
    args = (call.q, call.k, call.v, call.bias, call.mask, call.kv_lengths)

    def shard(q, k, v, bias, mask, kv_lengths):
        return run(dataclasses.replace(call, q=q, k=k, v=v, bias=bias, mask=mask,
                                       kv_lengths=kv_lengths))

    # Explicit-axis meshes type values with their sharding: shard_map wants them already
    # split as `specs` says.
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        args = tuple(x if x is None else jax.sharding.reshard(
            x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip(args, specs))
    return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=qkv,
                         check_vma=False)(*args)
