"""``dspark.progress``: a progress bar for a training or evaluation loop, drawn by rank 0 only, and
only on a terminal (a log file or a pipe gets no bar characters)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from dspark.logs.console import this_rank

__all__ = ["progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], total: int | None = None, *, description: str = "",
             enabled: bool | None = None) -> Iterator[T]:
    """Yield ``iterable``'s items; on rank 0, when stdout is a terminal, draw a rich progress bar of
    ``total`` items (default ``len(iterable)`` where it has one). Other ranks, and rank 0 writing to a
    file or a pipe, just iterate. ``enabled`` overrides the terminal test.

    Example::

        for x, y in dspark.progress(loader, total=len(loader), description="epoch 1"):
            ...
    """
    show = this_rank() == 0 and (sys.stdout.isatty() if enabled is None else enabled)
    if not show:
        yield from iterable
        return
    from rich.progress import Progress  # only where a bar is drawn

    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in iterable:
            yield item
            bar.advance(task)
