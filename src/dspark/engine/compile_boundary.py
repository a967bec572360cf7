"""Hooks that always run eagerly, without importing the compiler until something compiles.

The engine's hooks (the root's batch accounting, zero3's gather and free) swap parameter storage
and read host values; a graph traced through them would be wrong. ``torch.compiler.disable`` marks
a function so, but applying it imports ``torch._dynamo``: about a second per process, paid by every
job and every benchmark launch, compiled or not. :func:`outside_compile` defers that to the first
call made while a graph is being traced: in eager mode the hook runs directly; under
``torch.compile`` the trace breaks at the hook, which then runs eagerly, as with the decorator.

Example::

    module.register_forward_pre_hook(outside_compile(hook))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["outside_compile"]

_F = TypeVar("_F", bound=Callable[..., Any])


def outside_compile(fn: _F) -> _F:
    """``fn``, run outside any ``torch.compile`` graph; costs one flag check per call otherwise."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Only ever reached while dynamo traces, so torch._dynamo is loaded; the trace breaks
            # here and the disabled call runs eagerly.
            return torch._dynamo.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
