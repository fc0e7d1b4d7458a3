"""benchmarks/gpu_bench.py off a GPU: the one-line refusal without a CUDA device, and the dry
run (each CUDA kernel's CPU stand-in beside native, forward and forward+backward)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hlotool.kernels import registry

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    done = run("--lengths", "128")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "no CUDA device: jax.devices('gpu') is empty — run this on a GPU machine")
    assert done.stdout == ""


@pytest.mark.slow
def test_dry_run_times_native_and_every_cuda_kernel_and_compares_outputs():
    done = run("--dry-run", "--repeats", "1", "--target-length", "128")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("DRY RUN") and "Hq=4 Hkv=1 D=64 bfloat16 causal" in lines[1]
    rows = [line.split() for line in lines if line.split()[:1] == ["128"]]
    kernels = [n for n in registry.PRIORITY["cuda"]
               if n != "reference" and registry.registered(n).unavailable_reason is None]
    assert "cudnn" in kernels
    assert [(r[1], r[2]) for r in rows] == [
        (which, impl) for which in ("fwd", "fwd+bwd") for impl in ("native", *kernels)]
    for row in rows:
        assert row[-1] == "ref" if row[2] == "native" else float(row[-1]) <= 3e-2, row
    assert lines[-1].startswith("target (L=128, fwd+bwd): best ")
