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
from a checkpoint in [Note: loading runs no code] (:mod:`dspark.checkpoint.safe_metadata`).
"""

from dspark.checkpoint.background import pending_save_path, wait_for_pending_save
from dspark.checkpoint.errors import CheckpointError, CheckpointNotFoundError, CheckpointSaveError
from dspark.checkpoint.info import CheckpointInfo, is_checkpoint, read_checkpoint_info
from dspark.checkpoint.load import load_checkpoint
from dspark.checkpoint.offline import read_extra
from dspark.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "is_checkpoint",
    "load_checkpoint",
    "pending_save_path",
    "read_checkpoint_info",
    "read_extra",
    "save_checkpoint",
    "wait_for_pending_save",
]
