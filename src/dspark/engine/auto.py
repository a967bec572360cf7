"""``Engine(strategy="auto")``: where the engine asks for a strategy it was not given.

[Note: auto without a circle] The choice needs the planner (:mod:`dspark.plan`), which reads the
engine's own formulas; the engine must not import it back. So the planner registers its resolver
here when it is imported (``import dspark`` imports it), and the engine calls whatever is
registered. The engine depends on a function type, never on the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.comm import World

__all__ = ["AutoRequest", "AutoResolver", "check_memory_budget", "resolve_auto", "set_auto_resolver"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoRequest:
    """What the engine knows at construction, handed to the resolver."""

    model: nn.Module
    optimizer: Callable[..., torch.optim.Optimizer]
    precision: str
    bucket_mb: float
    memory_budget: int | None
    """Bytes per rank the strategy must fit in; None: the resolver's default."""
    world: World


AutoResolver = Callable[[AutoRequest], tuple[str, Any]]
"""``request -> (strategy name, plan)``: the same strategy on every rank."""

_resolver: list[AutoResolver] = []


def set_auto_resolver(resolver: AutoResolver) -> None:
    """Register the function ``strategy="auto"`` calls (the planner does, on import)."""
    _resolver[:] = [resolver]


def check_memory_budget(memory_budget: Any) -> int | None:
    """``memory_budget`` as bytes per rank (None: the resolver's default); anything else is a
    ``ValueError`` naming it."""
    if memory_budget is None:
        return None
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget={memory_budget!r} must be an int > 0 (bytes per rank) or None "
                         "(the device's memory less a margin)")
    return memory_budget


def resolve_auto(request: AutoRequest) -> tuple[str, Any]:
    """The registered resolver's ``(strategy, plan)`` for ``request``.

    Example::

        strategy, plan = resolve_auto(AutoRequest(model=m, optimizer=opt, precision="fp32",
                                                  bucket_mb=25.0, memory_budget=None, world=world))
    """
    if not _resolver:
        raise RuntimeError("strategy='auto' needs the planner: import dspark (or dspark.plan) before "
                           "building the engine, or pass a strategy by name")
    return _resolver[0](request)
