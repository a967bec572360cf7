"""examples/resume_training.py as a user runs it, through ``dspark run`` on 2 ranks: a worker lost
to SIGKILL (no exception, no cleanup at all) is restarted and training resumes from the last
checkpoint; a SIGTERM to ``dspark run`` (a preemption) makes every rank save at the same step and the
job exit 0, and a relaunch continues from there. Each ends with the parameters of an uninterrupted
run, exactly."""

from __future__ import annotations

import functools
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import dspark
from dspark.checkpoint import read_checkpoint_info
from dspark.launch.launcher import LaunchSpec, launch
from dspark.launch.process_tree import descendants, signal_processes
from tests.messages import assert_line_names

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "resume_training.py"
STEPS = 24


def _final_parameters(ckpt: Path) -> dict[str, torch.Tensor]:
    """The parameters in ``ckpt``, loaded into the example's model on one process."""
    dspark.shutdown()
    dspark.init()
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))  # the example's model
    engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))
    try:
        assert engine.load(ckpt).step_count == STEPS
        return engine.full_state_dict()
    finally:
        engine.close()
        dspark.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    ckpt = tmp_path_factory.mktemp("uninterrupted")
    done = launch(LaunchSpec(target=str(EXAMPLE), nproc=2,
                             args=("--ckpt", str(ckpt), "--steps", str(STEPS), "--save-every", "8")),
                  capture=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return _final_parameters(ckpt / f"step-{STEPS:06d}")


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (name, float((got[name] - want[name]).abs().max()))


@pytest.mark.slow
def test_a_sigkilled_worker_recovers_on_the_first_restart(tmp_path: Path, uninterrupted) -> None:
    ckpt = tmp_path / "ckpt"
    spec = LaunchSpec(target=str(EXAMPLE), nproc=2, max_restarts=2,
                      args=("--ckpt", str(ckpt), "--steps", str(STEPS), "--save-every", "4",
                            "--kill-at", "13"))
    done = launch(spec, capture=True)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert "exitcode: -9" in log, log[-4000:]  # torchrun saw the worker die of SIGKILL
    assert_line_names(done.stdout, "attempt 1", "resumed", "step 12", "step-000012")
    assert_line_names(done.stdout, "attempt 1", "finished", f"step {STEPS} of {STEPS}")
    assert "attempt 2" not in done.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000020", "step-000024"]  # keeps the last 2
    _assert_same(_final_parameters(ckpt / f"step-{STEPS:06d}"), uninterrupted)


def _lines(stream) -> queue.Queue[str]:  # type: ignore[no-untyped-def]
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()
    return lines


def _stopped_run(ckpt: Path, after: str, deliver: Callable[[subprocess.Popen[str]], None],
                 *args: str) -> tuple[str, float]:
    """Run the example on 2 ranks through ``dspark run``, ``deliver`` the stop once a line starting
    with ``after`` is out, and return its output and the seconds from the stop to its exit, which
    must be 0."""
    command = [sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", str(EXAMPLE),
               "--ckpt", str(ckpt), "--steps", str(STEPS), "--log-every", "1", *args]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, seen = _lines(job.stdout), []
    try:
        while not any(line.startswith(after) for line in seen):
            seen.append(lines.get(timeout=120))
        started = time.monotonic()
        deliver(job)
        job.wait(timeout=60)
        elapsed_s = time.monotonic() - started
    finally:
        if job.poll() is None:
            job.kill()
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    stdout = "".join(seen)
    assert job.returncode == 0, stdout + job.stderr.read()[-4000:]  # type: ignore[union-attr]
    return stdout, elapsed_s


@pytest.mark.slow
@pytest.mark.parametrize("deliveries", ["once", "twice", "every process", "ctrl-c", "hang-up"])
def test_sigterm_saves_at_the_step_it_stopped_and_a_relaunch_ends_where_an_uninterrupted_run_does(
        tmp_path: Path, uninterrupted, deliveries: str) -> None:
    """"twice": the same SIGTERM twice in a row, as ``timeout`` sends it (to its child, then to the
    child's process group); it was taken as a second signal and killed the job unsaved. "every
    process": SIGTERM to dspark run, torchrun and the workers at once, as a scheduler that signals a
    whole job does; torchrun's own handler made the job exit 143 although the workers saved.
    "ctrl-c" and "hang-up": SIGINT and SIGHUP to dspark run, passed on as they came, killed the
    workers unsaved (KeyboardInterrupt inside the step; SIGHUP's default action)."""
    ckpt = tmp_path / "ckpt"

    def deliver(job: subprocess.Popen[str]) -> None:
        if deliveries == "every process":
            tree = descendants(job.pid)
            job.send_signal(signal.SIGTERM)
            signal_processes(tree, signal.SIGTERM)
        elif deliveries in ("ctrl-c", "hang-up"):
            job.send_signal(signal.SIGINT if deliveries == "ctrl-c" else signal.SIGHUP)
        else:
            for _ in range(2 if deliveries == "twice" else 1):
                job.send_signal(signal.SIGTERM)

    stdout, elapsed_s = _stopped_run(ckpt, "attempt 0: step 5 ", deliver, "--save-every", "8",
                                     "--step-sleep", "0.25")
    assert elapsed_s < 30  # the default grace period
    stopped = int(re.findall(r"attempt 0: step (\d+) ", stdout)[-1])
    assert_line_names(stdout, "attempt 0", "preempted", f"step {stopped}\n")
    assert 5 <= stopped < STEPS
    assert read_checkpoint_info(ckpt / f"step-{stopped:06d}").step_count == stopped

    again = launch(LaunchSpec(target=str(EXAMPLE), nproc=2,
                              args=("--ckpt", str(ckpt), "--steps", str(STEPS), "--save-every", "8")),
                   capture=True)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert f"resumed from step {stopped} " in again.stdout, again.stdout
    _assert_same(_final_parameters(ckpt / f"step-{STEPS:06d}"), uninterrupted)


@pytest.mark.slow
def test_a_sigterm_during_the_start_is_not_lost(tmp_path: Path) -> None:
    """SIGTERM after the start's line, before the first step: the example installs the handler
    before it prints (its first preemption_requested() call, collective, so on every rank), and the
    first step's check sees it. Installed only at the first step's check, it stopped the ranks
    unsaved and dspark run exited -15."""
    ckpt = tmp_path / "ckpt"
    # the first step (and its half-second sleep) is still to come when the signal arrives
    stdout, _ = _stopped_run(ckpt, "attempt 0: no checkpoint", lambda job: job.send_signal(signal.SIGTERM),
                             "--step-sleep", "0.5")
    assert_line_names(stdout, "attempt 0", "preempted", "step 1\n")
    assert read_checkpoint_info(ckpt / "step-000001").step_count == 1
