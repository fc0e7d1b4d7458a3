"""Attention whose sequence axis is split over devices (issue 39): `inspect` compiles the
program as the script's run split it and reports, per site, the devices and the collectives
XLA put in its work (an all-gather of K and V along L); `rewrite` prices memory per device.
8 host CPU devices, in a subprocess: XLA_FLAGS must precede jax's first backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hlotool.hlo import parse_shape
from hlotool.passes.native import score_sized
from hlotool.site import AttentionSite

B, L, H, D = 1, 512, 4, 64

SCRIPT = textwrap.dedent(f"""
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    seq = NamedSharding(mesh, P(None, "seq"))

    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jax.device_put(jnp.ones(({B}, {L}, {H}, {D}), jnp.float32), seq)
    jax.jit(attention, out_shardings=seq)(x, x, x).block_until_ready()
    """)


def _hlotool(tmp_path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "split.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "hlotool", *args[:1], str(script), *args[1:]],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_inspect_reports_the_devices_and_the_all_gathers_of_a_split_sequence(tmp_path):
    """On the host and on a v5p slice of 8 chips (deviceless): 8 partitions, K and V each
    all-gathered whole along L (float32 on the host; XLA:TPU gathers them as the bfloat16
    its dots read); a one-chip target compiles the program whole."""
    done = _hlotool(tmp_path, "inspect", "--json", "--target", "cpu", "--target", "tpu-v5p-8",
                    "--target", "tpu-v5e")
    assert done.returncode == 0, done.stderr
    (site,) = json.loads(done.stdout)["sites"]
    for target, itemsize in (("cpu", 4), ("tpu-v5p-8", 2)):
        fate = site["native"][target]
        assert fate["partitions"] == 8, target
        # K for Q·Kᵀ and V for P·V, each gathered whole onto every device.
        gathered = [(c["what"].removesuffix("-start"), c["along"], c["nbytes"])
                    for c in fate["collectives"]]
        assert gathered == [("all-gather", "L", B * L * H * D * itemsize)] * 2, target
        assert fate["score_buffers"] > 0  # each device's [L/8, L] share of the scores
    whole = site["native"]["tpu-v5e"]
    assert whole["partitions"] == 1 and whole["collectives"] == []
    table = _hlotool(tmp_path, "inspect")
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if "cpu (8 devices)" in line)
    gathered_mib = 2 * B * L * H * D * 4 / 2**20
    assert f"2 all-gather along L ({gathered_mib:.1f} MiB per device)" in row, row


@pytest.mark.slow
def test_rewrite_prices_a_split_program_per_device(tmp_path):
    done = _hlotool(tmp_path, "rewrite", "--json")
    assert done.returncode == 0, done.stderr
    (memory,) = json.loads(done.stdout)["memory"]
    # three [1, 512, 4, 64] float32 arguments, an eighth of each on a device
    assert memory["native"]["arguments"] == 3 * B * L * H * D * 4 // 8
    table = _hlotool(tmp_path, "rewrite")
    assert table.returncode == 0, table.stderr
    assert "cpu: per device, attention split over 8" in table.stdout
    # diff counts a device's share of the scores as inspect does
    diff = _hlotool(tmp_path, "diff", "--stage", "optimized")
    assert diff.returncode == 0, diff.stderr
    site = next(line for line in diff.stdout.splitlines() if line.strip().startswith("site 1"))
    assert "L×L buffers 0 →" not in site and "L×L buffers" in site, site


@pytest.mark.slow
def test_cost_prices_the_all_gather_against_the_ring_per_device(tmp_path):
    """Per target, one device's figures for both strategies, from the shapes: the all-gather
    brings in 7/8 of K and V, the ring holds less; at L = 512 over 8 devices the host's ring
    pays (7 rendezvous against the naive [64, 512] share), v5p's links do not (its all-gather
    sends both ways round the torus)."""
    done = _hlotool(tmp_path, "cost", "--json", "--no-xla", "--target", "cpu",
                    "--target", "tpu-v5p")
    assert done.returncode == 0, done.stderr
    (site,) = json.loads(done.stdout)["sites"]
    kv = 2 * B * L * H * D * 4
    for target, choice in (("cpu", "ring"), ("tpu-v5p", "all-gather")):
        priced = site["targets"][target]["sequence_split"]
        assert priced["devices"] == 8 and priced["choice"] == choice, priced
        gather, ring = priced["all_gather"], priced["ring"]
        assert gather["link_bytes"] == kv * 7 // 8 == ring["link_bytes"]
        assert ring["memory_bytes"] < gather["memory_bytes"]
        assert gather["seconds"] == gather["link_seconds"] + gather["compute_seconds"]
    table = _hlotool(tmp_path, "cost", "--no-xla", "--target", "cpu", "--target", "tpu-v5p")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.replace("\n    ", " ").splitlines()
    cpu = next(line for line in lines if line.startswith("1 cpu: sequence over 8 devices"))
    assert "all-gather" in cpu and "ring" in cpu and "→ ring (ring ×" in cpu, cpu
    v5p = next(line for line in lines if line.startswith("1 tpu-v5p: sequence over 8"))
    assert "→ all-gather (all-gather ×" in v5p, v5p


RING = textwrap.dedent("""
    import json, re, sys
    from hlotool.api import rewrite_captured
    from hlotool.capture import capture_script

    (native,) = capture_script(sys.argv[1])
    _, ring = rewrite_captured(native, kernel="chunked")
    out = {}
    for target in ("cpu", "tpu-v5p-8"):
        for side, program in (("native", native), ("ring", ring)):
            text = program.optimized(target)
            out[f"{target} {side}"] = {
                "permutes": len(re.findall(r"collective-permute(?:-start)?\\(", text)),
                "gathers": sorted(set(re.findall(r"= (\\S+) all-gather(?:-start)?\\(", text))),
                "temp": program.compiled(target).memory_analysis().temp_size_in_bytes}
    print(json.dumps(out))
    """)


def test_a_split_sequence_is_rewritten_into_a_ring_on_the_host_and_a_pod(tmp_path):
    """The rewritten program keeps the run's split: K and V go round the 8 devices by
    collective-permutes (no all-gather left), on the host and on a v5p slice compiled
    deviceless. The kernel is named: at L = 512 auto keeps XLA's all-gather on TPU, where
    the ring does not pay (tests/test_cost_split.py)."""
    (tmp_path / "split.py").write_text(SCRIPT)
    (tmp_path / "ring.py").write_text(RING)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(tmp_path / "ring.py"), str(tmp_path / "split.py")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for target in ("cpu", "tpu-v5p-8"):
        native, ring = out[f"{target} native"], out[f"{target} ring"]
        assert native["permutes"] == 0 and len(native["gathers"]) == 1, native  # K and V
        assert ring["permutes"] > 0 and ring["gathers"] == [], ring
    # At L = 512 a device's share of the scores is small: the host's f32 one still outweighs
    # the ring's blocks; XLA:TPU's bf16 share does not (benchmarks/ring_bench.py: at length).
    assert out["cpu ring"]["temp"] < out["cpu native"]["temp"], out


@pytest.mark.parametrize("dims, partitions, expected", [
    ((1, 4, 512, 512), 1, True),
    ((1, 4, 64, 512), 1, False),    # one device: a slice is not the matrix
    ((1, 4, 64, 512), 8, True),     # Lq split 8 ways
    ((1, 4, 512, 64), 8, True),     # Lk split 8 ways
    ((1, 2, 512, 512), 8, True),    # heads split 2 ways (2 divides 8)
    ((1, 4, 64, 512), 6, False),    # 8 does not divide 6 devices
    ((1, 4, 128, 128), 8, False),   # a 128×128 tile: 1/16 of the matrix, not a share
])
def test_a_device_s_share_of_the_scores_is_score_sized(dims, partitions, expected):
    site = AttentionSite(batch=1, q_len=512, kv_len=512, num_q_heads=4, num_kv_heads=4,
                         head_dim=64, v_head_dim=64, dtype="float32", scale=0.125)
    shape = parse_shape(f"f32[{','.join(map(str, dims))}]")
    assert score_sized(shape, site, partitions) is expected
