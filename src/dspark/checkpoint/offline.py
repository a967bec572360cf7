"""Reading a checkpoint without an engine or a process group: what it holds (``dspark ckpt info``)
and the user's own ``extra`` values, needed before the model can be built (nanoGPT keeps its
``model_args`` there).

Example::

    model_args = dspark.checkpoint.read_extra("ckpt/latest", "model_args")
    model = GPT(GPTConfig(**model_args))
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dspark.checkpoint import extra_state, layout, storage
from dspark.checkpoint.hf_files import tensor_bytes
from dspark.checkpoint.info import CheckpointInfo, read_checkpoint_info
from dspark.checkpoint.training_state import read_training_state
from dspark.errors import CheckpointError

__all__ = ["CheckpointSummary", "ModelTensor", "model_tensors", "read_extra", "summarize_checkpoint"]

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


def read_extra(path: str | os.PathLike[str], key: str, *, verify: bool = True) -> Any:
    """The value saved as ``engine.save(path, extra={key: value})``, read from the checkpoint alone
    (no engine, no process group): a plain dict comes back as it was saved, an object's
    ``state_dict()`` as that dict; tensors inside it are read too. ``KeyError`` (naming the keys
    there are) when the checkpoint has no such entry. ``verify=False`` reads a checkpoint without a
    manifest (see :func:`~dspark.checkpoint.read_checkpoint_info`).

    Example::

        engine.save("ckpt", extra={"model_args": {"n_layer": 12, "n_embd": 768}})
        dspark.checkpoint.read_extra("ckpt", "model_args")   # {'n_layer': 12, 'n_embd': 768}
    """
    directory = Path(path)
    read_checkpoint_info(directory, verify=verify)  # a clear error when it is no checkpoint
    training = read_training_state(directory)
    if key not in training.extra:
        raise KeyError(f"checkpoint {str(directory)!r} holds no extra entry {key!r}; it holds "
                       f"{sorted(training.extra)!r} (saved with engine.save(path, extra={{...}}))")
    value = training.extra[key]
    refs: dict[str, torch.Tensor] = {}
    _collect_refs(value, refs)
    if refs:
        metadata = storage.read_metadata(directory)
        entries = metadata.state_dict_metadata
        for ref in list(refs):
            meta = entries.get(ref)
            if not isinstance(meta, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {str(directory)!r}: extra[{key!r}] refers to tensor "
                                      f"{ref!r}, which its files do not hold")
            refs[ref] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        storage.read_state(refs, directory, metadata, distributed=False)
    return extra_state.restore_tensors(value, refs)


def _collect_refs(value: Any, refs: dict[str, torch.Tensor]) -> None:
    if isinstance(value, extra_state.TensorRef):
        refs[value.key] = torch.empty(0)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_refs(item, refs)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_refs(item, refs)


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSummary:
    """What ``dspark ckpt info`` prints."""

    path: str
    info: CheckpointInfo
    num_params: int
    """Elements of the trainable parameters (a tied one once)."""
    param_bytes: int
    """Their bytes as saved."""
    model_tensors: int
    """Tensors of the model (parameters and persistent buffers) an export writes."""
    model_bytes: int
    extra_keys: list[str]
    """The names saved with ``engine.save(extra=...)``."""
    disk_bytes: int
    """Every file of the checkpoint directory."""

    def rows(self) -> list[tuple[str, str]]:
        """``(field, value)`` lines for a person."""
        info = self.info
        return [
            ("checkpoint", self.path),
            ("step", str(info.step_count)),
            ("written by", f"{info.strategy} on {info.world_size} rank(s), precision {info.precision}"),
            ("parameters", f"{self.num_params:,} trainable, {_size(self.param_bytes)}"),
            ("model tensors", f"{self.model_tensors} (with buffers), {_size(self.model_bytes)}"),
            ("optimizer", f"{info.optimizer}, {info.num_param_groups} param group(s)"),
            ("extra", ", ".join(self.extra_keys) or "(none)"),
            ("size on disk", _size(self.disk_bytes)),
            ("versions", f"DSpark {info.dspark_version}, PyTorch {info.torch_version}"),
            ("saved", info.created_utc or "?"),
        ]

    def as_dict(self) -> dict[str, Any]:
        info = self.info
        return {"path": self.path, "step": info.step_count, "strategy": info.strategy,
                "world_size": info.world_size, "precision": info.precision, "num_params": self.num_params,
                "param_bytes": self.param_bytes, "model_tensors": self.model_tensors,
                "model_bytes": self.model_bytes, "optimizer": info.optimizer,
                "num_param_groups": info.num_param_groups, "extra": self.extra_keys,
                "disk_bytes": self.disk_bytes, "dspark_version": info.dspark_version,
                "torch_version": info.torch_version, "created_utc": info.created_utc}


def summarize_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> CheckpointSummary:
    """What the checkpoint at ``path`` holds, from its metadata and JSON files (no tensor is read);
    ``verify=False`` reads one without a manifest (see :func:`~dspark.checkpoint.read_checkpoint_info`).

    Example::

        summarize_checkpoint("ckpt").num_params   # 124439808
    """
    directory = Path(path)
    info = read_checkpoint_info(directory, verify=verify)
    training = read_training_state(directory)
    tensors = model_tensors(directory, info)
    trainable = set(info.params)
    nbytes = {t.name: tensor_bytes(t.shape, t.dtype) for t in tensors}
    disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and not f.is_symlink())
    return CheckpointSummary(
        path=str(directory), info=info, num_params=info.num_params,
        param_bytes=sum(b for name, b in nbytes.items() if name in trainable),
        model_tensors=len(tensors), model_bytes=sum(nbytes.values()),
        extra_keys=sorted(training.extra), disk_bytes=disk)


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit} ({num_bytes:,} bytes)"
    return f"{num_bytes} bytes"
