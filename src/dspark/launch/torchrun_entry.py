"""PyTorch's launcher with the script's own arguments kept away from its parser.

``python -m torch.distributed.run [options] train.py ARGS`` parses ARGS too: its parser takes the
script's arguments as a REMAINDER, but before that it classifies every ``--flag`` on the line, so a
script flag that abbreviates one of the launcher's (``--nproc 5``, ``--master 1``, ``--max 3``) stops
the job with "ambiguous option". ``dspark run`` starts::

    python -m dspark.launch.torchrun_entry N <N launcher arguments, the target last> <the script's arguments>

and this module parses only the launcher's N arguments with torchrun's own parser, then hands the
rest to the script untouched, through torchrun's own ``run``.

[Note: torchrun signalled itself] A scheduler that sends SIGTERM to every process of a job (not
only to ``dspark run``) reaches torchrun too, whose handler raises ``SignalException``: it passes
the signal to its workers, waits for them, and exits with the signal, so the job reported 143 even
when every worker saved its checkpoint and exited 0 (what ``dspark run`` promises for a handled
SIGTERM). This module keeps the workers' exit codes as torchrun closes them and, after a SIGTERM,
exits 0 when all of them did; any other outcome is torchrun's own. Once ``run`` has returned (every
worker exited 0) the stop signals are ignored: torchrun's handler is gone by then, and ``dspark
run``'s SIGTERM to a torchrun still tearing down would otherwise end a clean stop with 143.

[Note: workers die with the launcher] torchrun starts each worker in a session of its own and
nothing else ties a worker to it: killed with SIGKILL (or by the OOM killer), torchrun left its
workers re-parented to PID 1, training on for minutes and saving checkpoints after ``dspark run``
had reported the job over. Each worker is started with the kernel's parent-death signal armed
(:mod:`dspark.launch.parent_death`), SIGKILL: with its launcher gone nobody can restart, stop or
report on the job, and a checkpoint written now would race the job's relaunch.

[Note: a signal raised in a finalizer] torchrun's handler raises ``SignalException`` wherever its
main thread is when the signal lands. On a busy machine that can be inside an object's ``__del__``
(a ``subprocess.Popen`` collected while torchrun polls its workers), where Python cannot propagate
an exception: it printed "Exception ignored in ... Traceback" and dropped the signal, so torchrun
went on restarting workers that were being stopped. :func:`redeliver_lost_signals` installs an
unraisable-exception hook that sends such a signal to this process again, so the handler raises it
once more where it can propagate; every other unraisable exception is reported as before. The
signal is sent again from a short-lived thread, a moment after the hook returns: sent from the hook
itself, the handler ran inside the hook (Python runs a signal's handler at the next line of its main
thread) and the signal was lost there instead, on a busy machine again.

[Note: a failed worker] When a worker fails (after any restarts), torchrun raises
``ChildFailedError`` out of ``run``: its traceback (torchrun's own frames) and a block without the
worker's error came last on the screen, under the worker's own traceback, and the job exited 1
whatever the worker's exit code was. This module prints one line instead, naming the rank, its
exit code or signal and the ranks that failed with it, and exits with the first failed worker's
code (128 + N for a worker killed by signal N, as a shell reports it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from dspark.launch import rank_logs
from dspark.launch.parent_death import stop_with_parent

__all__ = ["describe_failure", "main", "redeliver_lost_signals", "split_argv"]

_log = logging.getLogger(__name__)

REDELIVER_AFTER_S = 0.01  # a lost stop signal is sent again this long after the hook that caught it
_closed_exit_codes: dict[int, int | None] = {}
"""Local rank -> exit code of the workers torchrun closed last (see [Note: torchrun signalled itself])."""


def _remember_exit_codes() -> bool:
    """Wrap torchrun's subprocess context so that closing it records its workers' exit codes; False
    when this PyTorch has no such context (nothing is changed then)."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SubprocessContext
    except ImportError:
        return False
    close = getattr(SubprocessContext, "_close", None)
    if close is None:
        return False

    def _close(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            close(self, *args, **kwargs)
        finally:
            handlers = getattr(self, "subprocess_handlers", None) or {}
            _closed_exit_codes.clear()
            _closed_exit_codes.update({rank: h.proc.poll() for rank, h in handlers.items()})

    SubprocessContext._close = _close  # type: ignore[method-assign]
    return True


def _start_workers_our_way() -> bool:
    """Make every worker torchrun starts get SIGKILL from the kernel when this process dies (see
    [Note: workers die with the launcher]) and, with ``--log-dir``, write its output to its rank's
    file ([Note: rank log files] in :mod:`dspark.launch.rank_logs`); False when this PyTorch starts
    its workers some other way."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as handler_module,
        )
    except ImportError:
        return False
    popen = getattr(handler_module, "Popen", None)
    if popen is None:
        return False
    arm = stop_with_parent(os.getpid(), signal.SIGKILL)

    def popen_armed(*args: Any, **kwargs: Any) -> Any:
        # the parent-death signal follows the thread that starts the worker: the main thread only
        if arm is not None and threading.current_thread() is threading.main_thread():
            kwargs["preexec_fn"] = arm
        return rank_logs.open_worker(popen, *args, **kwargs)

    handler_module.Popen = popen_armed  # type: ignore[assignment,misc]
    return True


def redeliver_lost_signals(signal_exception: type[BaseException]) -> None:
    """Send a stop signal that ``signal_exception`` carried out of a finalizer, where Python drops it,
    to this process again (see [Note: a signal raised in a finalizer]).

    Example::

        redeliver_lost_signals(SignalException)   # torchrun's exception type
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, signal_exception) and isinstance(getattr(exc, "sigval", None), int):
            _send_again_later(int(exc.sigval))  # type: ignore[attr-defined]
            return
        previous(unraisable)

    sys.unraisablehook = hook


def _send_again_later(signum: int) -> None:
    # Sent from here, the signal's handler would run as soon as this hook's next line does, and
    # raise inside the hook, where Python drops it once more: a thread sends it after the hook is done.
    def send() -> None:
        time.sleep(REDELIVER_AFTER_S)
        os.kill(os.getpid(), signum)

    try:
        threading.Thread(target=send, name="dspark-redeliver-signal", daemon=True).start()
    except RuntimeError:  # no new threads while the interpreter shuts down: send it now
        os.kill(os.getpid(), signum)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher arguments, script arguments)`` from ``[str(N), *launcher, *script]``.

    Example::

        split_argv(["3", "--nproc-per-node", "2", "train.py", "--nproc", "5"])
        # (['--nproc-per-node', '2', 'train.py'], ['--nproc', '5'])
    """
    if not argv or not argv[0].isdigit() or not 1 <= int(argv[0]) <= len(argv) - 1:
        raise SystemExit(f"usage: python -m dspark.launch.torchrun_entry N LAUNCHER_ARGS... SCRIPT_ARGS... "
                         f"(N: how many launcher arguments, the target last); got {argv[:1]}")
    count = int(argv[0])
    return argv[1:1 + count], argv[1 + count:]


def describe_failure(exc: Any) -> tuple[str, int]:
    """``(one line for the user, exit code)`` of torchrun's ``ChildFailedError`` (see [Note: a
    failed worker]).

    Example::

        describe_failure(exc)
        # ("dspark run: train.py failed: rank 1 (local rank 1, pid 6251) exited with code 1, ...", 1)
    """
    def how(exitcode: int) -> str:
        if exitcode >= 0:
            return f"exited with code {exitcode}"
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"

    rank, first = exc.get_first_failure()
    code = 128 - first.exitcode if first.exitcode < 0 else first.exitcode or 1
    def other(exitcode: int) -> str:
        # torchrun stops the ranks still running when one fails: SIGTERM is its, not a failure
        return ("was stopped by the launcher (SIGTERM)" if exitcode == -signal.SIGTERM
                else how(exitcode))

    others = "".join(f"; rank {r} {other(f.exitcode)}" for r, f in sorted(exc.failures.items())
                     if r != rank)
    hint = ("; a worker that SIGTERM kills was stopped from outside (dspark run passing on its own "
            "stop, the launcher, a scheduler's preemption) and did not handle it: to save and exit 0, "
            "check dspark.preemption_requested() between steps" if first.exitcode == -signal.SIGTERM
            else "")
    return (f"dspark run: {exc.name} failed: rank {rank} (local rank {first.local_rank}, pid "
            f"{first.pid}) {how(first.exitcode)}, the first to fail on this node{others}; its "
            f"error output, if it wrote any, is above{hint}", code)


def main(argv: list[str] | None = None) -> None:
    """Run torchrun on ``argv`` (see :func:`split_argv`), as ``python -m torch.distributed.run``."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    launcher, script_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(launcher)
    if args.training_script_args:
        raise SystemExit(f"dspark.launch.torchrun_entry: the launcher arguments end with the target; found "
                         f"{args.training_script_args} after it")
    args.training_script_args = script_args
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    watching = _remember_exit_codes()
    redeliver_lost_signals(SignalException)
    if not _start_workers_our_way():
        if os.environ.get(rank_logs.LOG_DIR_ENV):
            raise SystemExit("dspark run --log-dir: this PyTorch starts its workers in a way DSpark "
                             "does not know; run without --log-dir (torchrun's own --log-dir and "
                             "--redirects are an alternative)")
        _log.debug("workers are not armed to die with the launcher: dspark run cleans up after it")
    try:
        record(run)(args)
        # Every worker exited 0. A stop signal from here on (dspark run's, once the workers are
        # gone and this process is still tearing down, which takes seconds on a busy node) finds
        # torchrun's handler gone and would kill this process with 143 after a clean stop.
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(stop, signal.SIG_IGN)
    except ChildFailedError as exc:
        line, code = describe_failure(exc)
        print(line, file=sys.stderr, flush=True)
        sys.exit(code)
    except DistNetworkError as exc:  # the rendezvous: a port in use, a master that cannot be reached
        _log.debug("rendezvous failed", exc_info=True)
        in_use = "EADDRINUSE" in str(exc)
        print(f"dspark run: the rendezvous failed before any worker started: {exc}"
              + ("; choose another --master-port (on one node, leave it out and a free one is "
                 "picked)" if in_use else "; check --master-addr / --master-port (or "
                 "--rdzv-endpoint) and that node 0 is up and reachable"),
              file=sys.stderr, flush=True)
        sys.exit(1)
    except SignalException as exc:
        codes = list(_closed_exit_codes.values())
        if watching and exc.sigval == signal.SIGTERM and codes and all(c == 0 for c in codes):
            _log.warning("torchrun got SIGTERM itself; all %d worker(s) exited 0 after it: exit 0",
                         len(codes))
            sys.exit(0)
        # The stop came from outside (dspark run passing on its own SIGTERM or SIGINT, a scheduler):
        # torchrun has stopped the workers it had; its traceback would only say where it waited.
        _log.debug("torchrun stopped by a signal", exc_info=True)
        name = signal.Signals(exc.sigval).name
        print(f"dspark run: the launcher stopped on {name} and stopped the workers it had (a stop "
              f"asked of dspark run, or of the launcher by the job's scheduler); exit code "
              f"{128 + int(exc.sigval)}", file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    try:
        main()
    finally:
        rank_logs.finish()  # what the workers wrote last, through --tee
