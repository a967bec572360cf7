"""Whatever stops ``dspark run`` (SIGTERM, SIGINT, SIGHUP) stops its whole process tree: torchrun,
the workers and what they started, even processes in sessions of their own, even workers that
ignore the signal (killed once the grace period is over)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark.launch.process_tree import descendants, is_running
from dspark.launch.torchrun_entry import redeliver_lost_signals
from tests.messages import assert_line_names

GRACE_S = 3.0

STUBBORN_WORKER = """
import os, signal, subprocess, sys, time
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
subprocess.Popen(sleeper)                          # a child in the worker's session
subprocess.Popen(sleeper, start_new_session=True)  # and one that left it
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
time.sleep(300)
"""


def _wait_for(condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_no_process_of_the_job_survives(tmp_path: Path, signum: int) -> None:
    _no_process_survives(tmp_path, signum)


def _no_process_survives(tmp_path: Path, signum: int, *, slack_s: float = 30) -> None:
    # A worker's ready file is the marker that dspark run's handlers are in place: they are
    # installed before torchrun is started (see [Note: stopping a job]).
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN_WORKER)
    ready = tmp_path / "ready"
    ready.mkdir()
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                            "--grace-period", str(GRACE_S), str(script), str(ready)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to start")
        _wait_for(lambda: len(descendants(job.pid)) >= 7, 30, "torchrun, 2 workers, 4 sleepers")
        tree = descendants(job.pid)
        started = time.monotonic()
        job.send_signal(signum)
        _, stderr = job.communicate(timeout=GRACE_S + 60)
        elapsed_s = time.monotonic() - started
    finally:
        if job.poll() is None:
            job.kill()
    # the workers ignored it: after the job is gone the signal ends dspark run as well (Ctrl-C:
    # KeyboardInterrupt, which the CLI turns into 130)
    assert job.returncode == (130 if signum == signal.SIGINT else -signum), stderr[-3000:]
    assert GRACE_S <= elapsed_s < GRACE_S + slack_s, elapsed_s  # waited the grace period, then killed
    _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in tree), 10,
              "every process of the tree to be gone")
    assert len(tree) >= 7
    assert os.getpid() not in {p.pid for p in tree}


def _sleeper(tmp_path: Path) -> tuple[Path, Path]:
    """A worker script that marks itself ready in the folder it is given, then sleeps."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n"
                      "time.sleep(300)\n")
    ready = tmp_path / "ready"
    ready.mkdir()
    return script, ready


@pytest.mark.slow
def test_a_launcher_that_restarts_killed_workers_is_stopped_too(tmp_path: Path) -> None:
    # Workers that die of SIGTERM look like a failure to torchrun, which restarts them (here up to
    # 3 times). dspark run sees workers it never signalled and stops torchrun: the job ends long
    # before the grace period, not when it runs out.
    script, ready = _sleeper(tmp_path)
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                            "--max-restarts", "3", "--grace-period", "90", str(script), str(ready)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to start")
        tree = descendants(job.pid)
        started = time.monotonic()
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
        elapsed_s = time.monotonic() - started
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == -signal.SIGTERM, stderr[-3000:]
    assert elapsed_s < 45, (elapsed_s, stderr[-3000:])
    assert "restarted its workers" in stderr or "no workers right now" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # torchrun's SignalException, as one line
    if "restarted its workers" in stderr:
        assert_line_names(stderr, "launcher stopped", "SIGTERM")
    _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in tree), 10,
              "every process of the tree to be gone")


_ONE_WORKER_DRIVER = """
import signal, sys
from dspark.launch.launcher import LaunchSpec, launch
if sys.argv[2] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a script's background job inherits it
spec = LaunchSpec(target=sys.argv[1], nproc=1, agent=False, grace_period_s=10)
try:
    print("rc", launch(spec), flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""

_SLEEPER = """
import os, pathlib, sys, time
pathlib.Path(os.environ["READY"]).touch()
time.sleep(float(os.environ["SLEEP_S"]))
print("finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("disposition", ["default", "ignored"])
def test_ctrl_c_reaches_a_worker_started_without_torchrun(tmp_path: Path, disposition: str) -> None:
    """The bench's 1-device launches run the worker itself, without torchrun: a SIGINT was passed to
    '0 worker(s)'. Now the worker is told and the caller gets KeyboardInterrupt. A process that
    ignores SIGINT (a background job of a script) keeps ignoring it: the worker runs to its end."""
    _ctrl_c_one_worker(tmp_path, disposition)


def _ctrl_c_one_worker(tmp_path: Path, disposition: str) -> None:
    # The worker's ready file is the marker that the driver's handlers are in place (installed
    # before the worker is started). A worker told to stop would sleep 120 s: "finished" in time
    # can only mean the signal was lost, however slowly a loaded machine runs.
    worker = tmp_path / "sleeper.py"
    worker.write_text(_SLEEPER)
    ready = tmp_path / "ready"
    job = subprocess.Popen([sys.executable, "-c", _ONE_WORKER_DRIVER, str(worker), disposition],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "READY": str(ready),
                                "SLEEP_S": "120" if disposition == "default" else "4"})
    try:
        _wait_for(ready.exists, 60, "the worker to start")
        job.send_signal(signal.SIGINT)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    if disposition == "default":
        assert "interrupted" in stdout and "finished" not in stdout, (stdout, stderr[-2000:])
        assert_line_names(stderr, "SIGINT", "worker")
    else:
        assert "finished" in stdout and "rc 0" in stdout, (stdout, stderr[-2000:])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launcher_killed_by_sigkill_takes_its_job_with_it(tmp_path: Path) -> None:
    """kill -9 (or the OOM killer) of dspark run runs no handler: torchrun and both workers, in
    sessions of their own, used to keep running, holding their port."""
    script, ready = _sleeper(tmp_path)
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                            str(script), str(ready)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree = []
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to start")
        tree = descendants(job.pid)
        assert len(tree) >= 3  # torchrun and 2 workers
        job.kill()
        job.wait(timeout=10)
        _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in tree), 60,
                  "torchrun and the workers to stop")
    finally:
        job.kill()
        for p in tree:  # orphans are no longer below this process: end them by the list
            if is_running(p.pid, p.started_at):
                os.kill(p.pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_to_torchrun_after_its_workers_exited_0_is_still_exit_0(tmp_path: Path) -> None:
    """dspark run signals a torchrun still up after its workers are gone; during its teardown,
    with torchrun's handler gone, that SIGTERM made a clean preemption exit 143."""
    script = tmp_path / "done.py"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()\n")
    ready = tmp_path / "ready"
    ready.mkdir()
    launcher = ["--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script)]
    job = subprocess.Popen([sys.executable, "-m", "dspark.launch.torchrun_entry", str(len(launcher)),
                            *launcher, str(ready)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to run")
        _wait_for(lambda: job.poll() is not None or not descendants(job.pid), 60,
                  "both workers to exit")
        time.sleep(0.5)  # into torchrun's teardown, where its own handler is gone
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-3000:]


_SPAWNS_AND_SLEEPS = """
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
subprocess.Popen(sleeper, start_new_session=True)  # a process of the job in a session of its own
open(os.path.join(sys.argv[1], os.environ["RANK"]), "w").close()
time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_do_not_outlive_a_launcher_killed_by_sigkill(tmp_path: Path) -> None:
    """kill -9 of PyTorch's launcher (the torchrun entry process) left its workers re-parented to
    PID 1, training on for minutes, while dspark run exited 137 at once. Now the kernel kills the
    workers with their launcher, and dspark run ends what they started within the grace period."""
    script = tmp_path / "spawns.py"
    script.write_text(_SPAWNS_AND_SLEEPS)
    ready = tmp_path / "ready"
    ready.mkdir()
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                            "--grace-period", str(GRACE_S), str(script), str(ready)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = []
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to start")
        _wait_for(lambda: len(descendants(job.pid)) >= 5, 30, "torchrun, 2 workers, 2 sleepers")
        time.sleep(1.0)  # dspark run's view of the tree is refreshed every 0.5 s
        tree = descendants(job.pid)
        (launcher,) = [p for p in tree if p.ppid == job.pid]
        workers = [p for p in tree if p.ppid == launcher.pid]
        assert len(workers) == 2
        os.kill(launcher.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in workers), 5,
                  "the workers to die with their launcher")
        _, stderr = job.communicate(timeout=GRACE_S + 30)
        _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in tree), 5,
                  "every process of the job to be gone")
        assert time.monotonic() - killed_at < GRACE_S + 10
    finally:
        if job.poll() is None:
            job.kill()
        for p in tree:
            if is_running(p.pid, p.started_at):
                os.kill(p.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGKILL, stderr[-3000:]
    assert "launcher" in stderr and "SIGKILL" in stderr, stderr[-3000:]


@pytest.mark.serial
@pytest.mark.slow
def test_stops_are_not_lost_under_a_cpu_hog(tmp_path: Path) -> None:
    """The stop tests above failed now and then on a loaded machine. Under a busy-loop process per
    core, the stop still reaches the workers: Ctrl-C to a one-worker launch, and SIGINT to dspark
    run with stubborn workers (killed after the grace period, nothing left)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)]
    try:
        (tmp_path / "one").mkdir()
        _ctrl_c_one_worker(tmp_path / "one", "default")
        (tmp_path / "job").mkdir()
        _no_process_survives(tmp_path / "job", signal.SIGINT, slack_s=60)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.8, 1.5])
def test_ctrl_c_early_in_dspark_run_ends_with_one_line(tmp_path: Path, delay_s: float) -> None:
    """Ctrl-C in the first 1.5 s of dspark run printed a raw KeyboardInterrupt traceback (it came
    while the command was still importing PyTorch, which it no longer does). What is left is the
    interpreter's own start (0.1-0.2 s on an idle machine), before any DSpark code runs."""
    script, ready = _sleeper(tmp_path)
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "1",
                            str(script), str(ready)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(delay_s)
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "dspark: interrupted", stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_their_launcher_when_dspark_run_dies_too(tmp_path: Path) -> None:
    """kill -9 of dspark run and of PyTorch's launcher at once: nobody is left to clean up, and the
    kernel's parent-death signal alone ends the workers."""
    script, ready = _sleeper(tmp_path)
    job = subprocess.Popen([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2",
                            str(script), str(ready)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tree = []
    try:
        _wait_for(lambda: len(list(ready.iterdir())) == 2, 120, "both workers to start")
        tree = descendants(job.pid)
        (launcher,) = [p for p in tree if p.ppid == job.pid]
        workers = [p for p in tree if p.ppid == launcher.pid]
        assert len(workers) == 2
        job.kill()
        os.kill(launcher.pid, signal.SIGKILL)
        _wait_for(lambda: not any(is_running(p.pid, p.started_at) for p in workers), 5,
                  "the workers to die with their launcher")
    finally:
        job.kill()
        for p in tree:
            if is_running(p.pid, p.started_at):
                os.kill(p.pid, signal.SIGKILL)


class Stopped(Exception):
    """torchrun's ``SignalException`` as the hook sees it: the signal in ``sigval``."""

    def __init__(self, sigval: int) -> None:
        super().__init__(sigval)
        self.sigval = sigval


class DiesWithASignal:
    def __del__(self) -> None:
        raise Stopped(signal.SIGUSR1)


def test_a_stop_signal_raised_in_a_finalizer_is_sent_again() -> None:
    # torchrun's handler raised its SignalException inside a Popen's __del__ on a busy machine:
    # Python printed it as an ignored exception and the stop was lost
    received: list[int] = []
    others: list[BaseException | None] = []
    handler, hook = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum)), sys.unraisablehook
    sys.unraisablehook = lambda unraisable: others.append(unraisable.exc_value)
    try:
        redeliver_lost_signals(Stopped)
        DiesWithASignal()
        deadline = time.monotonic() + 5
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [signal.SIGUSR1] and others == []

        class DiesOtherwise:
            def __del__(self) -> None:
                raise ValueError("not a signal")

        DiesOtherwise()
        assert [type(e) for e in others] == [ValueError]  # reported as before
    finally:
        signal.signal(signal.SIGUSR1, handler)
        sys.unraisablehook = hook


def test_a_stop_signal_sent_again_raises_where_it_can_propagate() -> None:
    # torchrun's handler raises: sent from inside the hook, the signal's handler ran in the hook and
    # the exception was dropped there too ("Exception ignored in sys.unraisablehook")
    def raise_stopped(signum: int, frame: object) -> None:
        raise Stopped(signum)

    handler, hook = signal.signal(signal.SIGUSR1, raise_stopped), sys.unraisablehook
    caught: list[int] = []
    try:
        redeliver_lost_signals(Stopped)
        try:
            DiesWithASignal()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        except Stopped as stop:
            caught.append(stop.sigval)
        assert caught == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, handler)
        sys.unraisablehook = hook
