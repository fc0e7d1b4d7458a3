"""`hlotool profile`: native and rewritten programs traced with jax.profiler on this host, per
site time read from the trace (the site scopes make it possible) beside the cost model, and
the trace directory kept for TensorBoard / XProf — never a user's directory."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from hlotool.capture import capture_function
from hlotool.cost import trace
from hlotool.errors import EXIT_BAD_INPUT, MANIFEST
from hlotool.api import rewrite_captured
from hlotool.report.console import Term
from hlotool.report.profile import FunctionProfile, SiteProfile, render_profile

MODEL = """\
import math, jax, jax.numpy as jnp

@jax.jit
def attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

@jax.jit
def mlp(x):
    return jnp.tanh(x @ x.T)

q = jnp.ones((1, 1024, 2, 64), jnp.float32)
attend(q, q, q)
mlp(jnp.ones((8, 8)))
"""


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(MODEL))
    return str(path)


def run(*args: str) -> subprocess.CompletedProcess:
    """`hlotool ARGS` in a process of its own: jax's profiler crashes in one that loaded
    libtpu, as the test session has once a TPU target was compiled in it."""
    env = {**os.environ, "COLUMNS": "200", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "hlotool", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_profile_reports_per_site_time_from_the_trace_and_keeps_it(model, tmp_path):
    where = str(tmp_path / "prof")
    result = run("profile", model, "--trace", where, "--repeats", "2", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["trace_dir"] == where and doc["repeats"] == 2
    attend, mlp = doc["functions"]
    assert mlp["note"] == "no attention site" and mlp["traces"] == {}
    (site,) = attend["sites"]
    assert (site["index"], site["kernel"], site["source"]) == (1, "chunked", f"{model}:5")
    # Both sides' time for the site comes out of the trace, and is part of the whole: the
    # time some op ran, itself within the call's wall time.
    assert 0 < site["native_seconds"] <= attend["native_ops"] <= attend["native_wall"]
    assert 0 < site["rewritten_seconds"] <= attend["rewritten_ops"] <= attend["rewritten_wall"]
    assert site["measured_ratio"] == pytest.approx(
        site["native_seconds"] / site["rewritten_seconds"])
    assert site["predicted_native_seconds"] > site["predicted_kernel_seconds"] > 0
    assert site["agrees"] is (0.5 <= site["measured_ratio"] / site["predicted_ratio"] <= 2)
    # Predicted with rates measured in this run (or, where that failed, the cpu row, saying
    # why in the function's note).
    assert doc["rates"].startswith("Predicted with this host's rates measured in this run: "
                                   "matmul ") or "calibrating this host failed" in attend["note"]
    # One log directory per side, one run in it per call: TensorBoard shows them all.
    for side in ("native", "rewritten"):
        assert attend["traces"][side] == os.path.join(where, "001_jit_attend", side)
        runs = glob.glob(os.path.join(where, "001_jit_attend", side, "plugins", "profile",
                                      "*"))
        assert sorted(r.rsplit("-", 1)[1] for r in runs) == ["call1", "call2"]
        assert all(glob.glob(os.path.join(r, "*.xplane.pb")) for r in runs)
    assert result.stderr.strip().splitlines()[-1] == f"traces: {where}"
    with open(os.path.join(where, MANIFEST)) as f:
        assert f.read().split() == ["001_jit_attend"]

    # hlotool's own directory takes another run; the table names the site and its kernel.
    again = run("profile", model + ":attend", "--trace", where, "--repeats", "1",
                "--no-calibrate")
    assert again.returncode == 0, again.stderr
    assert "Predicted with the cpu row of hlotool/hardware.py, which auto decides with: " \
        "matmul " in " ".join(again.stdout.split())
    (row,) = [ln for ln in again.stdout.splitlines() if ln.startswith("attend site1")]
    assert f"{model}:5" in row and "chunked" in row
    assert len(glob.glob(os.path.join(where, "001_jit_attend", "native", "plugins", "profile",
                                      "*"))) == 3


def test_profile_never_writes_into_a_users_directory(model, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    result = run("profile", model, "--trace", str(mine))
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.strip() == (
        f"hlotool: error: {mine} holds files hlotool did not write (notes.txt); name a new "
        "directory for --trace, or pass --force")
    assert sorted(os.listdir(mine)) == ["notes.txt"]


@pytest.mark.slow
def test_profile_without_trace_makes_a_new_directory_and_prints_it(model):
    result = run("profile", model + ":attend", "--repeats", "1", "--no-calibrate")
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]  # the table's last line: where it is
    assert last.startswith("traces: ")
    where = last.removeprefix("traces: ")
    try:
        assert os.path.basename(where).startswith("hlotool-profile-")
        assert os.path.isdir(os.path.join(where, "001_jit_attend", "rewritten"))
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.slow
def test_profile_that_traces_nothing_leaves_no_directory(model, tmp_path):
    """`mlp` has no attention site: nothing is traced, and the directory profile made for the
    traces is gone again (one given with --trace is the user's and stays)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "COLUMNS": "200", "JAX_PLATFORMS": "cpu", "TMPDIR": str(scratch)}
    result = subprocess.run([sys.executable, "-m", "hlotool", "profile", model + ":mlp",
                             "--repeats", "1"], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "nothing traced"
    assert not glob.glob(str(scratch / "hlotool-profile-*"))
    given = tmp_path / "prof"
    kept = run("profile", model + ":mlp", "--repeats", "1", "--trace", str(given))
    assert kept.returncode == 0, kept.stderr
    assert given.is_dir()
    assert kept.stdout.strip().splitlines()[-1] == f"nothing traced ({given} holds no trace)"


# ----------------------------------------------------------------------------------------
# Reading traces


def ev(op, start, seconds, thread="t"):
    return trace.OpEvent(op, "jit_f", thread, start, seconds)


def _site(index, native, rewritten, predicted_native, predicted_kernel):
    return SiteProfile("step", index, "m.py:5", (1, 1024, 2, 64), "chunked", native,
                       rewritten, predicted_native, predicted_kernel)


def test_predicted_and_measured_that_differ_by_more_than_twice_are_named():
    close = _site(1, 40e-3, 10e-3, 30e-3, 10e-3)  # measured ×4, predicted ×3
    # Predicted ×20, measured ×1.6: the kernel ran 12× slower than the model said.
    off = _site(2, 66e-3, 41e-3, 60e-3, 3e-3)
    text = render_profile([FunctionProfile("step", 1, 1.0, 0.5, 0.9, 0.4, (close, off))],
                          Term())
    assert (close.agrees, off.agrees) == (True, False)
    assert ("differ by more than 2× at 1 of 2 sites; furthest, step site2 (predicted ×20.00, "
            "measured ×1.61): the kernel took 41 ms against 3 ms predicted, native took "
            "66 ms against 60 ms predicted") in text
    assert "differ by more" not in render_profile(
        [FunctionProfile("step", 1, 1.0, 0.5, 0.9, 0.4, (close,))], Term())


def test_each_instant_of_a_call_counts_once():
    """Ops inside another on its thread count in the outer one; ops side by side on two
    threads share the instants they overlap, so the owners add up to the busy time."""
    events = [ev("while.1", 0.0, 10.0), ev("copy.2", 1.0, 2.0), ev("fusion.3", 10.0, 1.0),
              ev("fusion.4", 8.0, 4.0, thread="u")]
    assert [e.op for e in trace.outermost(events)] == ["while.1", "fusion.3", "fusion.4"]
    site = {"while.1": 1, "copy.2": 1, "fusion.4": 2}.get
    # 0-8 while alone, 8-10 while beside fusion.4, 10-11 fusion.3 (the rest) beside it,
    # 11-12 fusion.4 alone: 12 busy seconds over 2 calls.
    assert trace.busy_seconds(events, site, "jit_f", calls=2) == pytest.approx(
        {1: 4.5, 2: 1.25, None: 0.25})
    assert trace.busy_seconds(events, site, "jit_other") == {}


@pytest.mark.slow
def test_the_xspace_file_says_what_the_chrome_trace_says(model, tmp_path):
    where = tmp_path / "prof"
    assert run("profile", model + ":attend", "--trace", str(where), "--repeats", "1",
               "--no-calibrate"
               ).returncode == 0
    side = where / "001_jit_attend" / "rewritten"
    by_op = lambda op: op  # noqa: E731
    from_json = trace.busy_seconds(trace.read_events(str(side)), by_op, "jit_attend")
    assert from_json
    (run_dir,) = glob.glob(str(side / "plugins" / "profile" / "*"))
    for path in glob.glob(os.path.join(run_dir, "*.trace.json.gz")):
        os.remove(path)
    if not hasattr(jax.profiler, "ProfileData"):
        pytest.skip(f"jax {jax.__version__} has no jax.profiler.ProfileData")
    from_xspace = trace.busy_seconds(trace.read_events(str(side)), by_op, "jit_attend")
    assert from_xspace.keys() == from_json.keys()


def test_the_rewritten_programs_ops_carry_their_site(tmp_path):
    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q = jnp.ones((1, 1024, 2, 64), jnp.float32)
    (f,) = capture_function(jax.jit(attend), q, q, q)
    _, rewritten = rewrite_captured(f)
    by_site = trace.scope_sites(rewritten.optimized("cpu"))
    assert by_site and set(by_site.values()) == {1}
    assert not trace.scope_sites(f.optimized("cpu"))  # native ops carry no site scope


def test_tracing_refuses_a_process_that_loaded_libtpu(monkeypatch, tmp_path):
    monkeypatch.setattr(trace, "tpu_compiler_loaded", lambda: True)
    with pytest.raises(trace.ProfilerUnsafe, match=r"^jax.profiler crashes in a process that "
                       r"loaded libtpu .*`hlotool profile SCRIPT`$"):
        trace.traced_call(lambda: None, [], str(tmp_path), call=1)
    assert not os.listdir(tmp_path)  # refused before the profiler started


def test_no_trace_is_one_line(tmp_path):
    with pytest.raises(trace.TraceUnreadable, match=r"^no trace under .*plugins/profile"):
        trace.read_events(str(tmp_path))
    run_dir = tmp_path / "plugins" / "profile" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "host.trace.json.gz").write_bytes(b"not gzip")
    with pytest.raises(trace.TraceUnreadable, match="cannot read the trace in .*host.trace"):
        trace.read_events(str(tmp_path))


def test_a_function_kept_native_on_the_cpu_gives_the_cpu_s_verdict(tmp_path):
    """A 64×64 site stays native on the host: the note is the cpu's own verdict, not every
    platform's joined."""
    from hlotool.report.profile import profile_function

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jnp.ones((1, 64, 2, 32), jnp.float32)
    (captured,) = capture_function(jax.jit(attend), x, x, x)
    note = profile_function(captured, str(tmp_path)).note
    assert note.startswith("flash_jit keeps every site native on the cpu: keep native (short "
                           "sequence: Lq=64, Lk=64"), note
    assert "tpu" not in note and "cuda" not in note, note


def test_a_trace_that_cannot_be_read_leaves_wall_times_and_one_note(monkeypatch, tmp_path):
    """Every call's wall time is kept where jax's trace files cannot be read back; the site
    times are then unknown (not 0), and the reason is said once, not once per call."""
    from hlotool.report.profile import profile_function

    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    walls = iter([0.04, 0.01, 0.05, 0.02, 0.03, 0.01])  # native, rewritten, in turn

    def unreadable(where):
        raise trace.TraceUnreadable(f"cannot read the trace in {where}: no reader")

    monkeypatch.setattr(trace, "traced_call", lambda *a: (next(walls), "RUN"))
    monkeypatch.setattr(trace, "read_events", unreadable)
    x = jnp.ones((1, 1024, 2, 64), jnp.float32)
    (captured,) = capture_function(jax.jit(attend), x, x, x)
    prof = profile_function(captured, str(tmp_path), repeats=3)
    assert (prof.native_wall, prof.rewritten_wall) == (0.04, 0.01)  # the medians
    assert prof.native_ops is None and prof.rewritten_ops is None
    (site,) = prof.sites
    assert (site.native_seconds, site.rewritten_seconds, site.kernel) == (None, None, "chunked")
    assert prof.note.count("cannot read the trace") == 2, prof.note
    assert "native: cannot read the trace in RUN: no reader" in prof.note


def test_sites_that_share_the_calls_temporaries_are_said_to():
    """Two layers of one forward call at L = 1024: XLA:CPU allocates one temporary buffer
    for both, less than each allocates alone together, and the profile says why a later
    site is predicted without paging; one site alone gets no such note."""
    from hlotool.cost.xla import host_temporaries
    from hlotool.report.profile import _shared_temporaries
    from hlotool.units import format_bytes

    def layer(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        s = jnp.where(jnp.tril(jnp.ones((1024, 1024), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    x = jnp.ones((2, 1024, 4, 16))
    [f] = capture_function(jax.jit(lambda q, k, v: layer(jnp.tanh(layer(q, k, v)), k, v)),
                           x, x, x)
    report, _ = rewrite_captured(f, "chunked")
    sites = [s.site for s in report.sites]
    assert len(sites) == 2
    temp = f.compiled("cpu").memory_analysis().temp_size_in_bytes
    alone = sum(host_temporaries(site) for site in sites)
    assert temp < alone
    note = _shared_temporaries(f, sites, False)
    assert note.startswith(f"XLA:CPU allocates {format_bytes(temp)} of temporaries for the "
                           f"whole call, less than its 2 sites' {format_bytes(alone)}"), note
    assert _shared_temporaries(f, sites[:1], False) == ""
