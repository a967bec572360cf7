"""PyTorch's profiler (kineto) writes a line to the process's stderr on every start and stop
(``USDT: ... profiler_start``), below Python, so ``sys.stderr`` cannot catch it. Where DSpark
starts the profiler for its own measurement (the planner's peak memory, not a trace the user
asked for), those lines are noise in the user's terminal around a table; a job's log filters
them the same way (:mod:`dspark.bench.measure.runner`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["BANNER_PREFIXES", "is_banner", "quiet_banners"]

BANNER_PREFIXES = ("USDT:", "STAGE:")
"""The starts of the lines kineto writes when a profiler starts or stops."""


def is_banner(line: str) -> bool:
    """Whether ``line`` is one of kineto's start/stop lines.

    Example::

        is_banner("USDT:2026-12-06 18:14:01 27314:27314 ...] profiler_start")   # True
    """
    return line.startswith(BANNER_PREFIXES)


@contextlib.contextmanager
def quiet_banners() -> Iterator[None]:
    """Hold what the process writes to file descriptor 2 while the block runs (start or stop a
    profiler in it), then write back every line but kineto's banners: nothing else is lost, only
    held for the block's length.

    Example::

        with quiet_banners():
            prof.start()
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (a closed stderr): nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not is_banner(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
