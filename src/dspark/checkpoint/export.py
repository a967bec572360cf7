"""Weights out of a DSpark checkpoint, offline: no process group, whatever strategy and world size
wrote it (what ``dspark ckpt export`` and ``dspark ckpt info`` run).

[Note: offline export] The model's tensors are the checkpoint's ``model/<name>`` entries (see
[Note: checkpoint layout]); DCP's metadata gives each one's global shape and dtype, so the output is
planned before any data is read. Each output shard is then read through DCP itself (its
file-system reader with DSpark's safety checks, :func:`dspark.checkpoint.storage.read_state`, with
a whole tensor as the destination: DCP assembles it from every rank's chunks), cast if asked, and
written: at any time the process holds one output shard (at least the largest tensor). Names lose
the ``model/`` prefix; a 0-d parameter, saved as shape ``(1,)`` to be split along dim 0, gets its
shape ``()`` back from ``dspark.json``'s ``scalar_params``. A tied parameter is saved once, under
its first name, as HuggingFace stores it. A single ``.safetensors`` file or a ``.pt`` file is one
shard: the whole model in memory.

Example::

    export_checkpoint("ckpt/latest", "out/")                     # HuggingFace-style directory
    export_checkpoint("ckpt/latest", "model.safetensors", dtype=torch.bfloat16)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dspark.checkpoint import layout, storage
from dspark.checkpoint.hf_files import ShardWriter, parse_size, plan_shards, tensor_bytes
from dspark.checkpoint.info import CheckpointInfo, read_checkpoint_info

__all__ = ["DTYPES", "ModelTensor", "export_checkpoint", "model_tensors"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
"""Names ``--dtype`` accepts."""

_PREFIX = layout.model_key("")


@dataclass(frozen=True, slots=True)
class ModelTensor:
    """One tensor of a checkpoint's model, from its metadata."""

    name: str
    """As in the model's ``state_dict()`` (no ``model/`` prefix)."""
    saved_shape: tuple[int, ...]
    """Its shape in DCP's files (a 0-d parameter as ``(1,)``)."""
    shape: tuple[int, ...]
    """Its shape in the model."""
    dtype: torch.dtype


def model_tensors(directory: Path, info: CheckpointInfo) -> list[ModelTensor]:
    """Every ``model/`` tensor of the checkpoint in ``directory``, in the order it was saved.

    Example::

        [t.name for t in model_tensors(Path("ckpt"), read_checkpoint_info("ckpt"))]   # ['w', 'b']
    """
    metadata = storage.read_metadata(directory)
    scalars = set(info.scalar_params)
    out = []
    for key, meta in metadata.state_dict_metadata.items():
        if not key.startswith(_PREFIX) or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key[len(_PREFIX):]
        saved = tuple(meta.size)
        shape = () if name in scalars and saved == (1,) else saved
        out.append(ModelTensor(name, saved, shape, meta.properties.dtype))
    return out


def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                      verify: bool = True) -> list[Path]:
    """Write the model of the DSpark checkpoint at ``path`` to ``out``: a ``.safetensors`` file, a
    ``.pt`` file (``torch.save`` of the state dict), or else a directory in HuggingFace's layout
    (see [Note: HuggingFace layout]). ``dtype`` casts floating-point tensors. No process group is
    needed. Returns the files written. Raises ``FileExistsError`` when ``out`` is a file or a
    non-empty directory. ``verify=False`` reads a checkpoint without a manifest (see
    :func:`~dspark.checkpoint.read_checkpoint_info`).

    Example::

        export_checkpoint("ckpt/step-1000", "gpt2-finetuned/", dtype=torch.bfloat16)
    """
    directory = Path(path)
    info = read_checkpoint_info(directory, verify=verify)
    metadata = storage.read_metadata(directory)
    storage.check_files(directory, metadata)
    tensors = model_tensors(directory, info)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is not a floating-point dtype (valid: {sorted(DTYPES)})")
    target = Path(out)
    kind = target.suffix if target.suffix in (".safetensors", ".pt") else "directory"
    _check_free(target, kind)

    def out_dtype(t: ModelTensor) -> torch.dtype:
        return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype

    by_name = {t.name: t for t in tensors}
    sizes = [(t.name, tensor_bytes(t.shape, out_dtype(t))) for t in tensors]
    one_file = kind != "directory"
    plan = [[t.name for t in tensors]] if one_file else plan_shards(sizes, max_shard_bytes=parse_size(max_shard_size))

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        state = {layout.model_key(n): torch.empty(by_name[n].saved_shape, dtype=by_name[n].dtype)
                 for n in names}
        storage.read_state(state, directory, metadata, distributed=False)
        return {n: state[layout.model_key(n)].reshape(by_name[n].shape).to(out_dtype(by_name[n]))
                for n in names}

    if kind == ".pt":
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(read(plan[0]), target)
        return [target]
    writer = ShardWriter(target, plan, single_file=target if kind == ".safetensors" else None)
    for names in plan:
        for name, value in read(names).items():
            writer.add(name, value)
    return writer.finish()


def _check_free(target: Path, kind: str) -> None:
    if kind == "directory":
        if target.is_file():
            raise FileExistsError(f"{str(target)!r} is a file; give a new or empty directory, or a path "
                                  "ending in .safetensors or .pt")
        if target.is_dir() and any(target.iterdir()):
            raise FileExistsError(f"{str(target)!r} is a directory that is not empty; give a new or "
                                  "empty one")
    elif target.exists():
        raise FileExistsError(f"{str(target)!r} exists; remove it first or give another path")
