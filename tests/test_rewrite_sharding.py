"""Sharded programs: the kernel runs under shard_map over the mesh's batch/head axes, on 8
host CPU devices (a subprocess: XLA_FLAGS must precede jax) and on a deviceless TPU v5e:2x2;
and train steps the user wrote with shard_map, whose sites live in its body."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.experimental import topologies
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import hlotool
from hlotool import kernels
from hlotool.passes.from_jaxpr import detect_jaxpr

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


@pytest.mark.slow
def test_eight_cpu_devices_explicit_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(__file__))
    run = subprocess.run([sys.executable, "-c", CPU_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # One per platform branch: cpu, tpu and cuda, where float32 on CUDA has a kernel of its
    # own (jax's Triton kernel; jax 0.12.1 removed it, and there cuda shares cpu's chunked).
    branches = 3 if kernels.registered("pallas_gpu").unavailable_reason is None else 2
    assert result["devices"] == 8 and result["shard_map"] == branches
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
    # One per platform branch running a kernel: tpu, cuda and the cpu where its price says
    # the chunked kernel pays at this length.
    plain = jax.ShapeDtypeStruct(specs[0].shape, specs[0].dtype)
    (site,) = hlotool.explain(causal, plain, plain, plain).sites
    assert site.kernels["tpu"] == "splash_tpu" and site.kernels["cuda"] == "cudnn"
    assert site.kernels["cpu"] == ("chunked" if site.choices["cpu"].verdict.pays else None)
    assert str(traced.jaxpr).count("shard_map[") == sum(map(bool, site.kernels.values()))
    lowered = traced.lower()
    assert lowered.as_text().count("stablehlo.custom_call @tpu_custom_call") == 1
    # Without shard_map this fails: Mosaic kernels cannot be partitioned automatically.
    assert "tpu_custom_call" in lowered.compile().as_text()


# --- train steps written with shard_map: the sites live in its body ------------------------

def data_parallel(loss, mesh, check_vma=True):
    """A data-parallel train step as written with shard_map: each device takes the loss and
    gradient of its shard of the batch, then their mean over the "data" axis."""
    def step(params, tokens):
        def per_device(params, tokens):
            return jax.lax.pmean(jax.value_and_grad(loss)(params, tokens), "data")
        return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")),
                             out_specs=P(), check_vma=check_vma)(params, tokens)
    return step


def decoder_loss():
    from test_rewrite_models import load_example

    m = load_example("causal_decoder")
    return m, functools.partial(m.loss_fn, heads=2)


@pytest.mark.parametrize("axis_type,check_vma", [("Auto", True), ("Explicit", True),
                                                 ("Auto", False)])
@pytest.mark.slow
def test_a_data_parallel_train_step_rewrites_each_site_in_the_shard_map_body(axis_type,
                                                                               check_vma):
    from test_rewrite_models import relative_error, tpu_custom_calls

    m, loss = decoder_loss()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(getattr(AxisType, axis_type),))
    params = m.init_params(jax.random.key(0), 16, 2)
    tokens = jax.random.randint(jax.random.key(1), (1, 512), 0, m.VOCAB)
    # The mean over one device is exact: the step equals the plain step on the whole batch.
    plain = jax.jit(jax.value_and_grad(loss))(params, tokens)
    if axis_type == "Explicit":
        tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    step = data_parallel(loss, mesh, check_vma)
    report = hlotool.explain(step, params, tokens)
    assert (len(report.sites), report.rewritten) == (2, 2), str(report)
    assert all(s.where == "shard_map.jaxpr" for s in report.sites), str(report)
    fast = hlotool.flash_jit(step)
    assert relative_error(fast(params, tokens), plain) < 1e-5
    calls = str(fast.trace(params, tokens).jaxpr)
    assert calls.count("name=hlotool_flash_backward") == 2
    assert detect_jaxpr(fast.trace(params, tokens).jaxpr) == []
    if axis_type == "Explicit":
        return
    # Upstream's TPU kernels type their outputs without the body's mesh axes: under
    # check_vma the table passes over them, saying so, to the chunked kernel; without it,
    # three kernels per site (forward, dq, dk/dv) run in the body.
    tpu = [s.kernels["tpu"] for s in report.sites]
    if check_vma:
        assert tpu == ["chunked", "chunked"], str(report)
        assert [r.kernel for r in report.sites[0].choices["tpu"].refusals][:2] == [
            "splash_tpu", "pallas_tpu"]
        assert all("check_vma=False" in s.reason for s in report.sites)
        assert tpu_custom_calls(step, params, tokens) == 0
    else:
        assert tpu == ["splash_tpu", "splash_tpu"], str(report)
        assert tpu_custom_calls(step, params, tokens) == 2 * 3


@pytest.mark.slow
def test_a_gradient_taken_outside_the_shard_map_says_where_to_take_it():
    from test_rewrite_models import relative_error

    m, loss = decoder_loss()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,))
    params = m.init_params(jax.random.key(0), 16, 1)
    tokens = jax.random.randint(jax.random.key(1), (1, 512), 0, m.VOCAB)

    def sharded_loss(params, tokens):
        per_device = jax.shard_map(lambda p, t: jax.lax.pmean(loss(p, t), "data"), mesh=mesh,
                                   in_specs=(P(), P("data")), out_specs=P())
        return per_device(params, tokens)

    (site,) = hlotool.explain(jax.grad(sharded_loss), params, tokens).sites
    assert not site.rewritten
    assert "take the gradient inside the shard_map" in site.reason
    # What the reason offers instead: the forward rewritten, jax's AD through the kernel.
    got = jax.jit(jax.grad(hlotool.flash_jit(sharded_loss)))(params, tokens)
    assert relative_error(got, jax.jit(jax.grad(sharded_loss))(params, tokens)) < 1e-5


DATA_PARALLEL_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    import hlotool
    from test_rewrite_models import relative_error
    from test_rewrite_sharding import data_parallel, decoder_loss

    m, loss = decoder_loss()
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = m.init_params(jax.random.key(0), 16, 2)
    tokens = jax.random.randint(jax.random.key(1), (4, 512), 0, m.VOCAB)
    step = data_parallel(loss, mesh)
    report = hlotool.explain(step, params, tokens)
    got = hlotool.flash_jit(step)(params, tokens)
    print(json.dumps({
        "devices": jax.device_count(), "rewritten": report.rewritten,
        "error": relative_error(got, jax.jit(step)(params, tokens)),
    }))
""")


# Slow (a subprocess with four CPU devices): the README's test command leaves it to CI.
@pytest.mark.slow
def test_a_data_parallel_train_step_on_four_cpu_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(__file__))
    run = subprocess.run([sys.executable, "-c", DATA_PARALLEL_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert (result["devices"], result["rewritten"]) == (4, 2)
    assert result["error"] < 1e-5
