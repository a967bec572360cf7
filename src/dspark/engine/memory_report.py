"""``engine.memory_report()``: the bytes a rank really holds for parameters, gradients and optimizer
state (each storage counted once, [Note: storage bytes] in :mod:`dspark.tensor.storage`), next to
what the strategy should hold ([Note: expected bytes] in :mod:`dspark.policy.state_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from dspark.engine.param_slot import ParamSlot
from dspark.engine.validation import unique_params
from dspark.policy.state_bytes import expected_state_bytes, optimizer_state_elements
from dspark.policy.strategies import ShardingPolicy
from dspark.tensor.storage import storage_bytes

__all__ = ["frozen_held", "memory_report"]

def memory_report(*, policy: ShardingPolicy, slots: Sequence[ParamSlot],
                  frozen: Sequence[tuple[torch.Size, torch.dtype, torch.Tensor]],
                  optimizer: torch.optim.Optimizer, grads_bytes: int, comm_buffer_bytes: int, rank: int,
                  num_ranks: int, shard_rank: int | None = None,
                  shard_group_size: int | None = None) -> dict[str, int | str]:
    """``engine.memory_report()``: the bytes held for the trainable parameters of ``slots``, the
    ``frozen`` ones (``(shape, dtype, tensor held)`` each), the gradients (``grads_bytes``, as held at
    the end of the last backward) and ``optimizer``'s state, next to what ``policy`` should hold: a
    sharded part's share is the shard group's (``shard_rank`` of ``shard_group_size`` ranks; by
    default the world's, ``rank`` of ``num_ranks``), see [Note: hybrid sharding]."""
    rank = rank if shard_rank is None else shard_rank
    group_size = num_ranks if shard_group_size is None else shard_group_size
    params_actual = storage_bytes([*(s.held() for s in slots), *(t for _, _, t in frozen)])
    opt_state = optimizer_state_elements(optimizer)

    def expect(shapes: Iterable[tuple[torch.Size, torch.dtype]]) -> dict[str, int]:
        return expected_state_bytes((torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes),
                                    policy, rank=rank, num_ranks=group_size, optimizer_state=opt_state)

    expected = expect((s.shape, s.dtype) for s in slots)
    exp_params = expected["params"] + expect((shape, dtype) for shape, dtype, _ in frozen)["params"]
    exp_grads, exp_opt = expected["grads"], expected["optimizer"]
    opt_actual = storage_bytes(v for state in optimizer.state.values()
                               for v in state.values() if isinstance(v, torch.Tensor))
    report: dict[str, int | str] = {
        "strategy": policy.name,
        "num_ranks": num_ranks,
        "shard_group_size": group_size,
        "num_params": sum(s.numel for s in slots) + sum(math.prod(shape) for shape, _, _ in frozen),
        "num_trainable_params": sum(s.numel for s in slots),
        "params_bytes": params_actual,
        "params_bytes_expected": exp_params,
        "grads_bytes": grads_bytes,
        "grads_bytes_expected": exp_grads,
        "optimizer_bytes": opt_actual,
        "optimizer_bytes_expected": exp_opt,
        "comm_buffer_bytes": comm_buffer_bytes,
    }
    report["total_bytes"] = params_actual + grads_bytes + opt_actual
    report["total_bytes_expected"] = exp_params + exp_grads + exp_opt
    return report


def frozen_held(frozen_slots: Sequence[ParamSlot], module: nn.Module, *, shard_params: bool
                ) -> list[tuple[torch.Size, torch.dtype, torch.Tensor]]:
    """The frozen parameters as :func:`memory_report` reads them: ``(shape, dtype, tensor held)``.
    They have slots only where zero3 shards them (``shard_params``); elsewhere they stay as built.

    Example::

        memory_report(..., frozen=frozen_held([], model, shard_params=False), ...)
    """
    if shard_params:
        return [(s.shape, s.dtype, s.held()) for s in frozen_slots]
    return [(p.shape, p.dtype, p) for _, p in unique_params(module) if not p.requires_grad]
