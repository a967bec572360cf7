"""Sharded optimizer state refuses to load on a rank it does not belong to.

[Note: a rank's optimizer state dict] Under zero1, zero2 and zero3 on several ranks,
``engine.optimizer`` steps only this rank's rows, so its ``state_dict()`` holds this rank's shard
of the AdamW moments. A loop written for one process or DDP saves ``optimizer.state_dict()`` on
rank 0 and loads that file on every rank: rank 1 would then take rank 0's moments for its own rows
(the shapes often agree), and training would go on from a wrong state without a word. So the state
dict is stamped with the rank, the world size and the strategy that wrote it, and loading a stamped
state dict on another rank or world size (zero1-3 split rows by one rule, so the stage may differ)
is a ``ValueError`` that names both and the fix (``engine.save`` /
``engine.load``, which reshard at any world size). Each rank saving and loading its own file is
allowed; a state dict without the stamp (the engine's own, or one built by hand) loads as PyTorch
loads it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NOT_ELEMENTWISE", "STAMP_KEY", "check_elementwise", "guard_sharded_optimizer"]

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

STAMP_KEY = "dspark_shard"
"""The key :func:`guard_sharded_optimizer` adds to ``optimizer.state_dict()``."""


def guard_sharded_optimizer(optimizer: torch.optim.Optimizer, *, rank: int, world_size: int,
                            strategy: str) -> list[Any]:
    """Stamp ``optimizer``'s state dicts and check the stamp on load (see the module note); returns
    the hook handles."""
    mine = {"rank": rank, "world_size": world_size, "strategy": strategy}

    def stamp(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[STAMP_KEY] = dict(mine)
        return state_dict

    def check(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        found = state_dict.get(STAMP_KEY)
        if found is None:
            return state_dict
        # zero1, zero2 and zero3 split rows by one rule: the same rank of the same world size owns
        # the same rows whatever the stage
        if (found.get("rank"), found.get("world_size")) != (rank, world_size):
            raise ValueError(
                f"rank {rank}: this optimizer state dict holds the shard of rank {found.get('rank')} "
                f"of {found.get('world_size')} under strategy={found.get('strategy')!r}, and this "
                f"rank owns other rows (rank {rank} of {world_size}, strategy={strategy!r}): loading "
                "it would give these rows another rank's optimizer state. Save and load the "
                "optimizer with engine.save(path) / engine.load(path) (sharded, any world size and "
                "strategy), or let every rank save and load its own engine.optimizer.state_dict()")
        return {k: v for k, v in state_dict.items() if k != STAMP_KEY}

    return [optimizer.register_state_dict_post_hook(stamp),
            optimizer.register_load_state_dict_pre_hook(check)]
