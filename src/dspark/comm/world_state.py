"""The world this process belongs to, once :func:`dspark.comm.init` has run: kept here, below both
the collectives (which read it) and the lifecycle in :mod:`dspark.comm.world` (which sets it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.errors import NotInitializedError

__all__ = ["World", "get_world", "is_initialized", "set_world"]


@dataclass(frozen=True, slots=True, kw_only=True)
class World:
    """Where this process stands in the job. ``backend == "none"`` is the single-process stand-in
    (no process group: every collective is a no-op)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when a real process group exists (even of one rank)."""
        return self.backend != "none"


_world: World | None = None


def set_world(world: World | None) -> None:
    """Record the world :func:`dspark.comm.init` joined (``None`` once it is left). Only the
    lifecycle in :mod:`dspark.comm.world` calls this."""
    global _world
    _world = world


def is_initialized() -> bool:
    return _world is not None


def get_world() -> World:
    """The current :class:`World`; raises :class:`dspark.NotInitializedError` before ``init``."""
    if _world is None:
        raise NotInitializedError(
            "DSpark is not initialised: call dspark.init() first (it runs as a single process "
            "when not started by `dspark run`)"
        )
    return _world
