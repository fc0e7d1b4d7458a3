"""benchmarks/cost_vs_measured.py's GPU path, exercised off a GPU: the one-line refusal when
jax has no CUDA device, and the dry run (the cuda children on the CPU, each kernel's stand-in)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cost_vs_measured.py"
NO_CUDA = "no CUDA device: jax.devices('gpu') is empty — run this on a GPU machine"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_cuda_without_gpu_is_one_line_and_status_2():
    done = run("--platform", "cuda", "--lengths", "128")
    assert done.returncode == 2
    assert done.stderr.strip() == NO_CUDA
    assert done.stdout == ""


@pytest.mark.slow
def test_dry_run_measures_the_cuda_kernel_through_its_stand_in():
    done = run("--dry-run", "--lengths", "128", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "DRY RUN: cudnn's stand-in" in lines[0]
    assert "bfloat16" in lines[0] and "target h200" in lines[0]
    row = next(line for line in lines if line.split()[:1] == ["128"])
    assert "skipped" not in row
    assert row.split()[-1] in ("yes", "NO")
    assert "%" in row  # the ratio error column
    assert lines[-1].startswith("ratio error (predicted vs measured): median ")
