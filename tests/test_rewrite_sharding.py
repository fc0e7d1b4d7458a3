"""Sharded programs: the kernel runs under shard_map over the mesh's batch/head axes, on 8
host CPU devices (a subprocess: XLA_FLAGS must precede jax) and on a deviceless TPU v5e:2x2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hlotool

B, L, H, D = 4, 512, 4, 16


def causal(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


CPU_SCRIPT = textwrap.dedent(f"""
    import json, math
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import hlotool
    from test_rewrite_sharding import causal

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    spec = NamedSharding(mesh, P("data", None, "model", None))
    rng = np.random.default_rng(0)
    args = [jax.device_put(jnp.asarray(rng.standard_normal(({B}, {L}, {H}, {D})), jnp.float32),
                           spec) for _ in range(3)]
    fast = hlotool.flash_jit(causal)
    got, want = fast(*args), jax.jit(causal)(*args)
    with jax.set_mesh(mesh):  # eager grads of explicitly sharded values need the mesh
        grads = [jax.jit(jax.grad(lambda q, f=f: jnp.sum(f(q, *args[1:]) ** 2)))(args[0])
                 for f in (fast, causal)]
    print(json.dumps({{
        "devices": jax.device_count(),
        "error": float(jnp.abs(got - want).max() / jnp.abs(want).max()),
        "grad_error": float(jnp.abs(grads[0] - grads[1]).max() / jnp.abs(grads[1]).max()),
        "out_spec": str(got.sharding.spec),
        "shard_map": str(fast.trace(*args).jaxpr).count("shard_map["),
    }}))
""")


def test_eight_cpu_devices_explicit_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(__file__))
    run = subprocess.run([sys.executable, "-c", CPU_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8 and result["shard_map"] == 3  # cpu, tpu and cuda branches
    assert result["error"] < 1e-5 and result["grad_error"] < 1e-5
    # jax < 0.10 spells PartitionSpec out in its repr.
    assert result["out_spec"].replace("PartitionSpec(", "P(") == "P('data', None, 'model', None)"


def test_deviceless_tpu_v5e_2x2_compiles_with_kernel_per_shard():
    topology = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    mesh = topologies.make_mesh(topology, (4,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    specs = [jax.ShapeDtypeStruct((B, L, H, 64), jnp.bfloat16, sharding=sharding)] * 3
    fast = hlotool.flash_jit(causal, in_shardings=(sharding,) * 3, out_shardings=sharding)
    traced = fast.trace(*specs)
    # One per platform branch running a kernel: cpu, tpu and cuda.
    plain = jax.ShapeDtypeStruct(specs[0].shape, specs[0].dtype)
    (site,) = hlotool.explain(causal, plain, plain, plain).sites
    assert site.kernels == {"cpu": "chunked", "tpu": "splash_tpu", "cuda": "pallas_gpu"}
    assert str(traced.jaxpr).count("shard_map[") == 3
    lowered = traced.lower()
    assert lowered.as_text().count("stablehlo.custom_call @tpu_custom_call") == 1
    # Without shard_map this fails: Mosaic kernels cannot be partitioned automatically.
    assert "tpu_custom_call" in lowered.compile().as_text()
