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

__all__ = ["AutoRequest", "AutoResolver", "check_memory_budget", "resolve_auto", "set_auto_resolver",
           "strategy_and_plan"]


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


def strategy_and_plan(strategy: str, memory_budget: Any, *, model: nn.Module,
                      optimizer: Callable[..., torch.optim.Optimizer], precision: str, bucket_mb: float,
                      world: World) -> tuple[str, Any]:
    """The engine's ``strategy`` by name and the plan it came from: ``"auto"`` asks the resolver for
    the fastest strategy that fits ``memory_budget`` bytes per rank; any other name is kept, with no
    plan, and refuses a ``memory_budget`` (only ``"auto"`` reads it).

    Example::

        strategy_and_plan("zero2", None, model=m, optimizer=opt, precision="fp32", bucket_mb=25.0,
                          world=world)   # ("zero2", None)
    """
    if strategy == "auto":  # see [Note: auto without a circle]
        return resolve_auto(AutoRequest(model=model, optimizer=optimizer, precision=precision,
                                        bucket_mb=bucket_mb, memory_budget=check_memory_budget(memory_budget),
                                        world=world))
    if memory_budget is not None:
        raise ValueError(f"memory_budget={memory_budget!r} is what strategy='auto' must fit in; "
                         f"with strategy={strategy!r} leave it out, or pass strategy='auto'")
    return strategy, None
