"""Soundness fuzz: generated attention programs through flash_jit, counted per feature.

    JAX_PLATFORMS=cpu python benchmarks/soundness_fuzz.py --examples 10000 --jobs 2
    JAX_PLATFORMS=cpu python benchmarks/soundness_fuzz.py --examples 500 --mode train

Each program (grammar and check in tests/soundness_programs.py) comes out "rewritten" (its
outputs and gradients equal jax.jit's within the dtype's tolerance), "native" (every site
kept native with a reason, or no site: look-alikes), "overflowed" (the naive program's own
output is not finite where the float64 one is: nothing to keep), "wrong", or "crashed" (an exception,
which flash_jit must never raise for a program jax.jit runs). Prints one row per feature
(dtype, layout, mask kind, fill, bias shape, ...) and the wrong and crashed programs in
full; exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


BAD = ("wrong", "crashed")

# How the program is rewritten: as it is, or as a train step (its gradient taken inside the
# rewritten function), under jax.checkpoint, or as the body of a scan over layers.
MODES = {"forward": {}, "train": {"train": True},
         "checkpoint": {"train": True, "checkpoint": True},
         "layers": {"train": True, "layers": True}, "ring": {"ring": True}}


def _work(job: tuple[int, int, bool, str]) -> list[tuple[list[str], str, str, str]]:
    seed, count, fast, mode = job
    warnings.simplefilter("ignore")
    if mode == "ring":  # before jax starts its CPU backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=3")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    import soundness_programs

    from hlotool.errors import first_line

    rows = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(soundness_programs.programs())
    def run(program):
        if mode == "ring":
            program = soundness_programs.on_a_ring(program)
        try:
            outcome, detail = soundness_programs.check(
                program, compiler_options=soundness_programs.FAST_COMPILE if fast else None,
                **MODES[mode])
        except Exception as e:  # noqa: BLE001 - a crash is a finding of its own
            outcome, detail = "crashed", f"{type(e).__name__}: {first_line(e)[:200]}"
        rows.append((program.features, outcome, detail, repr(program)))

    run()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="programs to generate")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--seed", type=int, default=0, help="first worker's seed")
    parser.add_argument("--chunk", type=int, default=100,
                        help="programs per worker task (each task has its own seed)")
    parser.add_argument("--fast-compile", action="store_true",
                        help="compile both sides at XLA's optimization level 0, as CI does "
                        "(about twice as fast)")
    parser.add_argument("--mode", choices=sorted(MODES), default="forward",
                        help="rewrite each program as it is (forward) or as a train step: "
                        "plain, under jax.checkpoint, or as a scan over layers; ring: at "
                        "L = 48 with kernel calls split over 3 host devices, the sequence as "
                        "ring attention")
    args = parser.parse_args()

    tasks, left, seed = [], args.examples, args.seed
    while left > 0:
        tasks.append((seed, min(args.chunk, left), args.fast_compile, args.mode))
        left -= args.chunk
        seed += 1
    start = time.perf_counter()
    rows = []
    interrupted = False
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        try:
            for part in pool.imap_unordered(_work, tasks):
                rows.extend(part)
                bad_so_far = sum(r[1] in BAD for r in rows)
                print(f"  {len(rows)}/{args.examples} programs, {bad_so_far} wrong or crashed, "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
                for _, outcome, detail, program in part:
                    if outcome in BAD:
                        print(f"  {outcome.upper()}: {detail}\n    {program}", file=sys.stderr,
                              flush=True)
        except KeyboardInterrupt:
            # A long run stopped by hand (kill -INT on this process) still reports the
            # programs it finished: the table is the run's result.
            interrupted = True
    seconds = time.perf_counter() - start

    per_feature: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = collections.Counter()
    for features, outcome, _, _ in rows:
        total[outcome] += 1
        for f in dict.fromkeys(features):
            per_feature[f][outcome] += 1
    width = max(len(f) for f in per_feature) if per_feature else 10
    print(f"{len(rows)} programs in {seconds:.0f} s ({args.jobs} job(s), seeds "
          f"{args.seed}..{seed - 1}, mode {args.mode}"
          f"{', optimization level 0' if args.fast_compile else ''}"
          f"{', interrupted' if interrupted else ''})\n")
    columns = ("wrong", "crashed", "native", "rewritten", "overflowed")
    print(f"{'feature':<{width}}  " + "  ".join(f"{c:>9}" for c in columns))
    print(f"{'-' * width}  " + "  ".join("-" * 9 for _ in columns))
    for f in sorted(per_feature):
        print(f"{f:<{width}}  " + "  ".join(f"{per_feature[f][c]:>9}" for c in columns))
    print(f"{'all':<{width}}  " + "  ".join(f"{total[c]:>9}" for c in columns))
    bad = [r for r in rows if r[1] in BAD]
    for _, outcome, detail, program in bad:
        print(f"\n{outcome.upper()}: {detail}\n  {program}")
    return 1 if bad or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
