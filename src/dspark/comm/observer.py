"""One hook on every collective: whoever installs a :class:`CommObserver` sees each collective start
and each blocking wait for one, with the collective's kind and label.

[Note: why the hook lives in comm] Every collective DSpark runs, synchronous or not, starts in
:func:`dspark.comm.collectives._run` and blocks only in ``Handle.wait()``. Observing those two places
covers every wait there is (bucket collects, zero3 gathers, buffer broadcasts, object collectives,
the global BatchNorm's statistics) without a timer at each call site that a new call site could
forget. The engine installs its step observer while a step's phases run, to time the waits that
compute did not hide and to name each collective in profiler traces. With no observer installed a
collective pays one global read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

__all__ = ["CommObserver", "current_observer", "set_observer"]

T = TypeVar("T")


class CommObserver(Protocol):
    """What the comm layer tells an observer. ``kind`` is the collective (``"all_reduce"``,
    ``"all_gather"``, ...); ``label`` is the name its caller gave it (``None`` when none)."""

    def launch(self, kind: str, label: str | None, start: Callable[[], T]) -> T:
        """Start the collective by calling ``start()`` and return what it returns."""
        ...

    def wait(self, kind: str, label: str | None, wait: Callable[[], None]) -> None:
        """Block until the collective is done by calling ``wait()``."""
        ...

    def where(self) -> str | None:
        """What the caller is doing now, for a failed collective's message (``"engine step 3,
        backward"``), or None."""
        ...


_current: CommObserver | None = None


def set_observer(observer: CommObserver | None) -> CommObserver | None:
    """Install ``observer`` for every collective from now on (``None``: none); returns the one it
    replaces, so that a caller can put it back.

    Example::

        previous = set_observer(my_observer)
        try:
            train_one_step()
        finally:
            set_observer(previous)
    """
    global _current
    previous, _current = _current, observer
    return previous


def current_observer() -> CommObserver | None:
    """The observer installed now, if any."""
    return _current
