"""``Engine(strategy="auto")``: where the engine asks for a strategy it was not given.

[Note: auto without a circle] The choice needs the planner (:mod:`dspark.plan`), which reads the
engine's own formulas; the engine must not import it back. So the planner registers its resolver
here when it is imported (the package imports it with ``dspark.Engine``), and the engine calls
whatever is registered. The engine depends on a function type, never on the planner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.comm import World
from dspark.engine.config import EngineConfig

__all__ = ["AutoChoice", "AutoRequest", "AutoResolver", "check_planned_rows", "resolve_auto",
           "set_auto_resolver", "strategy_and_plan"]


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
    sample_batch: Any = None
    """One step's batch as this rank's loop gets it (before any split into micro-batches); None:
    no batch at construction, so no micro-batch is chosen (see [Note: what auto knows])."""
    loss_fn: Callable[..., torch.Tensor] | None = None
    """``loss_fn(model(inputs), targets)`` for ``sample_batch = (inputs, targets)``; None: the model
    returns its loss."""
    grad_accum_steps: int | None = None
    """The loop's own accumulation when the user set it (the micro-batch is then fixed); None: the
    resolver may choose it with the micro-batch."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoChoice:
    """What ``strategy="auto"`` chose, the same on every rank."""

    strategy: str
    plan: Any
    """The :class:`dspark.plan.Plan` the choice came from (None: a strategy given by name)."""
    grad_accum_steps: int | None = None
    """Micro-batches per step auto planned (None: not chosen, no sample batch)."""
    micro_batch: int | None = None
    """Rows per forward auto planned on each rank (None: not chosen)."""


AutoResolver = Callable[[AutoRequest], AutoChoice]
"""``request -> choice``: the same choice on every rank."""

_resolver: list[AutoResolver] = []


def set_auto_resolver(resolver: AutoResolver) -> None:
    """Register the function ``strategy="auto"`` calls (the planner does, on import)."""
    _resolver[:] = [resolver]


def resolve_auto(request: AutoRequest) -> AutoChoice:
    """The registered resolver's choice for ``request``.

    Example::

        strategy, plan = resolve_auto(AutoRequest(model=m, optimizer=opt, precision="fp32",
                                                  bucket_mb=25.0, memory_budget=None, world=world))
    """
    if not _resolver:
        raise RuntimeError("strategy='auto' needs the planner: build the engine as dspark.Engine (which "
                           "imports it), or import dspark.plan first, or pass a strategy by name")
    return _resolver[0](request)


def strategy_and_plan(config: EngineConfig, *, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                      world: World, sample_batch: Any = None, loss_fn: Any = None) -> AutoChoice:
    """The engine's strategy by name and the plan it came from: ``config.strategy="auto"`` asks the
    resolver for the fastest strategy that fits ``config.memory_budget`` bytes per rank (and, given
    ``sample_batch``, the micro-batch with it); any other name is kept, with no plan, and refuses
    ``sample_batch`` and ``loss_fn`` (only ``"auto"`` reads them).

    Example::

        strategy_and_plan(EngineConfig(strategy="zero2"), model=m, optimizer=opt,
                          world=world)   # AutoChoice(strategy="zero2", plan=None)
    """
    if config.strategy == "auto":  # see [Note: auto without a circle]
        if loss_fn is not None and sample_batch is None:
            raise ValueError("loss_fn= is what strategy='auto' probes sample_batch= with; pass a sample "
                             "batch too, or leave loss_fn out")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (outputs, targets) -> loss, got "
                            f"{type(loss_fn).__name__}")
        return resolve_auto(AutoRequest(model=model, optimizer=optimizer, precision=config.precision,
                                        bucket_mb=float(config.communication.bucket_mb),
                                        memory_budget=config.memory_budget, world=world,
                                        sample_batch=sample_batch, loss_fn=loss_fn,
                                        grad_accum_steps=config.grad_accum_steps))
    for name, value in (("sample_batch", sample_batch), ("loss_fn", loss_fn)):
        if value is not None:
            raise ValueError(f"{name}=<{type(value).__name__}> is what strategy='auto' plans with; with "
                             f"strategy={config.strategy!r} leave it out, or pass strategy='auto'")
    return AutoChoice(strategy=config.strategy, plan=None)


def check_planned_rows(rows: int | None, micro_batch: int, grad_accum_steps: int) -> None:
    """Refuse a training forward of more ``rows`` than the ``micro_batch`` auto planned: the plan's
    memory holds only at that size, and a loop that feeds the whole batch would meet the peak the
    choice was made to avoid. Fewer rows (an epoch's last batch) pass; the engine asks for training
    forwards only (a reader of its recorded inputs, see [Note: forward inputs]).

    Example::

        check_planned_rows(64, micro_batch=16, grad_accum_steps=4)   # ValueError
    """
    if rows is not None and rows > micro_batch:
        raise ValueError(f"a forward of {rows} rows on this rank, but strategy='auto' planned micro-batches "
                         f"of {micro_batch} (grad_accum_steps={grad_accum_steps}) to fit the memory budget; "
                         "split each step's batch: for x, y in engine.micro_batches(batch): ...")
