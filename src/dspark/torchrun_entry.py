"""PyTorch's launcher with the script's own arguments kept away from its parser.

``python -m torch.distributed.run [options] train.py ARGS`` parses ARGS too: its parser takes the
script's arguments as a REMAINDER, but before that it classifies every ``--flag`` on the line, so a
script flag that abbreviates one of the launcher's (``--nproc 5``, ``--master 1``, ``--max 3``) stops
the job with "ambiguous option". ``dspark run`` starts::

    python -m dspark.torchrun_entry N <N launcher arguments, the target last> <the script's arguments>

and this module parses only the launcher's N arguments with torchrun's own parser, then hands the
rest to the script untouched, through torchrun's own ``run``.

[Note: torchrun signalled itself] A scheduler that sends SIGTERM to every process of a job (not
only to ``dspark run``) reaches torchrun too, whose handler raises ``SignalException``: it passes
the signal to its workers, waits for them, and exits with the signal, so the job reported 143 even
when every worker saved its checkpoint and exited 0 (what ``dspark run`` promises for a handled
SIGTERM). This module keeps the workers' exit codes as torchrun closes them and, after a SIGTERM,
exits 0 when all of them did; any other outcome is torchrun's own.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

__all__ = ["main", "split_argv"]

_log = logging.getLogger(__name__)
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


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher arguments, script arguments)`` from ``[str(N), *launcher, *script]``.

    Example::

        split_argv(["3", "--nproc-per-node", "2", "train.py", "--nproc", "5"])
        # (['--nproc-per-node', '2', 'train.py'], ['--nproc', '5'])
    """
    if not argv or not argv[0].isdigit() or not 1 <= int(argv[0]) <= len(argv) - 1:
        raise SystemExit(f"usage: python -m dspark.torchrun_entry N LAUNCHER_ARGS... SCRIPT_ARGS... "
                         f"(N: how many launcher arguments, the target last); got {argv[:1]}")
    count = int(argv[0])
    return argv[1:1 + count], argv[1 + count:]


def main(argv: list[str] | None = None) -> None:
    """Run torchrun on ``argv`` (see :func:`split_argv`), as ``python -m torch.distributed.run``."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    launcher, script_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(launcher)
    if args.training_script_args:
        raise SystemExit(f"dspark.torchrun_entry: the launcher arguments end with the target; found "
                         f"{args.training_script_args} after it")
    args.training_script_args = script_args
    from torch.distributed.elastic.multiprocessing.api import SignalException

    watching = _remember_exit_codes()
    try:
        record(run)(args)
    except SignalException as exc:
        codes = list(_closed_exit_codes.values())
        if watching and exc.sigval == signal.SIGTERM and codes and all(c == 0 for c in codes):
            _log.warning("torchrun got SIGTERM itself; all %d worker(s) exited 0 after it: exit 0",
                         len(codes))
            sys.exit(0)
        raise


if __name__ == "__main__":
    main()
