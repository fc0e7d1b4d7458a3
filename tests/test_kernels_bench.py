"""benchmarks/kernels_bench.py's rate tables at one small length: the rows are there, the
tiles the --floors loops run are the chunked kernel's own, and every ratio is a number."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_bench.py"


def run(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def row(lines: list[str], length: int) -> list[str]:
    (found,) = [line.split() for line in lines if line.split()[:1] == [str(length)]]
    return found


@pytest.mark.slow
def test_floors_runs_the_kernels_causal_tiles_beside_its_forward():
    lines = run("--floors", "--mask", "causal", "--lengths", "1024", "--repeats", "1")
    assert "block-matmul rate" in lines[0] and "mask causal" in lines[0]
    assert lines[1].split() == ["L", "tiles", "block", "mm", "matmuls", "+softmax", "+online",
                                "kernel", "fwd"]
    cells = row(lines, 1024)
    # 512-row query blocks over 256-key blocks, causal: block 0 sees key blocks 0-1, block 1
    # sees 0-3 (the blocks right of the diagonal are skipped).
    assert cells[1:4] == ["6", "of", "512x256"]
    assert float(cells[4]) > 0
    assert all(0 < float(c) < 10 for c in cells[5:])


@pytest.mark.slow
def test_rates_pairs_forward_and_backward_with_the_block_matmul():
    lines = run("--rates", "--mask", "causal", "--lengths", "1024", "--repeats", "1")
    assert lines[1].split() == ["L", "block", "mm", "fwd", "fwd/mm", "bwd", "bwd/mm"]
    cells = row(lines, 1024)
    assert len(cells) == 6
    assert all(float(c) > 0 for c in cells[1:])
