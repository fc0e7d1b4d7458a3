"""Generated attention programs (tests/soundness_programs.py): every one either stays native
with a reason, or its rewrite keeps outputs and gradients within the dtype's tolerance.

CI runs a fixed sequence of 200 examples (compiled at XLA's optimization level 0, which halves
the compile time of the chunked kernel's loops); `benchmarks/soundness_fuzz.py --examples N`
runs many more at the default level and prints the table per feature.
"""

from __future__ import annotations

import collections

from hypothesis import HealthCheck, given, settings

import soundness_programs

OUTCOMES: collections.Counter = collections.Counter()


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_programs_are_rewritten_exactly_or_left_native(program):
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE)
    OUTCOMES[outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


def test_the_generated_programs_exercise_rewrites():
    """Guards the property test above against a grammar that stopped producing attention:
    the fixed sequence must rewrite a good share of its programs."""
    if not OUTCOMES:
        test_generated_programs_are_rewritten_exactly_or_left_native()
    assert OUTCOMES["rewritten"] >= 50, OUTCOMES
    assert OUTCOMES["native"] >= 20, OUTCOMES
