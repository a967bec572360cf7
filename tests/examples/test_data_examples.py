"""The real-data examples run as a user runs them, on 2 ranks with small sizes: they learn, write
their curves, and resume from their checkpoint (the engine's, with the loader and the LR scheduler as
``extra=`` state) at another world size exactly where they stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.test_examples import EXAMPLES, _dspark_run
from tests.messages import assert_line_names

CHAR_GPT_SMALL = ("--layers", "1", "--heads", "2", "--width", "32", "--seq-len", "32",
                  "--max-chars", "40000", "--global-batch", "8", "--eval-windows", "16",
                  "--eval-every", "3", "--save-every", "3", "--sample-chars", "0",
                  "--steps", "6", "--warmup-steps", "2")  # steps 2-5 on the cosine: the scheduler resumes


def _final(out: str, pattern: str) -> re.Match[str]:
    match = re.search(pattern, out)
    assert match, out
    return match


def _python(tmp_path: Path, *args: str) -> str:
    """One process, no launcher: DSpark's single-process stand-in (world size 1)."""
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_char_gpt_resumes_at_another_world_size_where_it_stopped(tmp_path: Path) -> None:
    script = str(EXAMPLES / "char_gpt.py")
    pattern = r"(\d) rank\(s\), step 6, validation loss ([\d.]+), .* weights checksum ([-\d.]+)"
    whole = _python(tmp_path, script, "--out", str(tmp_path / "whole"), *CHAR_GPT_SMALL)
    uninterrupted = _final(whole, pattern)
    assert "validation loss" in whole.split("step 3:")[1]

    # stopped at step 3 of 6 on 2 ranks (the schedule still spans 6 steps), resumed on 1
    first = _dspark_run(tmp_path, script, "--out", str(tmp_path / "split"), "--stop-after", "3",
                        *CHAR_GPT_SMALL)
    assert "2 rank(s), step 3," in first and "stopped at step 3 of 6" in first
    assert (tmp_path / "split" / "char_gpt.png").stat().st_size > 10_000
    resumed_out = _python(tmp_path, script, "--out", str(tmp_path / "split"), *CHAR_GPT_SMALL)
    assert "resumed from step-000003" in resumed_out
    resumed = _final(resumed_out, pattern)
    assert uninterrupted.group(1) == resumed.group(1) == "1"
    # the same samples in the same order at the same learning rates; only the sums' rounding differs
    # between 1 and 2 ranks
    assert float(resumed.group(2)) == pytest.approx(float(uninterrupted.group(2)), rel=1e-5)
    assert float(resumed.group(3)) == pytest.approx(float(uninterrupted.group(3)), rel=1e-7)


@pytest.mark.slow
def test_digits_resnet_learns_on_two_ranks_and_resumes_mid_epoch_on_one(tmp_path: Path) -> None:
    script, small = str(EXAMPLES / "digits_resnet.py"), ("--epochs", "3", "--width", "8", "--global-batch", "64")
    first = _dspark_run(tmp_path, script, "--out", str(tmp_path / "run"), "--max-steps", "30", *small)
    assert "2 rank(s), epoch 1, step 30," in first  # 22 steps per epoch: stopped inside the second
    out = _python(tmp_path, script, "--out", str(tmp_path / "run"), *small)
    assert_line_names(out, "resumed", "step-000030", "epoch 1")
    # 66 = 3 epochs of 22: the loader went on from its 9th batch of epoch 1, not from a new epoch
    accuracy = float(_final(out, r"1 rank\(s\), epoch 3, step 66, test accuracy ([\d.]+)").group(1))
    assert accuracy > 0.5, out  # chance is 0.1
    assert (tmp_path / "run" / "digits_resnet.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-000044", "step-000066"]
