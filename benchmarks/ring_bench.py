"""Ring attention on a split sequence: a decoder's train step with its sequence split over 8
host devices, jax.jit's program (K and V all-gathered, each device a [B, H, L/8, L] share of
the scores) beside flash_jit's (the ring: K/V blocks passed round by collective-permutes).

Per device, from XLA's memory analysis of each compiled program at --length: arguments,
outputs, temporaries, their sum, and the ratio of the sums; the collectives each program
holds. The ring's step is run at --length and timed (the native one is compiled only: at 32K
its share of the scores alone is B·H·L²/8 floats per device, past this host's memory); the
two are compared at --check-length: loss and gradients, largest difference over largest
value, and the step's time (median of 3).

    python benchmarks/ring_bench.py                       # L = 32768, check at 2048
    python benchmarks/ring_bench.py --length 8192 --check-length 1024
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

DEVICES = 8
# The host's devices are fixed when jax starts its CPU backend: set before importing jax.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--check-length", type=int, default=2048)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import hlotool
    from _transformer import param_shapes, transformer

    mesh = jax.make_mesh((DEVICES,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    split, whole = NamedSharding(mesh, P(None, "seq", None)), NamedSharding(mesh, P())

    def loss(params, x):
        return jnp.mean(jnp.square(transformer(params, x, a.heads)))

    step = jax.value_and_grad(loss)
    programs = {"jax.jit (all-gather)": jax.jit(step), "flash_jit (ring)": hlotool.flash_jit(step)}
    rng = np.random.default_rng(0)
    params = [{n: jax.device_put(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]),
                                             jnp.float32), whole)
               for n, s in param_shapes(a.dim).items()} for _ in range(a.layers)]

    def x_of(length):
        return jax.device_put(jnp.asarray(rng.standard_normal((1, length, a.dim)),
                                          jnp.float32), split)

    rows = []
    spec = jax.ShapeDtypeStruct((1, a.length, a.dim), jnp.float32, sharding=split)
    for name, fn in programs.items():
        start = time.perf_counter()
        compiled = fn.lower(params, spec).compile()
        mem = compiled.memory_analysis()
        text = compiled.as_text()
        count = lambda op: len(re.findall(rf"{op}(?:-start)?\(", text))  # noqa: E731
        parts = (mem.argument_size_in_bytes, mem.output_size_in_bytes,
                 mem.temp_size_in_bytes)
        rows.append([name, *parts, sum(parts), count("all-gather"),
                     count("collective-permute"), time.perf_counter() - start])
    x = x_of(a.length)
    ring = programs["flash_jit (ring)"]
    ring(params, x)[0].block_until_ready()  # compile
    start = time.perf_counter()
    value, _ = ring(params, x)
    value.block_until_ready()
    run = time.perf_counter() - start

    gib = 2**30
    print(f"{a.layers}-layer decoder, train step, [1, {a.length}, {a.dim}] split over "
          f"{DEVICES} host devices along the sequence, {a.heads} heads, causal (fill -1e9); "
          "memory per device (XLA memory_analysis)")
    print(f"{'program':<22}{'arguments':>11}{'outputs':>10}{'temps':>11}{'sum':>11}"
          f"{'all-gather':>12}{'permutes':>10}{'compile':>9}")
    for name, args_b, out_b, temp_b, total, gathers, permutes, secs in rows:
        print(f"{name:<22}{args_b / gib:>10.3f}G{out_b / gib:>9.3f}G{temp_b / gib:>10.3f}G"
              f"{total / gib:>10.3f}G{gathers:>12}{permutes:>10}{secs:>8.1f}s")
    print(f"ring / native per device: ×{rows[1][4] / rows[0][4]:.3f}; the ring's step at "
          f"L={a.length} ran in {run:.1f} s (loss {float(value):.6f})")

    x = x_of(a.check_length)
    (l_n, g_n), (l_r, g_r) = (fn(params, x) for fn in programs.values())
    errors = [float(jnp.max(jnp.abs(r - n)) / jnp.max(jnp.abs(n)))
              for n, r in zip(jax.tree.leaves(g_n), jax.tree.leaves(g_r))]
    print(f"at L={a.check_length}: loss {float(l_n):.6f} vs {float(l_r):.6f} (|Δ| "
          f"{abs(float(l_n) - float(l_r)):.2e}); gradients, largest |Δ| / largest |g| over "
          f"{len(errors)} arrays: {max(errors):.2e}")
    steps = {name: [] for name in programs}  # both compiled above; median of 3, alternating
    for _ in range(3):
        for name, fn in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, x))
            steps[name].append(time.perf_counter() - start)
    native, ring = (sorted(t)[1] for t in steps.values())
    print(f"step time at L={a.check_length} (median of 3, this host's {DEVICES} devices share "
          f"its cores): native {native:.2f} s, ring {ring:.2f} s, native / ring ×"
          f"{native / ring:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
