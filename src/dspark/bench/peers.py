"""PyTorch's own data-parallel wrappers, measured by the same worker as DSpark's engine, so a
claim like "DSpark's zero3 is as fast as FSDP2" is a measurement side by side, not a belief.

=============  ===================================================  ===================
peer           PyTorch tool                                         DSpark counterpart
=============  ===================================================  ===================
``torch-ddp``  ``torch.nn.parallel.DistributedDataParallel``        ``replicate``
``torch-fsdp2`` ``torch.distributed.fsdp.fully_shard`` per block    ``zero3``
=============  ===================================================  ===================

Both run the model the way DSpark does: fp32 parameters and AdamW, autocast for bf16, the same
global batch split the same way. FSDP2 wraps the same units as DSpark's zero3 (the model's
repeated blocks, then the root).

[Note: why this file uses torch.distributed directly] DSpark's own code reaches the process group
only through :mod:`dspark.comm`. A peer is the reference DSpark is measured against, so it must be
PyTorch's code path untouched; it still runs on the process group ``dspark.init`` created.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dspark.comm import World
from dspark.comm.stats import wire_bytes
from dspark.engine.batch_check import DEFAULT_BATCH_CHECK_EVERY
from dspark.engine.memory import expected_state_bytes, optimizer_state_elements, storage_bytes
from dspark.engine.policy import STRATEGIES, precision_policy

__all__ = ["PEERS", "PeerEngine"]

PEERS: dict[str, str] = {"torch-ddp": "replicate", "torch-fsdp2": "zero3"}
"""Peer name -> the DSpark strategy it is compared with."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class PeerEngine:
    """The slice of :class:`dspark.Engine`'s surface the benchmark worker uses, on a PyTorch wrapper.

    Example::

        engine = PeerEngine("torch-ddp", model, world, lr=3e-4, precision="bf16")
        engine.backward(loss_fn(engine(x), y)); engine.step()
    """

    def __init__(self, name: str, model: nn.Module, world: World, *, lr: float, precision: str) -> None:
        if name not in PEERS:
            raise ValueError(f"peer={name!r} is not one of {', '.join(map(repr, PEERS))}")
        policy = precision_policy(precision)
        if policy.loss_scaling:
            raise ValueError(f"peer {name!r} is measured in fp32 or bf16; precision={precision!r} "
                             "would need PyTorch's GradScaler, which DSpark's comparison does not model")
        self.name = name
        self.world = world
        self._compute_dtype = policy.compute_dtype
        self._params = list(model.parameters())
        self._num_elements = [(p.shape, p.dtype) for p in self._params]
        if name == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [world.device.index] if world.device.type == "cuda" else None
            self.module: nn.Module = DistributedDataParallel(model, device_ids=device_ids)
        else:
            from torch.distributed.fsdp import fully_shard

            from dspark.comm import device_mesh
            from dspark.engine.zero3_units import unit_modules

            mesh = device_mesh()
            for _, unit in reversed(unit_modules(model)[1:]):  # blocks first, the root last
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.module = model
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr)
        self._grads_bytes = 0

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.world.device.type, dtype=self._compute_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._autocast():
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self._grads_bytes = storage_bytes(
            _local(p.grad) for p in self.module.parameters() if p.grad is not None)

    def step(self) -> bool:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def memory_report(self) -> dict[str, int | str]:
        """Measured like :meth:`dspark.Engine.memory_report`; expected by the counterpart's formula."""
        params = storage_bytes(_local(p) for p in self.module.parameters())
        optimizer = storage_bytes(_local(v) for state in self.optimizer.state.values()
                                  for v in state.values() if isinstance(v, torch.Tensor))
        expected = expected_state_bytes(
            (torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in self._num_elements),
            STRATEGIES[PEERS[self.name]], rank=self.world.rank, num_ranks=self.world.world_size,
            optimizer_state=optimizer_state_elements(self.optimizer))
        return {
            "strategy": self.name, "num_ranks": self.world.world_size,
            "params_bytes": params, "params_bytes_expected": expected["params"],
            "grads_bytes": self._grads_bytes, "grads_bytes_expected": expected["grads"],
            "optimizer_bytes": optimizer, "optimizer_bytes_expected": expected["optimizer"],
            "total_bytes": params + self._grads_bytes + optimizer,
            "total_bytes_expected": sum(expected.values()),
        }

    def estimated_traffic_per_step(self) -> tuple[int, int]:
        """``(payload bytes, ring wire bytes)`` one rank sends per step. PyTorch's wrappers bypass
        DSpark's byte counters, so this follows from their algorithms: DDP all-reduces every
        gradient once; FSDP2 all-gathers every parameter twice (forward, backward) and
        reduce-scatters every gradient once."""
        n = self.world.world_size
        if n == 1:
            return 0, 0
        total = sum(torch.empty(shape, dtype=dtype, device="meta").nbytes
                    for shape, dtype in self._num_elements)
        if self.name == "torch-ddp":
            return total, wire_bytes("all_reduce", total, n)
        shard = total // n
        return (2 * shard + total,
                2 * wire_bytes("all_gather", shard, n) + wire_bytes("reduce_scatter", total, n))

    def close(self) -> None:
        self.optimizer.state.clear()
        self.module = nn.Module()
        self._params = []


def make_engine(strategy: str, model: nn.Module, world: World, *, lr: float,
                precision: str, batch_check: bool = True) -> Any:
    """DSpark's engine for a DSpark strategy, a :class:`PeerEngine` for a peer name.
    ``batch_check=False`` turns off DSpark's replicated-batch error, for the seed suite's batch
    replicated on purpose (the bench then reports it as an anomaly instead)."""
    if strategy in PEERS:
        return PeerEngine(strategy, model, world, lr=lr, precision=precision)
    import dspark

    factory: Callable[..., torch.optim.Optimizer] = functools.partial(torch.optim.AdamW, lr=lr)
    return dspark.Engine(model, optimizer=factory, strategy=strategy, precision=precision,
                         batch_check_every=DEFAULT_BATCH_CHECK_EVERY if batch_check else None)
