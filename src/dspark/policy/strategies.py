"""Strategy and precision as frozen policy values: what the one engine shards, and in which dtypes it
computes. [Note: ZeRO as policy] The engine has a single code path; each stage only flips what is
sharded: optimizer state (zero1), + gradients (zero2), + parameters (zero3). A hybrid strategy
(``hybrid-zero1/2/3``) is the same stage with one more value, ``hybrid``: what the stage shards is
split over a shard group (a node's ranks) instead of the world, and the groups replicate it (see
[Note: hybrid sharding] in :mod:`dspark.policy.rank_groups`)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dspark.tensor import Placement, Replicate, Shard

__all__ = ["HYBRID_STRATEGIES", "PRECISIONS", "STRATEGIES", "PrecisionPolicy", "ShardingPolicy",
           "all_strategies", "precision_policy", "sharding_policy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingPolicy:
    name: str
    shard_optimizer: bool
    """Each rank keeps optimizer state for its shard of every parameter only."""
    shard_grads: bool
    """Gradients are reduce-scattered; each rank keeps its shard only."""
    shard_params: bool
    """Parameters live as shards, gathered just in time for forward/backward and freed after."""
    hybrid: bool = False
    """What the stage shards is split over a shard group (a node's ranks, or ``shard_group_size``),
    not the world; the shard groups hold replicas of each other, and each gradient shard is also
    all-reduced across them (the replica group)."""

    def __str__(self) -> str:
        return self.name

    def splits_optimizer_on(self, num_ranks: int) -> bool:
        """Whether optimizer state is really split on ``num_ranks`` ranks (hybrid: its shard
        group's): a sharding strategy on more than one (on one rank every strategy holds everything,
        and has no peer to check or gather).

        Example::

            STRATEGIES["zero1"].splits_optimizer_on(2), STRATEGIES["zero1"].splits_optimizer_on(1)   # True, False
        """
        return self.shard_optimizer and num_ranks > 1

    def splits_params_on(self, num_ranks: int) -> bool:
        """Whether parameters are really split on ``num_ranks`` ranks (zero3 on more than one); else
        every rank keeps each parameter whole, in place."""
        return self.shard_params and num_ranks > 1

    @property
    def stage(self) -> str:
        """The ZeRO stage inside a shard group: ``"zero3"`` for ``hybrid-zero3`` and for ``zero3``."""
        return self.name.removeprefix("hybrid-")

    def placements(self, names: Sequence[str]) -> dict[str, dict[str, Placement]]:
        """How parameters ``names``, their gradients and their optimizer state are laid out across
        ranks (``engine.placements()``): ``Shard(dim=0)`` where this policy shards, ``Replicate()``
        where it does not."""
        def layout(sharded: bool) -> dict[str, Placement]:
            return {name: (Shard(0) if sharded else Replicate()) for name in names}

        return {"params": layout(self.shard_params), "grads": layout(self.shard_grads),
                "optimizer_state": layout(self.shard_optimizer)}


STRATEGIES: dict[str, ShardingPolicy] = {
    "replicate": ShardingPolicy(name="replicate", shard_optimizer=False, shard_grads=False, shard_params=False),
    "zero1": ShardingPolicy(name="zero1", shard_optimizer=True, shard_grads=False, shard_params=False),
    "zero2": ShardingPolicy(name="zero2", shard_optimizer=True, shard_grads=True, shard_params=False),
    "zero3": ShardingPolicy(name="zero3", shard_optimizer=True, shard_grads=True, shard_params=True),
}
"""The ZeRO stages over the whole world (the strategies every engine test covers)."""

HYBRID_STRATEGIES: dict[str, ShardingPolicy] = {
    f"hybrid-{name}": ShardingPolicy(name=f"hybrid-{name}", shard_optimizer=True, shard_grads=p.shard_grads,
                                     shard_params=p.shard_params, hybrid=True)
    for name, p in STRATEGIES.items() if p.shard_optimizer
}
"""zero1/2/3 inside a shard group, replicated across groups (``engine.strategy.stage`` names the stage)."""


def all_strategies() -> dict[str, ShardingPolicy]:
    """Every strategy by name: :data:`STRATEGIES`, then :data:`HYBRID_STRATEGIES`.

    Example::

        list(all_strategies())[-1]   # "hybrid-zero3"
    """
    return {**STRATEGIES, **HYBRID_STRATEGIES}


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisionPolicy:
    name: str
    compute_dtype: torch.dtype | None
    """Autocast dtype for forward/backward; None computes in the parameters' dtype (fp32)."""
    loss_scaling: bool
    """Dynamic loss scaling (fp16: its range is too small for small gradients)."""

    def __str__(self) -> str:
        return self.name

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` to ``compute_dtype`` on ``device_type`` (nothing under fp32).

        Example::

            with PRECISIONS["bf16"].autocast("cpu"):
                y = model(x)   # bf16 matmuls
        """
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)


PRECISIONS: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy(name="fp32", compute_dtype=None, loss_scaling=False),
    "bf16": PrecisionPolicy(name="bf16", compute_dtype=torch.bfloat16, loss_scaling=False),
    "fp16": PrecisionPolicy(name="fp16", compute_dtype=torch.float16, loss_scaling=True),
}


def sharding_policy(strategy: str | ShardingPolicy) -> ShardingPolicy:
    if isinstance(strategy, ShardingPolicy):
        return strategy
    known = all_strategies()
    try:
        return known[strategy]
    except (KeyError, TypeError):
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(map(repr, known))}") from None


def precision_policy(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    if isinstance(precision, PrecisionPolicy):
        return precision
    try:
        return PRECISIONS[precision]
    except (KeyError, TypeError):
        raise ValueError(f"precision={precision!r} is not one of {', '.join(map(repr, PRECISIONS))}") from None
