"""Memory accounting: the bytes a rank really holds for parameters, gradients and optimizer state
(measured by walking the tensors, each storage counted once), next to what the strategy should hold.

[Note: expected bytes] With fp32 parameters and AdamW (two fp32 moments) the ZeRO formulas per
parameter element are: replicate 4 + 4 + 8 = 16 bytes; zero1 4 + 4 + 8/N; zero2 4 + (4 + 8)/N;
zero3 (4 + 4 + 8)/N. DSpark computes them from the shard arithmetic of each parameter (so padding to
equal chunks and uneven rows are exact), plus one 4-byte ``step`` scalar per parameter tensor that
torch's Adam-family optimizers keep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from dspark.engine.param_slot import ParamSlot
from dspark.engine.policy import ShardingPolicy
from dspark.engine.validation import unique_params
from dspark.tensor.shard_math import chunk_size, shard_range

__all__ = ["expected_state_bytes", "frozen_held", "memory_report", "optimizer_state_elements", "storage_bytes"]

# Per-element optimizer state tensors, and whether a per-tensor step scalar is kept.
_KNOWN_STATE: dict[str, tuple[int, bool]] = {
    "Adam": (2, True), "AdamW": (2, True), "Adamax": (2, True), "NAdam": (2, True),
    "RAdam": (2, True), "Adagrad": (1, True), "Adadelta": (2, True),
}


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once). Pass the
    same ``seen`` set to several calls to count a storage only in the first that meets it."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except RuntimeError:  # a storage freed in place (FSDP2's resharded parameters): holds nothing
            continue
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


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


def memory_report(*, policy: ShardingPolicy, slots: Sequence[ParamSlot],
                  frozen: Sequence[tuple[torch.Size, torch.dtype, torch.Tensor]],
                  optimizer: torch.optim.Optimizer, grads_bytes: int, comm_buffer_bytes: int, rank: int,
                  num_ranks: int) -> dict[str, int | str]:
    """``engine.memory_report()``: the bytes held for the trainable parameters of ``slots``, the
    ``frozen`` ones (``(shape, dtype, tensor held)`` each), the gradients (``grads_bytes``, as held at
    the end of the last backward) and ``optimizer``'s state, next to what ``policy`` should hold."""
    params_actual = storage_bytes([*(s.padded_shard if s.padded_shard is not None else s.param
                                     for s in slots), *(t for _, _, t in frozen)])
    opt_state = optimizer_state_elements(optimizer)

    def expect(shapes: Iterable[tuple[torch.Size, torch.dtype]]) -> dict[str, int]:
        return expected_state_bytes((torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes),
                                    policy, rank=rank, num_ranks=num_ranks, optimizer_state=opt_state)

    expected = expect((s.shape, s.dtype) for s in slots)
    exp_params = expected["params"] + expect((shape, dtype) for shape, dtype, _ in frozen)["params"]
    exp_grads, exp_opt = expected["grads"], expected["optimizer"]
    opt_actual = storage_bytes(v for state in optimizer.state.values()
                               for v in state.values() if isinstance(v, torch.Tensor))
    report: dict[str, int | str] = {
        "strategy": policy.name,
        "num_ranks": num_ranks,
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
        return [(s.shape, s.dtype, s.padded_shard if s.padded_shard is not None else s.param)
                for s in frozen_slots]
    return [(p.shape, p.dtype, p) for _, p in unique_params(module) if not p.requires_grad]
