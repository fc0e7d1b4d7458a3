"""Soundness fuzz: generated attention programs through flash_jit, counted per feature.

    JAX_PLATFORMS=cpu python benchmarks/soundness_fuzz.py --examples 10000 --jobs 2

Each program (grammar and check in tests/soundness_programs.py) comes out "rewritten" (its
outputs and gradients equal jax.jit's within the dtype's tolerance), "native" (every site
kept native with a reason, or no site: look-alikes) or "wrong". Prints one row per feature
(dtype, layout, mask kind, fill, bias shape, ...) and the wrong programs in full; exits 1 if
any program is wrong.
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


def _work(job: tuple[int, int, bool]) -> list[tuple[list[str], str, str, str]]:
    seed, count, fast = job
    warnings.simplefilter("ignore")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    import soundness_programs

    rows = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(soundness_programs.programs())
    def run(program):
        try:
            outcome, detail = soundness_programs.check(
                program, compiler_options=soundness_programs.FAST_COMPILE if fast else None)
        except Exception as e:  # noqa: BLE001 - a crash is a finding, reported as wrong
            outcome, detail = "wrong", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
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
    args = parser.parse_args()

    tasks, left, seed = [], args.examples, args.seed
    while left > 0:
        tasks.append((seed, min(args.chunk, left), args.fast_compile))
        left -= args.chunk
        seed += 1
    start = time.perf_counter()
    rows = []
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for part in pool.imap_unordered(_work, tasks):
            rows.extend(part)
            wrong_so_far = sum(r[1] == "wrong" for r in rows)
            print(f"  {len(rows)}/{args.examples} programs, {wrong_so_far} wrong, "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            for _, outcome, detail, program in part:
                if outcome == "wrong":
                    print(f"  WRONG: {detail}\n    {program}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start

    per_feature: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = collections.Counter()
    for features, outcome, _, _ in rows:
        total[outcome] += 1
        for f in dict.fromkeys(features):
            per_feature[f][outcome] += 1
    width = max(len(f) for f in per_feature) if per_feature else 10
    print(f"{len(rows)} programs in {seconds:.0f} s ({args.jobs} job(s), seeds "
          f"{args.seed}..{seed - 1}{', optimization level 0' if args.fast_compile else ''})\n")
    print(f"{'feature':<{width}}  {'wrong':>6}  {'native':>7}  {'rewritten':>9}")
    print(f"{'-' * width}  {'-' * 6}  {'-' * 7}  {'-' * 9}")
    for f in sorted(per_feature):
        c = per_feature[f]
        print(f"{f:<{width}}  {c['wrong']:>6}  {c['native']:>7}  {c['rewritten']:>9}")
    print(f"{'all':<{width}}  {total['wrong']:>6}  {total['native']:>7}  {total['rewritten']:>9}")
    wrong = [r for r in rows if r[1] == "wrong"]
    for _, _, detail, program in wrong:
        print(f"\nWRONG: {detail}\n  {program}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
