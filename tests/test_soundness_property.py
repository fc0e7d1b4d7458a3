"""Generated attention programs (tests/soundness_programs.py): every one either stays native
with a reason, or its rewrite keeps outputs and gradients within the dtype's tolerance.

CI runs a fixed sequence of 200 examples (compiled at XLA's optimization level 0, which halves
the compile time of the chunked kernel's loops); `benchmarks/soundness_fuzz.py --examples N`
runs many more at the default level and prints the table per feature. The generated runs are
marked slow: the README's test command leaves them to CI (`pytest -m slow`); the programs they
found, below, run everywhere.
"""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import HealthCheck, given, settings

import soundness_programs
from soundness_programs import Program, Step

OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_programs_are_rewritten_exactly_or_left_native(program):
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE)
    OUTCOMES[outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


TRAIN_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_train_steps_are_rewritten_exactly_or_left_native(program):
    """The same programs with their gradient taken inside the rewritten function: the
    rewrite replaces jax's backward of each site too (passes/backward.py)."""
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE, train=True)
    TRAIN_OUTCOMES[outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


@pytest.mark.slow
def test_the_generated_train_steps_exercise_rewrites():
    if not TRAIN_OUTCOMES:
        test_generated_train_steps_are_rewritten_exactly_or_left_native()
    assert TRAIN_OUTCOMES["rewritten"] >= 15, TRAIN_OUTCOMES


CHECKPOINT_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_checkpointed_train_steps_are_rewritten_exactly_or_left_native(program):
    """The train steps with the program under jax.checkpoint: its backward recomputes it in
    the checkpointed body, which the rewrite replaces by the kernel's forward and backward
    (passes/backward.py `find_recomputes`) only where it shows the body computes the same."""
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE, train=True, checkpoint=True)
    CHECKPOINT_OUTCOMES[outcome] += 1
    if detail == "recomputed":
        CHECKPOINT_OUTCOMES["recomputed"] += 1
    assert outcome != "wrong", f"{detail}: {program}"


@pytest.mark.slow
def test_the_generated_checkpointed_train_steps_exercise_recomputes():
    if not CHECKPOINT_OUTCOMES:
        test_generated_checkpointed_train_steps_are_rewritten_exactly_or_left_native()
    assert CHECKPOINT_OUTCOMES["recomputed"] >= 8, CHECKPOINT_OUTCOMES


LAYER_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_train_steps_of_scanned_layers_are_rewritten_exactly_or_left_native(program):
    """Train steps of the program as a scan over layers without jax.checkpoint: the forward
    loop saves the attention's intermediates for the backward loop, and the rewrite
    recomputes the site there instead (passes/residuals.py) before it matches its
    derivative."""
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE, train=True, layers=True)
    LAYER_OUTCOMES[detail if detail == "recomputed" else outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


@pytest.mark.slow
def test_the_generated_scanned_layers_exercise_recomputes():
    if not LAYER_OUTCOMES:
        test_generated_train_steps_of_scanned_layers_are_rewritten_exactly_or_left_native()
    assert LAYER_OUTCOMES["recomputed"] >= 25, LAYER_OUTCOMES  # 43 of 80 on jax 0.10.2


SHARDED_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_data_parallel_train_steps_are_rewritten_exactly_or_left_native(program):
    """The train steps inside a shard_map (a data-parallel step): the sites live in its body,
    where values vary over the mesh axis and jax casts and psums them; the rewrite traces
    the kernel and the reference derivative there (passes/tracing.py)."""
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE, train=True, sharded=True)
    SHARDED_OUTCOMES[outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


SHARDED_CHECKPOINT_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs())
def test_generated_checkpointed_data_parallel_train_steps_are_exact_or_native(program):
    """Checkpointed programs in a data-parallel step: the recompute is traced and matched in
    the shard_map body too."""
    outcome, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE, train=True,
        checkpoint=True, sharded=True)
    SHARDED_CHECKPOINT_OUTCOMES[detail if detail == "recomputed" else outcome] += 1
    assert outcome != "wrong", f"{detail}: {program}"


@pytest.mark.slow
def test_the_generated_checkpointed_data_parallel_train_steps_exercise_recomputes():
    if not SHARDED_CHECKPOINT_OUTCOMES:
        test_generated_checkpointed_data_parallel_train_steps_are_exact_or_native()
    # 3 of 20 on jax 0.10.2 with the grown grammar
    assert SHARDED_CHECKPOINT_OUTCOMES["recomputed"] >= 2, SHARDED_CHECKPOINT_OUTCOMES


@pytest.mark.slow
def test_the_generated_data_parallel_train_steps_exercise_rewrites():
    if not SHARDED_OUTCOMES:
        test_generated_data_parallel_train_steps_are_rewritten_exactly_or_left_native()
    assert SHARDED_OUTCOMES["rewritten"] >= 5, SHARDED_OUTCOMES  # 7 of 40 on jax 0.10.2


@pytest.mark.slow
def test_the_generated_programs_exercise_rewrites():
    """Guards the property test above against a grammar that stopped producing attention:
    the fixed sequence must rewrite a good share of its programs."""
    if not OUTCOMES:
        test_generated_programs_are_rewritten_exactly_or_left_native()
    # 48 of 200 on jax 0.10.2 with the grammar grown for issue 35 (its must-refuse classes
    # and its no-site constructs among them; 115 no site, most of them look-alikes).
    assert OUTCOMES["rewritten"] >= 40, OUTCOMES
    assert OUTCOMES["native"] >= 20, OUTCOMES


POSITIONS_OUTCOMES: collections.Counter = collections.Counter()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(soundness_programs.programs(masks=("positions_window",)))
def test_generated_windows_from_positions_are_rewritten_exactly_or_left_native(program):
    """Programs whose every mask step is the `gemma` library's window on positions of a
    left-, right- or un-padded batch (#42): its band is read under a per-call check, so none
    may be wrong, train steps included."""
    for train in (False, True):
        outcome, detail = soundness_programs.check(
            program, compiler_options=soundness_programs.FAST_COMPILE, train=train)
        POSITIONS_OUTCOMES[outcome] += 1
        if outcome == "rewritten" and "checked per call against" in str(
                soundness_programs.last_report()):
            POSITIONS_OUTCOMES["read from positions"] += 1
        assert outcome != "wrong", f"{detail}: {program}"


@pytest.mark.slow
def test_the_generated_windows_from_positions_exercise_rewrites():
    if not POSITIONS_OUTCOMES:
        test_generated_windows_from_positions_are_rewritten_exactly_or_left_native()
    assert POSITIONS_OUTCOMES["read from positions"] >= 6, POSITIONS_OUTCOMES


@pytest.mark.slow
def test_generated_programs_split_over_a_ring_are_rewritten_exactly_or_left_native():
    """The programs at L = 48 with kernel calls split over 3 host devices (the sequence as
    ring attention where the ring takes the call): none wrong or crashed, some rewritten. A
    subprocess: the host's device count is fixed when jax starts."""
    import os
    import subprocess
    import sys

    fuzz = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "soundness_fuzz.py")
    done = subprocess.run([sys.executable, fuzz, "--examples", "60", "--mode", "ring",
                           "--fast-compile", "--seed", "48"], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    totals = next(line for line in done.stdout.splitlines() if line.startswith("all "))
    wrong, crashed, native, rewritten, overflowed = map(int, totals.split()[1:])
    assert wrong == crashed == 0 and rewritten >= 10, totals


# Programs the fuzz benchmark once judged wrong, each with what was wrong.
FOUND = [
    pytest.param(Program(
        dtype="bfloat16", layout="merged", b=2, hq=1, hkv=1, lq=16, lk=40, d=8,
        steps=(Step(kind="scale", value=0.05),
               Step(kind="causal_bias", value=-float("inf"))),
        manual_softmax=True, head_mask="data", seed=2),
        id="bf16 head-mask gradient from an output rounded to bf16 (3.4% off)"),
    pytest.param(Program(
        dtype="bfloat16", layout="BHLD", b=2, hq=4, hkv=2, lq=16, lk=7, d=16,
        steps=(Step(kind="bias", shape="b11k"), Step(kind="scale", value=1.25e-07),
               Step(kind="bias", shape="1hqk")),
        manual_softmax=True, head_mask="data", seed=16),
        id="bf16 head-mask gradient, GQA, two biases (9.2% off)"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=1, hq=4, hkv=1, lq=1, lk=40, d=8,
        steps=(Step(kind="bias", shape="bhqk"), Step(kind="scale", op="div", value=1e-06),
               Step(kind="causal_bias", value=-1e9)),
        manual_softmax=True, seed=0),
        id="f32 bias gradient behind a x1e6 scale (oracle without the scale)"),
    pytest.param(Program(
        dtype="float16", layout="merged", b=1, hq=2, hkv=2, lq=33, lk=16, d=16,
        steps=(Step(kind="scale", op="div", value=1.0),
               Step(kind="scale", op="div", value=0.0001),
               Step(kind="mask", mask="window", fill="-1e9"),
               Step(kind="scale", op="div", value=5e-05)),
        manual_softmax=True, seed=0),
        id="f16 dk beyond float16's range is inf (oracle compared it finite)"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=1, hq=2, hkv=2, lq=16, lk=40, d=8,
        steps=(Step(kind="mask", mask="key_padding", constant=True),), seed=1),
        id="constant [1, 1, 1, Lk] key padding read as a band of one query row (dv 70% off)"),
]


@pytest.mark.parametrize("program", FOUND)
def test_programs_the_fuzz_found_are_rewritten_and_equal(program):
    assert soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE) == ("rewritten", "")


# Programs the grown grammar (issue 35) found wrong, and what they must come out as now.
FOUND_GROWN = [
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=1, hq=1, hkv=1, lq=33, lk=40, d=8,
        steps=(Step(kind="select_bias", mask="key_padding", fill="-inf"),
               Step(kind="mask", mask="tril_k", fill="finfo.min", offset=1)),
        nan_key=True), "rewritten",
        id="a NaN key the queries' padding rows see: 0·NaN spread over every dv (inf)"),
    pytest.param(Program(
        dtype="float32", layout="BLDH", b=2, hq=2, hkv=2, lq=16, lk=129, d=8,
        steps=(Step(kind="mask", mask="segments_and_causal", fill="-1e9"),
               Step(kind="mask", mask="segments_and_causal", fill="-1e9", mirrored=True)),
        seed=53624), "native",
        id="two pairs of segment ids: the second was dropped (dv 48% off)"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=2, hq=4, hkv=1, lq=16, lk=2, d=16,
        steps=(Step(kind="select_bias", mask="lengths", fill="finfo.min", offset=1),),
        post_mask="repeat", seed=341, nan_key=True), "rewritten",
        id="a NaN key's row that the post-softmax mask empties: 0 in the program, NaN out"),
    pytest.param(Program(
        dtype="float16", layout="BLHD", b=1, hq=1, hkv=1, lq=1, lk=16, d=8,
        steps=(Step(kind="scale", value=1e-06), Step(kind="scale", value=0.0001)),
        post_mask="same"), "rewritten",
        id="a NaN row's keys the post-softmax mask drops: 0 in the program's dv, NaN"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=2, hq=4, hkv=4, lq=129, lk=16, d=16,
        steps=(Step(kind="mask", mask="causal_and_padding", fill="-1e9", offset=1),),
        post_mask="mirrored", sinks=True, seed=4281, operand_op=("q", "reduce_precision")),
        "rewritten", id="fp8-rounded q: its gradient is rounded too, one fp8 step is its "
        "tolerance (6e-5 > 1e-5)"),
    pytest.param(Program(
        dtype="float16", layout="merged", b=2, hq=1, hkv=1, lq=33, lk=129, d=16,
        steps=(Step(kind="scale", op="div", value=0.0001), Step(kind="softcap", value=1.0),
               Step(kind="scale", value=0.0001),
               Step(kind="bias", shape="from_q", extreme="-inf")),
        manual_softmax=True, lookalike="scale_after_softmax", post_mask="mirrored", seed=256,
        operand_op=("k", "roundtrip"), kernel="chunked"), "rewritten",
        id="float16, a bf16-rounded k, one logit of a row left below the soft-cap's saturation: "
        "the reference rounded k / size exactly, XLA's quotient is a step off (dq 0.075 apart)"),
    pytest.param(Program(
        dtype="float32", layout="BHLD", b=1, hq=2, hkv=1, lq=2, lk=40, d=8,
        steps=(Step(kind="select_bias", mask="lengths", fill="-1e4", empty_row=True, offset=1),),
        post_mask="repeat", dropout=True, seed=1336, nan_key=True), "rewritten",
        id="a NaN key's rows, a where-mask beside dropout after the softmax: the keys it drops "
        "have dv 0 in the program, 0·NaN was NaN"),
    pytest.param(Program(
        dtype="bfloat16", layout="BHLD", b=1, hq=2, hkv=2, lq=7, lk=1000, d=16,
        steps=(Step(kind="softcap", value=5.0), Step(kind="bias", shape="from_k"),
               Step(kind="causal_bias", value=-math.inf)),
        head_mask="data", seed=9423, operand_op=("v", "roundtrip"), prescale="both",
        kernel_blocks=True), "rewritten",
        id="v through fp8 in a bfloat16 program: jax rounds dv to fp8 too, one fp8 step "
        "(4.5 or 5.0) is its tolerance"),
    pytest.param(Program(
        dtype="float32", layout="merged", b=2, hq=2, hkv=1, lq=1, lk=2, d=16,
        steps=(Step(kind="bias", shape="from_q", extreme="finfo.min"),
               Step(kind="bias", shape="from_q", extreme="finfo.min"),
               Step(kind="causal_bias", value=-10000.0),
               Step(kind="scale", op="div", value=0.0005)),
        manual_softmax=True, head_mask="data", post_mask="repeat", sinks=True, seed=65535,
        kernel="chunked"), "native",
        id="a head mask with the heads folded into the batch: mapped h-major where the "
        "program folds b-major (out 30% off); refused"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=1, hq=1, hkv=1, lq=129, lk=1, d=8,
        steps=(Step(kind="bias", shape="from_k"),
               Step(kind="bias", shape="b11k", extreme="-inf"),
               Step(kind="scale", value=1e-06), Step(kind="bias", shape="1hqk")),
        kernel="chunked"), "rewritten",
        id="a bias computed from k has no gradient of its own: the check gave its "
        "tolerance to the next bias (7e-7 against 5.5e-6, not 5.5)"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=2, hq=2, hkv=2, lq=33, lk=33, d=16,
        steps=(Step(kind="mask", mask="transposed_and_causal", fill="-1e9"),),
        kernel="chunked"), "rewritten",
        id="`x > 0` of a transposed cast, ANDed with tril: a square mask's factor read with "
        "the compare's axes, queries and keys swapped (out 1.14 off)"),
    pytest.param(Program(
        dtype="float32", layout="BHLD", b=2, hq=2, hkv=1, lq=20, lk=37, d=8,
        steps=(Step(kind="mask", mask="nnx_combined", fill="finfo.min"),),
        kernel="chunked"), "rewritten",
        id="flax nnx's causal & key padding, its AND cast to float32 and back"),
    pytest.param(Program(
        dtype="float32", layout="BLHD", b=2, hq=4, hkv=2, lq=16, lk=130, d=8,
        steps=(Step(kind="mask", mask="ones_and_padding", fill="finfo.min", empty_row=True),),
        kernel="chunked"), "rewritten",
        id="jax.nn.dot_product_attention's key padding ANDed into ones, a row with no key"),
    pytest.param(Program(
        dtype="float32", layout="BHLD", b=2, hq=2, hkv=1, lq=33, lk=16, d=8,
        steps=(Step(kind="bias", shape="b11k", extreme="-inf"),
               Step(kind="causal_bias", value=-10000.0)),
        manual_softmax=True, head_mask="ones", seed=2460, kernel="chunked"), "rewritten",
        id="a row whose visible keys a -inf bias hides, left to logits s - 1e4: float32 "
        "holds them to 4.9e-4, the kernel adds the biases summed (out 6.1e-4 off exact, "
        "the program 2.9e-4; the check allows 2 roundings of a logit, 2e-3)"),
]


@pytest.mark.parametrize("program, outcome", FOUND_GROWN)
@pytest.mark.sweep(keep=4)
def test_programs_the_grown_grammar_found(program, outcome):
    got, detail = soundness_programs.check(
        program, compiler_options=soundness_programs.FAST_COMPILE)
    assert got == outcome, detail
