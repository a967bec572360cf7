"""``Engine(strategy="auto")``: the engine asks the planner for the strategy it was not given.

[Note: auto as a plain function] The engine imports the planner and calls
:func:`dspark.planner.auto_choice.auto_choice`, a plain function that returns the choice (strategy,
micro-batch, the plan it came from); the engine is then built from it like any other. The planner
imports nothing of the engine: what both must agree on, the strategies and what each makes a rank
hold, zero3's units, the optimizer kernel and meta materialisation, lives below them
(:mod:`dspark.policy`, :mod:`dspark.meta`), so there is no circle, no registry and no import order
to get right (tests/test_layering.py holds the direction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dspark.comm import World
from dspark.engine.config import EngineConfig
from dspark.planner.auto_choice import AutoChoice, AutoRequest, auto_choice

__all__ = ["check_planned_rows", "strategy_and_plan"]


def strategy_and_plan(config: EngineConfig, *, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                      world: World, sample_batch: Any = None, loss_fn: Any = None) -> AutoChoice:
    """The engine's strategy by name and the plan it came from: ``config.strategy="auto"`` asks the
    planner for the fastest strategy that fits ``config.memory_budget`` bytes per rank (and, given
    ``sample_batch``, the micro-batch with it); any other name is kept, with no plan, and refuses
    ``sample_batch`` and ``loss_fn`` (only ``"auto"`` reads them).

    Example::

        strategy_and_plan(EngineConfig(strategy="zero2"), model=m, optimizer=opt,
                          world=world)   # AutoChoice(strategy="zero2", plan=None)
    """
    if config.strategy == "auto":  # see [Note: auto as a plain function]
        if loss_fn is not None and sample_batch is None:
            raise ValueError("loss_fn= is what strategy='auto' probes sample_batch= with; pass a sample "
                             "batch too, or leave loss_fn out")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (outputs, targets) -> loss, got "
                            f"{type(loss_fn).__name__}")
        return auto_choice(AutoRequest(model=model, optimizer=optimizer, precision=config.precision,
                                        bucket_mb=float(config.communication.bucket_mb),
                                        memory_budget=config.memory_budget, world=world,
                                        sample_batch=sample_batch, loss_fn=loss_fn,
                                        grad_accum_steps=config.grad_accum_steps,
                                        shard_group_size=config.communication.shard_group_size))
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
