"""examples/resume_training.py as a user runs it: rank 1 is lost at step 7, torchrun restarts the
workers once, and training resumes from the last checkpoint and finishes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dspark.checkpoint import read_checkpoint_info
from dspark.launcher import LaunchSpec, launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resume_training.py"


@pytest.mark.slow
def test_a_lost_worker_is_restarted_and_training_resumes(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    spec = LaunchSpec(target=str(EXAMPLE), nproc=2, max_restarts=1,
                      args=("--ckpt", str(ckpt), "--steps", "10", "--save-every", "4", "--crash-at", "6"))
    done = launch(spec, capture=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "rank 1: simulated crash at step 6 (attempt 0)" in log
    assert re.search(r"attempt 1: resumed from step 4 \(step-000004, written by 2 rank\(s\)", done.stdout), log
    assert "attempt 1: finished at step 10 of 10 on 2 rank(s)" in done.stdout, log
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000008", "step-000010"]  # keeps the last 2
    assert read_checkpoint_info(ckpt / "step-000010").step_count == 10
