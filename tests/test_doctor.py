"""`hlotool doctor`: one screen on whether this install works, exit 0 when it does."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import pytest
from click.testing import CliRunner

from hlotool import doctor, jaxcompat, kernels, targets

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX = f"jax {jax.__version__}"


@pytest.mark.parametrize(("version", "spec", "expected"), [
    ("0.12.0.1", ">=0.9.0,<0.13", True),
    ("0.9.0", ">=0.9.0,<0.13", True),
    ("0.13.0", ">=0.9.0,<0.13", False),
    ("0.8.3", "<0.13,>=0.9.0", False),
    ("0.0.52", ">=0.0.52,<0.0.53", True),
    ("0.0.42.1", "==0.0.42.*", True),
    ("0.0.43", "==0.0.42.*", False),
    ("0.10.2", "==0.10.2", True),
    ("0.10.2", "!=0.10.2", False),
    ("0.11.0rc1", ">0.10", True),
])
def test_satisfies(version, spec, expected):
    assert doctor.satisfies(version, spec) is expected


def _clauses(spec: str) -> set[str]:
    return {c.strip() for c in spec.split(",")}


def test_tested_ranges_are_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = doctor.tested_ranges()
    declared = {re.match(r"[\w.\-]+", r).group(): r for r in
                [*project["dependencies"], *project["optional-dependencies"]["tpu"]]}
    for name in ("jax", "jaxlib", "libtpu"):
        assert _clauses(ranges[name]) == _clauses(declared[name][len(name):])
    assert ranges["python"] == "3.11, 3.12, 3.13"


def _rows(output: str) -> dict[str, tuple[str, str]]:
    """check → (status, detail) from doctor's table."""
    rows = {}
    for line in output.splitlines():
        m = re.match(r"(\S+(?: \S+)*?)\s{2,}(ok|warn|off|FAIL)\s{2,}(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_doctor_on_this_install_is_one_screen_and_exits_0():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "COLUMNS")}
    done = subprocess.run([sys.executable, "-m", "hlotool", "doctor"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    whats = list(rows)
    assert whats[:2] == ["python " + ".".join(map(str, sys.version_info[:3])),
                         f"jax {jax.__version__}"]
    assert whats[2].startswith("jaxlib ") and whats[3].startswith("libtpu ")
    assert whats[4:] == [*(f"hook {name}" for name in jaxcompat.HOOKS),
                         *(f"kernel {name}" for name in kernels.names()),
                         "target tpu-v5e", "target tpu-v5p, tpu-v5p-8",
                         "target tpu-v6e, tpu-v6e-16", "graphviz dot"]
    assert rows[f"jax {jax.__version__}"][0] == "ok"
    assert rows["hook jit lowering"] == (
        "ok", "jax._src.interpreters.pxla.lower_sharding_computation (private)")
    assert rows["target tpu-v5e"][1].startswith("compiled deviceless (v5e:1x1) in ")
    assert rows["kernel chunked"] == ("ok", "cpu/tpu/cuda; draws dropout masks per tile")
    assert done.stdout.splitlines()[-1].startswith("all features of this install work")
    assert "features: inspect/dump/cost ok · flash_jit ok · TPU targets ok" in done.stdout
    assert len(done.stdout.splitlines()) <= 36  # a 40-row terminal, with the prompt
    assert "TPU_WORKER_HOSTNAMES" not in done.stderr  # libtpu kept quiet


def test_doctor_fits_the_terminal_wrapping_details():
    from hlotool.report.console import Term

    checks = [doctor.Check("hook jaxpr types", doctor.OK,
                           "jax.extend.core.{ClosedJaxpr, Jaxpr, JaxprEqn, Literal, jaxpr_as_fun}"),
              doctor.Check("kernel tokamax_gpu", doctor.OFF, "untested: " + "word " * 30)]
    text = doctor.render(checks, Term(width=70))
    assert max(map(len, text.splitlines())) <= 70
    table = text.splitlines()[2:]
    # The detail column wraps under itself; the other columns stay one line.
    assert table[2].startswith("hook jaxpr types") and table[3].endswith("jaxpr_as_fun}")
    assert table[4].startswith("kernel tokamax_gpu  off ")
    assert table[3].startswith(" " * 28) and table[5].startswith(" " * 28 + "word")


@pytest.fixture
def fast_doctor(monkeypatch):
    """Doctor without its deviceless compiles (the test above runs them)."""
    monkeypatch.setattr(doctor, "target_checks", lambda: [
        doctor.Check("target tpu-v5e", doctor.OK, "not compiled in this test")])


@pytest.mark.parametrize(("name", "status", "exit_code", "consequence"), [
    ("dead-code elimination", "FAIL", 1, "flash_jit, hlotool rewrite and diff unavailable"),
    ("platform names", "warn", 0, "an attached GPU is priced as the default chip (h100)"),
    ("softmax switch", "warn", 0,
     "a site whose softmax is jax.nn.softmax's custom_jvp call stays native"),
    ("cuDNN version", "warn", 0, "the cudnn kernel is off: CUDA sites run in the next one"),
])
def test_missing_hook_is_reported_with_its_reason(monkeypatch, fake_module, fast_doctor, name,
                                                  status, exit_code, consequence):
    """The hook as this jax would have it without its function (found in an empty module)."""
    real = jaxcompat.HOOKS[name]
    fake_module("fake_jax_module")
    attr = real.api.rpartition(".")[2]
    hook, _ = jaxcompat.probe(name, real.used_by, ("fake_jax_module",), (attr,),
                              without=real.without)
    monkeypatch.setitem(jaxcompat.HOOKS, name, hook)
    result = CliRunner().invoke(doctor.doctor)
    assert result.exit_code == exit_code
    assert _rows(result.output)[f"hook {name}"] == (
        status, f"{JAX}: fake_jax_module has no {attr}; {consequence}")
    flash = "FAIL" if status == "FAIL" else "ok"
    assert f"features: inspect/dump/cost ok · flash_jit {flash}" in result.output
    assert result.output.splitlines()[-1].startswith(
        f"1 problem: hook {name}" if status == "FAIL" else "all features of this install work")
    if name == "cuDNN version":  # the kernel needing it is off, with the hook's reason
        assert _rows(result.output)["kernel cudnn"] == (
            "off", f"{JAX}: fake_jax_module has no check_cudnn_version")


def test_without_libtpu_tpu_targets_are_off_not_failing(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda module: module != "libtpu")
    monkeypatch.setattr(doctor, "_version", lambda d: None if d == "libtpu" else "0.12.0")
    checks = doctor.version_checks() + doctor.target_checks()
    assert [(c.what, c.status) for c in checks if "tpu" in c.what] == [
        ("libtpu -", "off"), ("target tpu-v5e", "off"), ("target tpu-v5p, tpu-v5p-8", "off"),
        ("target tpu-v6e, tpu-v6e-16", "off")]
    assert dict(doctor.features(checks))["TPU targets"] == "off"
    assert not any(c.status == doctor.FAIL for c in checks)


def test_untested_versions_warn(monkeypatch):
    monkeypatch.setattr(doctor, "_version", lambda d: {"jax": "0.13.0"}.get(d, "0.0.52"))
    (jax_check,) = [c for c in doctor.version_checks() if c.what.startswith("jax ")]
    assert (jax_check.status, jax_check.detail[:17]) == ("warn", "untested: tested ")


def test_missing_dot_is_optional(monkeypatch, fast_doctor):
    # hlotool lays its pictures out itself: without `dot` only PNG pieces are off.
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    result = CliRunner().invoke(doctor.doctor)
    assert result.exit_code == 0, result.output
    assert _rows(result.output)["graphviz dot"] == (
        "off", "optional, not found: only `diff --format png` needs it (apt-get install "
        "graphviz)")
    assert "diff png off" in result.output
    assert result.output.splitlines()[-1] == (
        "all features of this install work (off: optional, not installed)")


def test_missing_hook_errors_point_at_doctor():
    hook = jaxcompat.Hook("dead-code elimination", "x.dce_jaxpr", "flash_jit", reason="gone")
    assert str(jaxcompat.MissingHook(hook)).endswith("(see `hlotool doctor`)")
