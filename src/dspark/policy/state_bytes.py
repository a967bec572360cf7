"""What a strategy should make one rank hold, in bytes: the formula behind ``memory_report()``'s
expected column, the planner's model state and the lab's replication check.

[Note: expected bytes] With fp32 parameters and AdamW (two fp32 moments) the ZeRO formulas per
parameter element are: replicate 4 + 4 + 8 = 16 bytes; zero1 4 + 4 + 8/N; zero2 4 + (4 + 8)/N;
zero3 (4 + 4 + 8)/N. DSpark computes them from the shard arithmetic of each parameter (so padding to
equal chunks and uneven rows are exact), plus one 4-byte ``step`` scalar per parameter tensor that
torch's Adam-family optimizers keep.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dspark.policy.strategies import ShardingPolicy
from dspark.tensor.shard_math import chunk_size, shard_range

__all__ = ["expected_state_bytes", "optimizer_state_elements"]

# Per-element optimizer state tensors, and whether a per-tensor step scalar is kept.
_KNOWN_STATE: dict[str, tuple[int, bool]] = {
    "Adam": (2, True), "AdamW": (2, True), "Adamax": (2, True), "NAdam": (2, True),
    "RAdam": (2, True), "Adagrad": (1, True), "Adadelta": (2, True),
}


def optimizer_state_elements(optimizer: torch.optim.Optimizer) -> tuple[int, bool]:
    """``(state tensors per element, keeps a step scalar)`` for ``optimizer``.

    Known torch optimizers come from a table; others are read from the state they hold after a step
    (tensors shaped like their parameter count as per-element state)."""
    name = type(optimizer).__name__
    if name == "SGD":
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        return (1 if momentum else 0), False
    if name == "RMSprop":
        group = optimizer.param_groups[0]
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False)), True
    if name in _KNOWN_STATE:
        return _KNOWN_STATE[name]
    for param, state in optimizer.state.items():
        per_element = sum(1 for v in state.values()
                          if isinstance(v, torch.Tensor) and v.shape == param.shape and v.dim() > 0)
        has_step = any(isinstance(v, torch.Tensor) and v.dim() == 0 for v in state.values())
        return per_element, has_step
    return 0, False


def expected_state_bytes(params: Iterable[torch.Tensor], policy: ShardingPolicy, *, rank: int,
                         num_ranks: int, optimizer_state: tuple[int, bool]) -> dict[str, int]:
    """What ``policy`` should make one rank hold for ``params`` (any tensors with the parameters'
    shapes and dtypes, even on the meta device): ``{"params", "grads", "optimizer"}`` in bytes.

    ``optimizer_state`` is :func:`optimizer_state_elements`'s answer. Sharded parts use the padded
    chunk of rows (what a collective moves); optimizer state the rows this rank owns.

    Example::

        expected_state_bytes(model.parameters(), STRATEGIES["zero2"], rank=0, num_ranks=2,
                             optimizer_state=(2, True))
    """
    per_element, has_step = optimizer_state
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in params:
        itemsize = p.element_size()
        rows = p.shape[0] if p.dim() else 1
        row_numel = p.numel() // rows if rows else 0
        padded = chunk_size(rows, num_ranks) * row_numel * itemsize
        start, stop = shard_range(rows, num_ranks, rank)
        held = (stop - start) * row_numel if policy.shard_optimizer else p.numel()
        out["params"] += padded if policy.shard_params else p.numel() * itemsize
        out["grads"] += padded if policy.shard_grads else p.numel() * itemsize
        out["optimizer"] += per_element * held * itemsize + (4 if has_step and held else 0)
    return out
