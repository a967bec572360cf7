"""A benchmark's ``--out DIR`` table holds the figures it prints (see [Note: table artifacts])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.bench.artifacts.table import load_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_optimizer_kernel_writes_the_table_it_prints(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "optimizer_kernel.py"),
                           "--params-m", "0.01", "--tensors", "4", "--steps", "1", "--repeats", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    table = load_table(tmp_path / "table.json")
    assert [row[0] for row in table.rows] == ["for-loop", "foreach", "fused"]
    for name, step_ms, speed in table.rows:
        assert f"{name:9s} {step_ms:>7} ms  ({speed.removesuffix('x')}x the loop)" in done.stdout
    assert "4 tensors" in table.caption and "median of 1 repeats" in table.caption
