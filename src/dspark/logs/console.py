"""``dspark.print`` and ``dspark.log_dir``: a print that N ranks do not repeat N times, and where the
job's logs go.

[Note: rank before init] Both work before ``dspark.init()`` (argument parsing prints, a config dump):
the rank then comes from the ``RANK`` variable PyTorch's launcher sets (0 when there is none), which
is the rank ``dspark.init()`` will take.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import IO, Any

from dspark import comm

__all__ = ["LOG_DIR_ENV", "log_dir", "rank_print", "this_rank"]

LOG_DIR_ENV = "DSPARK_LOG_DIR"
"""The environment variable ``dspark run --log-dir DIR`` sets in every worker (read by :func:`log_dir`)."""


def this_rank() -> int:
    """This process's rank: from ``dspark.init()``'s world, or before it from ``RANK`` (see
    [Note: rank before init])."""
    if comm.is_initialized():
        return comm.get_world().rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def rank_print(*args: Any, all_ranks: bool = False, sep: str | None = " ", end: str | None = "\n",
               file: IO[str] | None = None, flush: bool = True) -> None:
    """``print`` on rank 0 only; with ``all_ranks=True`` on every rank, each line prefixed with
    ``[rank R]`` so that interleaved output stays readable. Flushes by default (ranks' output is
    interleaved by the launcher as it arrives). Exposed as ``dspark.print``.

    Example::

        dspark.print(f"step {step}: loss {loss:.4f}")               # once
        dspark.print("local batch", len(x), all_ranks=True)          # [rank 1] local batch 32
    """
    rank = this_rank()
    if not all_ranks:
        if rank == 0:
            builtins.print(*args, sep=sep, end=end, file=file, flush=flush)
        return
    text = (sep if sep is not None else " ").join(str(a) for a in args)
    prefixed = "\n".join(f"[rank {rank}] {line}" for line in text.split("\n"))
    builtins.print(prefixed, end=end, file=file, flush=flush)


def log_dir() -> Path | None:
    """The job's log directory: ``dspark run --log-dir DIR`` puts every rank's output there and tells
    the workers through ``DSPARK_LOG_DIR``; None when the job has none. A good place for a
    :class:`dspark.Tracker`.

    Example::

        tracker = dspark.Tracker(dspark.log_dir() or "runs/latest")
    """
    value = os.environ.get(LOG_DIR_ENV)
    return Path(value) if value else None
