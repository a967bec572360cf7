"""The engine's own calls through a guard that refuses the user's (the zero3 module state-dict guard,
the sharded optimizer's): a count of those in progress, re-entrant.

Example::

    own = OwnCalls()
    with own.running():
        assert own          # a guard's hook lets the call through
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["OwnCalls"]


class OwnCalls:
    """True while one of the engine's own calls runs (see the module docstring)."""

    def __init__(self) -> None:
        self._depth = 0

    def __bool__(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Mark the engine's own call for the guard's hooks."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
