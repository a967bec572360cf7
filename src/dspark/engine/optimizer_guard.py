"""A sharded optimizer's own ``state_dict()`` and ``load_state_dict()`` refuse to run, instead of
saving or loading part of the state without a word.

[Note: a rank's optimizer state dict] Under zero1, zero2 and zero3 on several ranks,
``engine.optimizer`` steps only this rank's rows, so its ``state_dict()`` holds this rank's part of
the AdamW moments (half of them on 2 ranks). A loop written for one process or DDP saves
``optimizer.state_dict()`` on rank 0 beside the model (nanoGPT's checkpoint): that file would hold
rank 0's half of the state, and a resume from it would train on with the other half missing or
taken from the wrong rows, all without an error. Returning the whole state instead would make
``state_dict()`` a collective, which a loop calls on rank 0 alone (``if master_process:``): that
rank would wait in it for ever. So both calls raise :class:`dspark.errors.ShardedOptimizerStateError`
on the rank that makes them, naming the calls that do the job: ``engine.save(path)`` /
``engine.load(path)`` (the whole state, sharded, at any world size and strategy), or
``engine.sharded_state_dict()`` for PyTorch's distributed checkpoint. The engine's own loading of
the state runs inside :meth:`ShardedOptimizerGuard.allowed`. On one rank, and under replicate, the
optimizer holds the whole state and its state dict is PyTorch's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from dspark.engine.own_calls import OwnCalls
from dspark.errors import ShardedOptimizerStateError

__all__ = ["NOT_ELEMENTWISE", "ShardedOptimizerGuard", "check_elementwise"]

NOT_ELEMENTWISE = {"Adafactor": "keeps factored row and column statistics of each whole parameter",
                   "LBFGS": "keeps a history of whole flattened gradients and steps with a closure"}
"""torch optimizers whose update of an element depends on other elements of the parameter: sharding
their state by rows (zero1-3) would compute it per shard and change the update."""


def check_elementwise(optimizer: torch.optim.Optimizer, *, strategy: str, after_step: bool) -> None:
    """Raise ``ValueError`` when ``optimizer`` cannot have its state sharded by rows: a known
    non-element-wise torch optimizer, or (``after_step``, the first step done) one whose state holds
    a tensor shaped unlike its parameter, which a shard could not be resharded from either."""
    name = type(optimizer).__name__
    why = NOT_ELEMENTWISE.get(name)
    if why is None and after_step:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                        why = (f"keeps state {key!r} of shape {tuple(value.shape)} for a parameter "
                               f"(shard) of shape {tuple(p.shape)}")
                        break
    if why is not None:
        raise ValueError(f"strategy={strategy!r} shards the optimizer state by rows, and {name} {why}: "
                         "sharded, it would compute that per shard and change the update (and no "
                         "checkpoint could reshard it). Use strategy='replicate' with it, or an "
                         "element-wise optimizer (AdamW, SGD, Adam, ...)")

class ShardedOptimizerGuard:
    """Hooks that make a sharded ``optimizer``'s ``state_dict()`` and ``load_state_dict()`` raise
    (see the module note); ``handles`` take them off.

    Example::

        guard = ShardedOptimizerGuard(optimizer, rank=0, world_size=2, strategy="zero2")
        optimizer.state_dict()        # ShardedOptimizerStateError naming engine.save(path)
        with guard.allowed():
            optimizer.load_state_dict(resharded)   # the engine's own loading
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, rank: int, world_size: int, strategy: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self._own = OwnCalls()
        self.handles = [optimizer.register_state_dict_pre_hook(self._saving),
                        optimizer.register_load_state_dict_pre_hook(self._loading)]

    def allowed(self) -> contextlib.AbstractContextManager[None]:
        """The engine's own calls, which handle the shards themselves."""
        return self._own.running()

    def _where(self) -> str:
        return (f"an optimizer sharded by strategy={self.strategy!r} on {self.world_size} ranks: it holds "
                f"and steps only rank {self.rank}'s rows of each parameter")

    def _saving(self, optimizer: torch.optim.Optimizer) -> None:
        if self._own:
            return
        raise ShardedOptimizerStateError(
            f"rank {self.rank}: optimizer.state_dict() of {self._where()}, so its state dict would hold "
            f"this rank's part of the state only, and torch.save of it (a DDP loop's checkpoint) would "
            f"write part of the optimizer without a word. {_FIXES}")

    def _loading(self, optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
        if self._own:
            return
        raise ShardedOptimizerStateError(
            f"rank {self.rank}: optimizer.load_state_dict() into {self._where()}, and a state dict saved "
            f"by one process, by DDP or by another rank holds other rows (or whole tensors): these "
            f"rows would train on with state that is not theirs. {_FIXES}")


_FIXES = ("Save with engine.save(path, extra={...}) on every rank (the whole state, sharded, with the "
          "model, the step and the extras) and resume with engine.load(path), at any world size and "
          "strategy; for PyTorch's distributed checkpoint, engine.sharded_state_dict() and "
          "engine.load_sharded_state_dict(sd). Under strategy='replicate' the optimizer holds the whole "
          "state and its own state_dict() is PyTorch's.")
