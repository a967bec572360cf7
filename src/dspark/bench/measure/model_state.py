"""The model state a rank really holds, found by walking the objects a user can reach, next to what
its strategy should hold.

[Note: held, not allocated] An engine's own report can only count the tensors it means to hold,
with the arithmetic it allocated them by, so it agrees with the formula by construction. Here the
bench walks what is reachable from the outside: every parameter and buffer of the module, their
``.grad``, the tensors the optimizer updates and their ``.grad``, and the optimizer's state. Each
storage counts once, in the first part it is found in ([Note: storage bytes] in
:mod:`dspark.tensor.storage`). So a
zero3 parameter left gathered after its block ran shows up as the parameter's whole storage, on top
of the shard the optimizer updates.

What it cannot see: tensors only C++ holds (DDP's reducer buckets, an engine's private flat
buffers). The rank's peak RSS, recorded beside, covers those.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from dspark.engine import STRATEGIES
from dspark.engine.for_the_lab import expected_state_bytes, optimizer_state_elements, storage_bytes

__all__ = ["expected_model_state", "held_model_state", "param_specs"]

ParamSpec = tuple[tuple[int, ...], torch.dtype]


def param_specs(model: nn.Module) -> list[ParamSpec]:
    """``(shape, dtype)`` of each trainable parameter of ``model``, tied ones once: read it before
    an engine shards the parameters in place.

    Example::

        param_specs(torch.nn.Linear(3, 2))   # [((2, 3), torch.float32), ((2,), torch.float32)]
    """
    return [(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad]


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _grads(params: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    for p in params:
        if p.grad is not None:
            yield p.grad


def held_model_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the storages this rank holds for ``{"params", "grads", "optimizer", "buffers"}``
    (see [Note: held, not allocated]). Call it between ``backward`` and ``step`` to count the
    gradients a step holds.

    Example::

        held_model_state(engine.module, engine.optimizer)["params"]
    """
    params = list(module.parameters())
    opt_params = list(_optimizer_params(optimizer))
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    parts = {"params": [*params, *opt_params], "grads": [*_grads(params), *_grads(opt_params)],
             "optimizer": state, "buffers": list(module.buffers())}
    seen: set[int] = set()  # each storage in the first part it is found in
    return {part: storage_bytes(tensors, seen) for part, tensors in parts.items()}


def expected_model_state(specs: Iterable[ParamSpec], strategy: str, optimizer: torch.optim.Optimizer,
                         *, rank: int, num_ranks: int) -> dict[str, int]:
    """What ``strategy``'s formula says rank ``rank`` holds for parameters of ``specs``:
    ``{"params", "grads", "optimizer"}`` in bytes (see :mod:`dspark.policy.state_bytes`).

    Example::

        expected_model_state(param_specs(model), "zero3", engine.optimizer, rank=0, num_ranks=2)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    metas = (torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs)
    return expected_state_bytes(metas, STRATEGIES[strategy], rank=rank, num_ranks=num_ranks,
                                optimizer_state=optimizer_state_elements(optimizer))
