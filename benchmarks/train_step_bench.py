"""A train step (gradient taken inside) under flash_jit vs jax.jit: peak memory and step time.

    python benchmarks/train_step_bench.py                        # L = 4096, 8192, 16384
    python benchmarks/train_step_bench.py --lengths 8192 --repeats 5
    python benchmarks/train_step_bench.py --structure remat     # each layer under jax.checkpoint

The step is `jax.value_and_grad` of a mean-square loss through the causal decoder of
`flash_jit_bench.py` (B=1, H=8, D=64, f32, 2 layers, attention written the naive way), then
an SGD update: flash_jit must replace each site's forward and jax's backward of it (with
--structure remat or scan-remat, the backward's recompute inside jax.checkpoint; with
--structure scan, the backward loop's, which reads the probabilities the forward loop saves
until flash_jit has it recompute them in the kernel). Each
variant runs in its own process (peak RSS is per process) capped with RLIMIT_AS at --cap-gb;
a native run whose saved probabilities alone would pass the cap is not started and shows as
"OOM (needs ≈X GB)". Times: median of --repeats steps after a warm-up step, compile apart.
Uses only the standard library's time/resource/subprocess for measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from flash_jit_bench import STRUCTURES, H, decoder, inputs, peak_rss_gb, table  # noqa: E402

# Live [B, H, L, L] f32 matrices a native train step holds at its peak per layer (what each
# layer saves for its backward, and the backward's own), calibrated against the RSS measured
# at L=4096 (4.45 GB).
NAIVE_MATRICES_PER_LAYER = 3.4
BASE_BYTES = 0.8e9


def train_step(layers: int, structure: str):
    import jax
    import jax.numpy as jnp

    forward = decoder(layers, structure)

    def step(x, w):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean(forward(x, w) ** 2))(w)
        return loss, w - 0.1 * grad

    return step


def child(variant: str, length: int, layers: int, repeats: int, cap: int, structure: str
          ) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import jax

    import hlotool

    step = train_step(layers, structure)
    x, w = inputs(length, layers)
    x.block_until_ready()
    sites = rewritten = 0
    if variant == "native":
        jitted = jax.jit(step)
    else:
        jitted = hlotool.flash_jit(step)
        report = hlotool.explain(step, x, w)
        sites, rewritten = len(report.sites), report.rewritten
    t = time.perf_counter()
    compiled = jitted.lower(x, w).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(x, w))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(compiled(x, w))
        times.append(time.perf_counter() - t)
    return {"compile_s": compile_s, "step_s": statistics.median(times),
            "peak_gb": peak_rss_gb(), "sites": sites, "rewritten": rewritten}


def run_child(variant: str, length: int, layers: int, repeats: int, cap_gb: float,
              structure: str) -> dict:
    if variant == "native" and structure == "unrolled":  # checkpointed: recomputed per layer
        needs = BASE_BYTES + NAIVE_MATRICES_PER_LAYER * layers * H * length * length * 4
        if needs > cap_gb * 1e9:
            return {"oom": f"OOM (needs ≈{needs / 1e9:.0f} GB)"}
    cmd = [sys.executable, __file__, "--child", variant, "--lengths", str(length),
           "--layers", str(layers), "--repeats", str(repeats), "--cap-gb", str(cap_gb),
           "--structure", structure]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"oom": "OOM under the cap" if "RESOURCE_EXHAUSTED" in last or "MemoryError" in last
                else f"failed: {last[:60]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap-gb", type=float, default=20.0)
    parser.add_argument("--structure", choices=STRUCTURES, default="unrolled",
                        help="the layers unrolled, each under jax.checkpoint, a lax.scan "
                             "over them (its backward loop reads the saved probabilities), or "
                             "a lax.scan over checkpointed layers")
    parser.add_argument("--child", choices=("native", "flash"))
    args = parser.parse_args()
    cap = int(args.cap_gb * 2**30)
    if args.child:
        print(json.dumps(child(args.child, args.lengths[0], args.layers, args.repeats, cap,
                               args.structure)))
        return
    print(f"train step (value_and_grad inside), causal decoder B=1 H={H} D=64 f32, "
          f"{args.layers} layers ({args.structure}); one process per run, RLIMIT_AS "
          f"{args.cap_gb:g} GiB")
    rows = [["L", "variant", "sites rewritten", "compile s", "step s", "peak RSS GB",
             "time ratio", "peak ratio"]]
    for length in args.lengths:
        native, fast = (run_child(v, length, args.layers, args.repeats, args.cap_gb,
                                  args.structure) for v in ("native", "flash"))
        for name, r in (("jax.jit", native), ("flash_jit", fast)):
            if "oom" in r:
                rows.append([str(length), name, "", "", r["oom"], "", "", ""])
                continue
            ratios = ["", ""] if "oom" in native else [
                f"{r['step_s'] / native['step_s']:.2f}", f"{r['peak_gb'] / native['peak_gb']:.3f}"]
            done = f"{r['rewritten']}/{r['sites']}" if name == "flash_jit" else ""
            rows.append([str(length), name, done, f"{r['compile_s']:.1f}", f"{r['step_s']:.2f}",
                         f"{r['peak_gb']:.2f}", *ratios])
    print(table(rows))


if __name__ == "__main__":
    main()
