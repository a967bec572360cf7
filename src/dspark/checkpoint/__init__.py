"""Sharded checkpoints on PyTorch's distributed checkpoint (DCP): every rank writes its own shards,
any world size and any strategy can load them, and a save is published atomically.

Example::

    engine.save("ckpt/latest")          # collective; replaces ckpt/latest once the new one is whole
    info = engine.load("ckpt/latest")   # at another world size or strategy just as well
    info.step_count, info.world_size, info.strategy
    engine.save("ckpt/step-200", async_save=True)   # written in the background
    dspark.checkpoint.wait_for_pending_save()       # optional: the next save/load/shutdown waits too

The layout is described in [Note: checkpoint layout] (:mod:`dspark.checkpoint.layout`), atomic
publication in [Note: atomic save] (:mod:`dspark.checkpoint.atomic`), background writes in
[Note: asynchronous save] (:mod:`dspark.checkpoint.background`), and why loading never runs code
from a checkpoint in [Note: loading runs no code] (:mod:`dspark.checkpoint.safe_metadata`), and how a
load refuses a file its save did not write in [Note: checkpoint integrity]
(:mod:`dspark.checkpoint.manifest`).

PyTorch's DCP (``torch.distributed.checkpoint``, with DTensor behind it) takes seconds to import, so
the functions that need it are imported on first use: ``import dspark`` does not pay for it in a
process that never saves or loads.
"""

import importlib
from typing import TYPE_CHECKING, Any

from dspark.checkpoint.background import pending_save_path, wait_for_pending_save
from dspark.checkpoint.info import CheckpointInfo, is_checkpoint, read_checkpoint_info
from dspark.checkpoint.verify import VerifyReport, verify_checkpoint
from dspark.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointSaveError,
)

if TYPE_CHECKING:
    from dspark.checkpoint.load import load_checkpoint
    from dspark.checkpoint.offline import read_extra
    from dspark.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointIntegrityError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "VerifyReport",
    "is_checkpoint",
    "load_checkpoint",
    "pending_save_path",
    "read_checkpoint_info",
    "read_extra",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_save",
]

_MODULE_OF = {"load_checkpoint": "load", "read_extra": "offline", "save_checkpoint": "save"}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dspark.checkpoint.{module}"), name)
