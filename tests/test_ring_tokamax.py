"""tokamax's ring attention as the ring's implementation on TPU (issue 39): where tokamax is
installed and its ring splash kernel computes a sequence-split call exactly, the TPU program
runs the whole ring in it (splash kernels per step, K/V passed round by collective-permutes,
no all-gather); elsewhere the ring's chunked steps, with the reason in the report.

The TPU programs are compiled deviceless for a v5p slice (2x2x2), as tests/test_sequence_
sharded.py does for the chunked ring. The numerics run tokamax's kernel in Pallas' interpret
mode (`SplashConfig(interpret=True)`) on 8 host CPU devices, which works here (jax 0.12.1,
tokamax 0.0.17). 8 host devices need XLA_FLAGS before jax's first backend: subprocesses.
Without tokamax (Python 3.11's venv) only the reason is checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hlotool.kernels import ring_tokamax
from hlotool.kernels.base import Features
from hlotool.kernels.tokamax import INSTALL, installed
from hlotool.site import AttentionSite

needs_tokamax = pytest.mark.skipif(not installed(),
                                   reason="tokamax is not installed (hlotool[tokamax])")

SITE = AttentionSite(batch=1, q_len=1024, kv_len=1024, num_q_heads=4, num_kv_heads=4,
                     head_dim=64, v_head_dim=64, dtype="float32", scale=0.125, mask="causal",
                     causal=True, mask_fill=float("-inf"))

SPLIT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    seq = NamedSharding(mesh, P(None, "seq"))

    def attention(q, k, v, fill):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(
            jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, fill), axis=-1), v)

    def causal(q, k, v):
        return attention(q, k, v, -jnp.inf)

    def finite_fill(q, k, v):  # hidden keys at finfo.min: tokamax's ring refuses it
        return attention(q, k, v, jnp.finfo(q.dtype).min)

    x = jax.device_put(jnp.ones((1, 1024, 4, 64), jnp.float32), seq)
    for f in (causal, finite_fill):
        jax.jit(f, out_shardings=seq)(x, x, x).block_until_ready()
    """)

EXPORT = textwrap.dedent("""
    import dataclasses, json, re, sys
    import jax, jax.numpy as jnp
    from hlotool import jaxcompat
    from hlotool.api import rewrite_captured
    from hlotool.capture import capture_script

    def counts(program):
        text = program.optimized("tpu-v5p-8")
        kernels = re.findall(r"%(splash_mha_[a-z_]+)\\.\\d+ = .*custom-call\\(", text)
        return {"kernels": {k: kernels.count(k) for k in sorted(set(kernels))},
                "tpu_custom_calls": text.count('custom_call_target="tpu_custom_call"'),
                "permutes": len(re.findall(r"collective-permute(?:-start)?\\(", text)),
                "gathers": sorted(set(re.findall(r"= (\\S+) all-gather(?:-start)?\\(", text)))}

    functions = capture_script(sys.argv[1])  # kept: the targets live as long as they do
    out = {}
    for fn in functions:
        report, ring = rewrite_captured(fn, kernel="tokamax_tpu")
        out[fn.name] = {"note": report.sites[0].notes[-1], "forward": counts(ring)}
        if fn.name != "causal":
            continue
        forward = jaxcompat.jaxpr_as_fun(ring.closed_jaxpr)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fn.in_avals]
        step = jax.make_jaxpr(jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.sin(forward(q, k, v)[0])), (0, 1, 2)))(*args)
        ins = fn.shardings[0]
        whole = jax.sharding.NamedSharding(ins[0].mesh, jax.sharding.PartitionSpec())
        # Split as the run split its inputs: the loss whole, each gradient as its input.
        step = dataclasses.replace(ring.with_jaxpr(step), shardings=(ins, (whole, *ins)))
        out[fn.name]["value_and_grad"] = counts(step)
    print(json.dumps(out))
    """)


def _subprocess(tmp_path, script: str, *args: str, timeout: int = 300) -> dict:
    (tmp_path / "run.py").write_text(script)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), *args],
                          capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_tokamax
def test_a_v5p_slice_runs_the_ring_in_tokamax_s_splash_kernels(tmp_path):
    """Causal, -inf, split 8 ways: per step of the forward one splash forward kernel (8),
    per step of the backward one fused dK/dV/dQ kernel (8 more); K and V (and the zig-zag
    deal) go by collective-permutes, nothing is all-gathered. The same site with a finite
    fill keeps the chunked ring on TPU (no splash kernel, permutes still), and says why."""
    (tmp_path / "split.py").write_text(SPLIT)
    out = _subprocess(tmp_path, EXPORT, str(tmp_path / "split.py"))
    causal, finite = out["causal"], out["finite_fill"]
    assert "(on TPU in tokamax ring splash)" in causal["note"], causal
    forward, step = causal["forward"], causal["value_and_grad"]
    assert forward["kernels"] == {"splash_mha_fwd_residuals": 8}, forward
    assert forward["tpu_custom_calls"] == 8 and forward["gathers"] == [], forward
    # 7 hops of K and V, the deal of q, k, v and the collect of the output in halves
    assert forward["permutes"] == 2 * 7 + 2 * 3 + 2, forward
    assert step["kernels"] == {"splash_mha_fwd_residuals": 8,
                               "splash_mha_dkv_no_residuals": 8}, step
    assert step["tpu_custom_calls"] == 16 and step["gathers"] == [], step
    assert step["permutes"] > forward["permutes"], step

    assert finite["forward"]["tpu_custom_calls"] == 0, finite
    assert finite["forward"]["permutes"] > 0 and finite["forward"]["gathers"] == [], finite
    assert ("on TPU too: not tokamax ring splash, hidden keys keep logit -3.40282e+38: "
            "tokamax's ring splash hides them outright, exact only under a -inf fill"
            in finite["note"]), finite


NUMERICS = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from hlotool.kernels.base import make_call
    from hlotool.kernels.sharded import on_mesh
    from hlotool.kernels.splash_tpu import SplashTpu

    case = json.loads(sys.argv[1])
    n = case["devices"]
    L, B, HQ, HKV, D = 128 * n, 2, 4, case["kv_heads"], 64  # a block of 128 per device
    dtype = jnp.dtype(case["dtype"])
    mesh = jax.make_mesh((n,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])
    tpu = SplashTpu(interpret=True)  # the TPU kernel whose platform runs the ring

    window = None if case.get("window") is None else tuple(case["window"])
    softcap = case.get("softcap")

    def ring(q, k, v):
        return on_mesh(tpu, make_call(q, k, v, scale=0.125, causal=case["causal"],
                                      window=window, softcap=softcap), mesh)

    def naive(q, k, v):
        k, v = (jnp.repeat(x, HQ // HKV, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * 0.125
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        if case["causal"]:
            s = jnp.where(jnp.tril(jnp.ones((L, L), bool)), s, -jnp.inf)
        if window is not None:
            i, j = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
            s = jnp.where((j >= i - window[0]) & (j <= i + window[1]), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, HQ, D)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((B, L, HKV, D)), dtype) for _ in range(2))

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))

    def error(got, want):
        got, want = (jnp.asarray(x, jnp.float32) for x in (got, want))
        return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))

    out = {"output": error(jax.jit(ring)(q, k, v), jax.jit(naive)(q, k, v))}
    got = jax.jit(jax.grad(loss(ring), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(naive), (0, 1, 2)))(q, k, v)
    out["grads"] = [error(g, w) for g, w in zip(got, want)]
    print(json.dumps(out))
    """)

NUMERIC_CASES = {
    "causal, GQA 4/2, float32, 4 devices": dict(causal=True, kv_heads=2, dtype="float32",
                                                devices=4),
    "causal, GQA 4/2, float32, 8 devices": dict(causal=True, kv_heads=2, dtype="float32",
                                                devices=8),
    "no mask, MQA, bfloat16, 8 devices": dict(causal=False, kv_heads=1, dtype="bfloat16",
                                              devices=8),
    "causal, MHA, bfloat16, 8 devices": dict(causal=True, kv_heads=4, dtype="bfloat16",
                                             devices=8),
    # A window over two blocks (each device's 128 keys, dealt zig-zag in halves of 64) and a
    # two-sided one; tokamax's splash soft-cap, tanh(s / c) · c.
    "causal window 150, GQA 4/2, float32, 4 devices": dict(
        causal=True, window=(150, 0), kv_heads=2, dtype="float32", devices=4),
    "window (40, 40), MHA, float32, 4 devices": dict(
        causal=False, window=(40, 40), kv_heads=4, dtype="float32", devices=4),
    "causal, soft-cap 2, GQA 4/2, float32, 4 devices": dict(
        causal=True, softcap=2.0, kv_heads=2, dtype="float32", devices=4),
}


@needs_tokamax
@pytest.mark.sweep(keep=1)
@pytest.mark.parametrize("case", NUMERIC_CASES.values(), ids=NUMERIC_CASES.keys())
def test_tokamax_s_ring_gives_jax_jit_s_outputs_and_gradients(tmp_path, case):
    """Through the seam flash_jit's TPU branch takes (`sharded.on_mesh` with a TPU kernel's
    `run`), tokamax's ring in interpret mode on 4 or 8 host devices, a block of 128 per
    device (causal: dealt zig-zag), batch 2: outputs and gradients equal jax.jit's naive
    attention within float32 / bfloat16 tolerance. (Interpret mode is slow: 8 devices take
    ~25 s here, so the README's tier runs the 4-device case.)"""
    out = _subprocess(tmp_path, NUMERICS, json.dumps(case))
    tolerance = 1e-5 if case["dtype"] == "float32" else 2e-2
    assert out["output"] < tolerance, out
    assert max(out["grads"]) < (1e-5 if case["dtype"] == "float32" else 5e-2), out


def test_the_ring_says_why_tokamax_s_ring_does_not_run_it():
    """Each refusal is one line, the chunked ring keeps the site; without tokamax, that."""
    if not installed():
        assert ring_tokamax.refusal(SITE, Features.of_site(SITE), 8) == (
            f"tokamax not installed: {INSTALL}")
        assert ring_tokamax.note(SITE, 8) == (
            f"on TPU too: not tokamax ring splash, tokamax not installed: {INSTALL}")
        return

    def why(site: AttentionSite, n: int = 8, **features) -> str | None:
        return ring_tokamax.refusal(
            site, dataclasses.replace(Features.of_site(site), **features), n)

    assert why(SITE) is None and ring_tokamax.note(SITE, 8) == "on TPU in tokamax ring splash"
    assert why(SITE, kv_lengths=True) == (
        "key lengths (tokamax's ring splash takes no mask, a causal mask or a window keeping "
        "each query's own key, soft-caps; the chunked ring takes the rest)")
    assert why(dataclasses.replace(SITE, segments=True)).startswith("segment ids (")
    assert why(dataclasses.replace(SITE, query_padding=True)).startswith("query padding (")
    assert why(dataclasses.replace(SITE, dtype="float16")) == (
        "dtype float16 (tokamax's ring splash takes float32, bfloat16)")
    assert why(dataclasses.replace(SITE, window=(4, -1))).startswith(
        "a band (4, -1) that hides a query's own key")
    assert why(SITE, 16) == (
        "a device's block of 64 positions is no multiple of splash's 128-position blocks")
    long = dataclasses.replace(SITE, q_len=32768, kv_len=32768)
    assert why(long) == (
        "its 32768×32768 mask, which tokamax's ring takes as a numpy array, would take "
        "1.0 GiB (hlotool builds one up to 256.0 MiB)")
    assert why(dataclasses.replace(long, mask="none", causal=False, mask_fill=None)) is None
    assert why(dataclasses.replace(SITE, softcap=30.0)) is None  # splash's own soft-cap
