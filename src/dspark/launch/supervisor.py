"""Running PyTorch's launcher as a child so that whatever stops ``dspark run`` stops the whole job.

[Note: stopping a job] torchrun starts each worker in a session of its own, so a signal sent to
torchrun's process group never reaches the workers, and a torchrun that dies leaves them running.
``dspark run`` therefore starts torchrun in a new session and, while it runs, keeps a list of every
process below it (pid and start time). On SIGTERM, SIGINT or SIGHUP it:

1. sends SIGTERM to each worker (torchrun's children, not their process groups: a worker's
   DataLoader processes are its own business), whichever of the three it got: each is a request
   to stop, and :func:`dspark.preemption_requested` watches SIGTERM, so a loop polling it saves
   and exits 0 after Ctrl-C or a hang-up too (a SIGINT passed on as it came raised
   KeyboardInterrupt inside the step, a SIGHUP killed the worker, both unsaved); torchrun then sees
   its workers succeed and exits 0, and so does ``dspark run``;
2. if torchrun starts new workers (a restart after a worker died of the signal), or stays up
   :data:`SETTLE_S` seconds after its workers are gone, sends the signal to torchrun too, which
   stops its workers itself;
3. once the grace period has passed, or at a second signal, kills (SIGKILL) torchrun and every
   process it has seen below it, orphans included. A second SIGTERM within :data:`DUPLICATE_S` of
   the first is the same request delivered twice, not a second one: ``timeout`` (and other
   wrappers) signal both their child and its process group, so ``dspark run`` gets one stop twice;
   a second SIGINT (Ctrl-C again) kills at once;
4. after torchrun has exited, kills whatever of that list is still alive.

The handlers are in place before torchrun is started, so no stop is lost while it starts (a stop
before that starts nothing). If torchrun exits by itself, or is killed (``kill -9``, the OOM killer),
whatever of its tree is still running gets SIGTERM, then SIGKILL once the grace period is over.

If ``dspark run`` itself is killed with SIGKILL, none of this runs; on Linux the kernel then sends
torchrun SIGTERM (``PR_SET_PDEATHSIG``), and torchrun stops its workers. If torchrun dies first,
the kernel kills its workers (SIGKILL, armed by :mod:`dspark.launch.torchrun_entry`): see
:mod:`dspark.launch.parent_death`.

The exit code is 0 when torchrun exited 0 (every worker exited 0), else ``128 + signal``
(:func:`dspark.launch.launcher.launch` then raises the signal in its own process as well).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

from dspark.launch.parent_death import stop_with_parent
from dspark.launch.process_tree import (
    ProcessInfo,
    children,
    descendants,
    is_running,
    signal_processes,
)

__all__ = ["DEFAULT_GRACE_S", "DUPLICATE_S", "SETTLE_S", "STOP_SIGNALS", "Supervised", "run_supervised"]

_log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PASSED_ON = signal.SIGTERM
"""What the job's processes get for any of :data:`STOP_SIGNALS` (see [Note: stopping a job])."""
DEFAULT_GRACE_S = 30.0
"""How long workers get to save and exit after a stop signal: what Slurm and Kubernetes give."""
SETTLE_S = 5.0
"""How long torchrun may stay up with no workers after a stop signal before it is told to stop."""
_POLL_S = 0.1
DUPLICATE_S = 1.0
"""A SIGTERM this soon after the first is the same stop delivered twice (see the module note)."""
_SNAPSHOT_EVERY_S = 0.5


@dataclass(frozen=True, slots=True)
class Supervised:
    """How a supervised launcher ended."""

    returncode: int
    """0 when the launcher exited 0; ``128 + N`` after stop signal N (or when it died of signal N)."""
    stdout: str | None
    stderr: str | None
    stop_signal: int | None = None
    """The first stop signal received, if any."""


@dataclass
class _Tree:
    """What the supervisor has seen of the launcher's process tree."""

    root: int
    seen: dict[int, ProcessInfo] = field(default_factory=dict)
    snapshot_at: float = 0.0

    def refresh(self, now: float, *, force: bool = False) -> None:
        if force or now - self.snapshot_at >= _SNAPSHOT_EVERY_S:
            for proc in descendants(self.root):
                self.seen.setdefault(proc.pid, proc)
            self.snapshot_at = now

    def kill_all(self) -> list[int]:
        return signal_processes(list(self.seen.values()), signal.SIGKILL)


def run_supervised(command: list[str], *, env: Mapping[str, str], capture: bool,
                   grace_s: float = DEFAULT_GRACE_S, child_is_worker: bool = False) -> Supervised:
    """Run ``command`` (torchrun, or with ``child_is_worker`` the only worker itself) in a new
    session and wait for it, stopping its whole tree on SIGTERM / SIGINT / SIGHUP as [Note: stopping
    a job] says. Signals are handled only when called from the main thread (Python allows handlers
    nowhere else; elsewhere the child just runs), and not those this process ignores (a job started
    in the background of a script inherits SIGINT ignored: Ctrl-C is not for it).

    Example::

        done = run_supervised(launcher_command(spec), env=launcher_env(), capture=False)
        done.returncode   # 0 when every worker exited 0, also after a SIGTERM they handled
    """
    pipe = subprocess.PIPE if capture else None
    supervisor = _Supervisor(grace_s, child_is_worker=child_is_worker)
    # The handlers go in before the child exists: a stop that arrives while it starts is one the
    # loop acts on, never a KeyboardInterrupt out of Popen that leaves the child running.
    with supervisor.handling_signals():
        if supervisor.received:  # stopped before anything started: start nothing
            signum = supervisor.received[0][0]
            return Supervised(returncode=128 + int(signum), stdout=None, stderr=None,
                              stop_signal=signum)
        # SIGTERM when this process dies, even by SIGKILL: see [Note: stopping a job]
        child = subprocess.Popen(command, env=dict(env), stdout=pipe, stderr=pipe, text=True,
                                 start_new_session=True,
                                 preexec_fn=stop_with_parent(os.getpid(), signal.SIGTERM))
        stdout, stderr = supervisor.wait(child, capture)
    return Supervised(returncode=supervisor.returncode(), stdout=stdout, stderr=stderr,
                      stop_signal=supervisor.stop_signal)




class _Supervisor:
    child: subprocess.Popen[str]
    tree: _Tree

    def __init__(self, grace_s: float, *, child_is_worker: bool = False) -> None:
        self.child_is_worker = child_is_worker
        self.grace_s = grace_s
        self.received: list[tuple[int, float]] = []  # (signal, when): appended by the handler
        self.stop_at = 0.0
        self.stop_signal: int | None = None
        self.deadline = 0.0
        self.signalled: set[tuple[int, float]] = set()  # (pid, start) of workers already told
        self.launcher_told = False
        self.idle_since: float | None = None
        self.killed = False

    @contextmanager
    def handling_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS
                    if signal.getsignal(s) is not signal.SIG_IGN}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append((signum, time.monotonic()))  # the loop acts on it: a handler must not block

    def wait(self, child: subprocess.Popen[str], capture: bool) -> tuple[str | None, str | None]:
        self.child = child
        self.tree = _Tree(root=child.pid)
        out: tuple[str | None, str | None] = (None, None)
        while True:
            try:
                if capture:
                    out = self.child.communicate(timeout=_POLL_S)  # a retry loses no output
                else:
                    self.child.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                self._tick()
        if self.stop_signal is None and self.received:  # it came as torchrun exited by itself
            self.stop_signal = self.received[0][0]
        self.tree.refresh(time.monotonic(), force=True)
        if self.stop_signal is not None:  # orphans of the tree outlive torchrun: end them too
            leftover = self.tree.kill_all()
            if leftover:
                _log.warning("killed %d process(es) left behind by the job: %s", len(leftover), leftover)
        else:
            self._end_what_the_launcher_left()
        return out

    def _end_what_the_launcher_left(self) -> None:
        """The launcher exited by itself (or was killed: ``kill -9``, the OOM killer) with
        processes of its tree still running: they get SIGTERM, then SIGKILL once the grace period
        is over (at once on a stop signal meanwhile). Nothing of the job outlives ``dspark run``."""
        alive = [p for p in self.tree.seen.values() if is_running(p.pid, p.started_at)]
        code = self.child.returncode
        if code is not None and code < 0 and not self.child_is_worker:
            _log.warning("PyTorch's launcher (pid %d) was killed by %s; %s", self.child.pid,
                         _signal_name(-code), f"stopping the {len(alive)} process(es) it left: "
                         f"{[p.pid for p in alive]}" if alive else "no process of the job is left")
        elif alive:
            _log.warning("the launcher exited leaving %d process(es) of the job: %s; SIGTERM, then "
                         "SIGKILL after %.0f s", len(alive), [p.pid for p in alive], self.grace_s)
        if not alive:
            return
        signal_processes(alive, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.received:
            if not any(is_running(p.pid, p.started_at) for p in alive):
                return
            time.sleep(_POLL_S)
        signal_processes(alive, signal.SIGKILL)

    def _tick(self) -> None:
        now = time.monotonic()
        self.tree.refresh(now, force=self.stop_signal is not None)
        while self.received:
            signum, at = self.received.pop(0)
            if self.stop_signal is None:
                self.stop_at = at
                self._start_stopping(signum, now)
            elif signum == self.stop_signal == signal.SIGTERM and at - self.stop_at < DUPLICATE_S:
                _log.info("SIGTERM again %.3f s after the first: the same stop, delivered twice",
                          at - self.stop_at)
            else:
                _log.warning("second signal %s: killing the job now", signal.Signals(signum).name)
                self._kill()
        if self.stop_signal is None or self.killed:
            return
        if self.child_is_worker:  # no launcher between: the child was told, the deadline applies
            if now >= self.deadline:
                _log.warning("the worker did not stop within %.0f s of %s: killing it", self.grace_s,
                             signal.Signals(self.stop_signal).name)
                self._kill()
            return
        if now >= self.deadline:
            _log.warning("the job did not stop within %.0f s of %s: killing it", self.grace_s,
                         signal.Signals(self.stop_signal).name)
            self._kill()
            return
        workers = children(self.child.pid)
        restarted = [w for w in workers if (w.pid, w.started_at) not in self.signalled]
        if restarted:  # torchrun replaced workers that died: it must stop, not carry on
            self._tell_workers(restarted, _PASSED_ON)
            self._tell_launcher("it restarted its workers")
        if workers:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since >= SETTLE_S:
            self._tell_launcher(f"its workers are gone but it is still up after {SETTLE_S:.0f} s")

    def _start_stopping(self, signum: int, now: float) -> None:
        self.stop_signal = signum
        self.deadline = now + self.grace_s
        if self.child_is_worker:
            _log.warning("got %s: passing it to the worker, %.0f s to stop", signal.Signals(signum).name,
                         self.grace_s)
            try:
                self.child.send_signal(_PASSED_ON)
            except ProcessLookupError:
                pass
            return
        workers = children(self.child.pid)
        if workers:
            _log.warning("got %s: passing it to %d worker(s), %.0f s to stop",
                         signal.Signals(signum).name, len(workers), self.grace_s)
            self._tell_workers(workers, _PASSED_ON)
        else:  # torchrun is starting (or restarting) them: it stops whatever it has
            _log.info("got %s while the launcher has no workers", signal.Signals(signum).name)
            self._tell_launcher("it has no workers right now", quiet=not self.tree.seen)

    def _tell_workers(self, workers: list[ProcessInfo], signum: int) -> None:
        signal_processes(workers, signum)
        self.signalled.update((w.pid, w.started_at) for w in workers)

    def _tell_launcher(self, why: str, *, quiet: bool = False) -> None:
        """SIGTERM to the launcher. ``quiet``: before any worker ever started, a stop is routine
        (Ctrl-C right after ``dspark run``): the caller's one line says it all."""
        if self.launcher_told or self.stop_signal is None:
            return
        self.launcher_told = True
        _log.log(logging.INFO if quiet else logging.WARNING, "stopping the launcher: %s", why)
        try:
            self.child.send_signal(_PASSED_ON)
        except ProcessLookupError:
            pass

    def _kill(self) -> None:
        self.killed = True
        self.tree.refresh(time.monotonic(), force=True)
        try:
            self.child.kill()
        except ProcessLookupError:
            pass
        self.tree.kill_all()

    def returncode(self) -> int:
        code = self.child.returncode
        if code == 0:
            return 0
        if self.stop_signal is not None:
            return 128 + int(self.stop_signal)
        return code if code > 0 else 128 - code  # died of signal N: the shell's 128 + N


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
