"""Regenerates the HLO text fixtures in this folder from small real JAX programs.

    JAX_PLATFORMS=cpu python tests/data/hlo/generate.py

Each program is written three ways: CPU before optimization (`lower().as_text(dialect="hlo",
debug_info=True)`), CPU after optimization (`compile().as_text()`) and TPU v5e after
optimization (deviceless compile through libtpu). The attention program is also lowered
and compiled for a 4-chip v5e mesh with sequence-sharded inputs, lowered without debug info,
and dumped with `--xla_dump_to`; the Pallas TPU flash kernel gives a `tpu_custom_call`.
Lines marked `# fixture:<tag>` are what the source-location tests look for.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

HERE = Path(__file__).resolve().parent


def attention(q, k, v):
    """Causal attention, q/k/v [B, L, H, D] → [B, L, H, D]."""
    scores = jnp.einsum("blhd,bmhd->bhlm", q, k) * (q.shape[-1] ** -0.5)  # fixture:qk
    length = q.shape[1]
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(mask, scores, -1e9)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhlm,bmhd->blhd", probs, v)  # fixture:pv


def mlp_scan(params, x):
    """An MLP applied layer by layer with `lax.scan`; x [B, D], weights [N, D, D]."""

    def layer(h, wb):
        w, b = wb
        return jax.nn.gelu(h @ w + b), jnp.sum(h)  # fixture:scan_dot

    h, sums = lax.scan(layer, x, params)
    return h, sums


def cond_program(x, flag):
    """`lax.cond` between two branches; x [N]."""
    return lax.cond(flag > 0, lambda y: jnp.sin(y) * 2.0, lambda y: jnp.cos(y) - 1.0, x)


def while_program(x):
    """A `lax.while_loop` that doubles x [N] until its sum passes 1000."""
    return lax.while_loop(lambda y: jnp.sum(y) < 1000.0, lambda y: y * 2.0 + 1.0, x)


def transformer_program():
    """A 2-layer flax.linen transformer encoder, x [B, L, D]."""
    import flax.linen as nn

    class Block(nn.Module):
        heads: int

        @nn.compact
        def __call__(self, x):
            y = nn.LayerNorm()(x)
            y = nn.SelfAttention(num_heads=self.heads, deterministic=True)(y)
            x = x + y
            y = nn.LayerNorm()(x)
            y = nn.Dense(4 * x.shape[-1])(y)
            return x + nn.Dense(x.shape[-1])(nn.gelu(y))

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block(heads=4)(x)
            return x

    model = Encoder()
    x = jnp.ones((2, 16, 32), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)
    return (lambda p, x: model.apply(p, x)), (params, x)


def programs():
    qkv = jnp.ones((1, 16, 2, 8), jnp.float32)
    weights = (jnp.ones((3, 16, 16), jnp.float32) * 0.01, jnp.zeros((3, 16), jnp.float32))
    apply, args = transformer_program()
    return {
        "attention": (attention, (qkv, qkv, qkv)),
        "mlp_scan": (mlp_scan, (weights, jnp.ones((4, 16), jnp.float32))),
        "cond": (cond_program, (jnp.ones((8,), jnp.float32), jnp.int32(1))),
        "while": (while_program, (jnp.ones((8,), jnp.float32),)),
        "transformer": (apply, args),
    }


def tpu_lowered(fn, args, topology: str, mesh_shape: tuple[int, ...], spec: P):
    """A deviceless TPU lowering; 4-D arguments get `spec`, the rest are replicated."""
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    mesh = topologies.make_mesh(topo, mesh_shape, ("x",))
    sharding = NamedSharding(mesh, spec)
    replicated = NamedSharding(mesh, P())

    def sds(a):
        s = sharding if getattr(a, "ndim", 0) == 4 else replicated
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    shaped = jax.tree_util.tree_map(sds, args)
    in_shardings = jax.tree_util.tree_map(lambda s: s.sharding, shaped)
    jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=replicated)
    return jitted.trace(*shaped).lower()


def flash_program(q, k, v):
    """The upstream Pallas TPU flash kernel, q/k/v [B, H, L, D]: a `tpu_custom_call`."""
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    return flash_attention(q, k, v, causal=True)


def dump_files() -> None:
    """`--xla_dump_to` output of the attention program (needs a fresh process)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp} --xla_dump_hlo_as_text")
        code = (
            f"import sys; sys.path.insert(0, {str(HERE)!r}); import generate, jax; "
            "x = jax.numpy.ones((1, 16, 2, 8)); "
            "jax.jit(generate.attention)(x, x, x).block_until_ready()"
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True)
        for pattern, out in (
            ("*jit_attention*before_optimizations.txt", "dump_attention_before.txt"),
            ("*jit_attention*cpu_after_optimizations.txt", "dump_attention_after.txt"),
        ):
            (found,) = glob.glob(os.path.join(tmp, pattern))
            shutil.copy(found, HERE / out)


def main() -> None:
    for name, (fn, args) in programs().items():
        lowered = jax.jit(fn).lower(*args)
        (HERE / f"{name}.cpu_pre.hlo").write_text(lowered.as_text(dialect="hlo", debug_info=True))
        (HERE / f"{name}.cpu_post.hlo").write_text(lowered.compile().as_text())
        tpu = tpu_lowered(fn, args, "v5e:1x1", (1,), P())
        (HERE / f"{name}.tpu_post.hlo").write_text(tpu.compile().as_text())
    fn, args = programs()["attention"]
    (HERE / "attention.nodebug.cpu_pre.hlo").write_text(
        jax.jit(fn).lower(*args).as_text(dialect="hlo")
    )
    sharded = tpu_lowered(fn, args, "v5e:2x2", (4,), P(None, "x", None, None))
    (HERE / "attention.sharded.tpu_pre.hlo").write_text(
        sharded.as_text(dialect="hlo", debug_info=True)
    )
    (HERE / "attention.sharded.tpu_post.hlo").write_text(sharded.compile().as_text())
    qkv = jnp.ones((1, 2, 256, 128), jnp.bfloat16)
    flash = tpu_lowered(flash_program, (qkv, qkv, qkv), "v5e:1x1", (1,), P())
    (HERE / "flash.tpu_post.hlo").write_text(flash.compile().as_text())
    dump_files()


if __name__ == "__main__":
    main()
