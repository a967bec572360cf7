"""Weights out of a DSpark checkpoint, offline: no process group, whatever strategy and world size
wrote it (what ``dspark ckpt export`` and ``dspark ckpt info`` run).

[Note: offline export] The model's tensors are the checkpoint's ``model/<name>`` entries (see
[Note: checkpoint layout]); DCP's metadata gives each one's global shape and dtype, so the output is
planned before any data is read. Each output shard is then read through DCP itself (its
file-system reader with DSpark's safety checks, :func:`dspark.checkpoint.storage.read_state`, with
a whole tensor as the destination: DCP assembles it from every rank's chunks), cast if asked, and
written: at any time the process holds one output shard (at least the largest tensor). Names lose
the ``model/`` prefix; a 0-d parameter, saved as shape ``(1,)`` to be split along dim 0, gets its
shape ``()`` back from ``dspark.json``'s ``scalar_params``. A tied parameter is written once, under
its first name, as HuggingFace stores it, in safetensors (``all_names=True``: under each of its
names, a copy each); a ``.pt`` holds every name of the model's ``state_dict()``, the tied ones
sharing one tensor, so that a plain ``model.load_state_dict(torch.load(...))`` takes it strictly. A
directory gets the model's ``config.json`` when the checkpoint kept one, so ``from_pretrained``
loads it. A single ``.safetensors`` file or a ``.pt`` file is one shard: the whole model in memory.

Example::

    export_checkpoint("ckpt/latest", "out/")                     # HuggingFace-style directory
    export_checkpoint("ckpt/latest", "model.safetensors", dtype=torch.bfloat16)
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.checkpoint import layout, storage
from dspark.checkpoint.hf_files import ShardWriter, parse_size, plan_shards, tensor_bytes
from dspark.checkpoint.info import check_outside_checkpoint, read_checkpoint_info
from dspark.checkpoint.manifest import read_manifest, read_verified
from dspark.checkpoint.offline import ModelTensor, model_tensors, read_extra
from dspark.checkpoint.plain_files import MODEL_CONFIG
from dspark.errors import CheckpointError

__all__ = ["DTYPES", "export_checkpoint"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
"""Names ``--dtype`` accepts."""

def export_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                      dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                      verify: bool = True, all_names: bool | None = None, extra: Sequence[str] = ()) -> list[Path]:
    """Write the model of the DSpark checkpoint at ``path`` to ``out``: a ``.safetensors`` file, a
    ``.pt`` file (``torch.save`` of the state dict), or else a directory in HuggingFace's layout
    (see [Note: HuggingFace layout]) with the model's ``config.json`` when the checkpoint kept one.
    ``dtype`` casts floating-point tensors. ``all_names``: a tied parameter under every name the
    model's ``state_dict()`` has (the default for ``.pt``) or once (the default for safetensors).
    ``extra``: a ``.pt`` becomes ``{"model": state_dict, key: read_extra(path, key) for each key}``,
    the layout nanoGPT's ``sample.py`` reads (``extra=["model_args"]``). No process group is
    needed. Returns the files written. Raises ``FileExistsError`` when ``out`` is a file or a
    non-empty directory, ``ValueError`` when it is a checkpoint or inside one. ``verify=False``
    reads a checkpoint without a manifest (see :func:`~dspark.checkpoint.read_checkpoint_info`).

    Example::

        export_checkpoint("ckpt/step-1000", "gpt2-finetuned/", dtype=torch.bfloat16)
        export_checkpoint("ckpt/latest", "ckpt.pt", extra=["model_args"])   # nanoGPT's sample.py
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
    if extra and kind != ".pt":
        raise ValueError(f"extra={list(extra)!r} goes beside the weights in a .pt file only; {str(target)!r} "
                         "is not one (give a path ending in .pt)")
    extras = _read_extras(directory, extra, verify=verify)  # a missing key fails before anything is written
    check_outside_checkpoint(target, what="export")
    _check_free(target, kind)

    def out_dtype(t: ModelTensor) -> torch.dtype:
        return dtype if dtype is not None and t.dtype.is_floating_point else t.dtype

    by_name = {t.name: t for t in tensors}
    every_name = kind == ".pt" if all_names is None else bool(all_names)
    source_of = {n: n for n in by_name}
    if every_name:
        source_of = {out_name: t.name for t in tensors for out_name in (t.name, *info.aliases.get(t.name, []))}
    sizes = [(n, tensor_bytes(by_name[source].shape, out_dtype(by_name[source]))) for n, source in source_of.items()]
    one_file = kind != "directory"
    plan = [list(source_of)] if one_file else plan_shards(sizes, max_shard_bytes=parse_size(max_shard_size))

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        sources = list(dict.fromkeys(source_of[n] for n in names))
        state = {layout.model_key(n): torch.empty(by_name[n].saved_shape, dtype=by_name[n].dtype)
                 for n in sources}
        storage.read_state(state, directory, metadata, distributed=False)
        values = {n: state[layout.model_key(n)].reshape(by_name[n].shape).to(out_dtype(by_name[n]))
                  for n in sources}
        # safetensors stores no shared tensors: a tied name gets a copy; a .pt keeps them shared
        return {n: values[source_of[n]] if kind == ".pt" or n == source_of[n] else values[source_of[n]].clone()
                for n in names}

    config = _config_json(directory, verify=verify) if kind == "directory" else None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(f"cannot write {str(target)!r}: {str(target.parent)!r} is not a "
                                 "directory (a file is in the way)") from None
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:  # see [Note: an export is whole or absent]
        if kind == ".pt":
            weights = read(plan[0])
            torch.save({"model": weights, **extras} if extra else weights, staging)
            written = [staging]
        else:
            writer = ShardWriter(staging, plan, single_file=staging if kind == ".safetensors" else None)
            for names in plan:
                for name, value in read(names).items():
                    writer.add(name, value)
            written = writer.finish()
            if config is not None:
                (staging / layout.CONFIG_FILE).write_bytes(config)
                written.append(staging / layout.CONFIG_FILE)
        if kind == "directory" and target.is_dir():
            target.rmdir()   # checked empty above: the staged directory takes its place
        os.replace(staging, target)
    except BaseException as exc:
        _remove(staging)
        if isinstance(exc, Exception) and not isinstance(exc, (CheckpointError, ValueError, TypeError)):
            raise OSError(f"cannot write {str(target)!r}: {_io_reason(exc)}{_limits(target.parent)}; "
                          "nothing was left there") from exc
        raise
    return [target] if kind != "directory" else [target / path.name for path in written]


# [Note: an export is whole or absent] The files are written into a hidden sibling of the output
# (``.<name>.tmp-<token>``, the same file system) and renamed into place once all are written. A
# failure meanwhile (a full disk, a file size limit, an I/O error; the safetensors library and
# torch.save report them as their own exceptions) removes what was written and is an OSError naming
# the output and the system's reason: the command prints one line, and no empty or partial output
# is left where a later step would take it for the model.


def _io_reason(exc: BaseException) -> str:
    """The system's reason behind a writer's failure (an OSError in its chain), else its message."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _limits(directory: Path) -> str:
    """What may have stopped a write there: the file size limit (``ulimit -f``) and the free space."""
    import resource

    notes = []
    soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        notes.append(f"this process may write files of at most {soft} bytes (ulimit -f)")
    try:
        notes.append(f"{shutil.disk_usage(directory).free} bytes free on its disk")
    except OSError:
        pass
    return f" ({'; '.join(notes)})" if notes else ""


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _read_extras(directory: Path, keys: Sequence[str], *, verify: bool) -> dict[str, Any]:
    if "model" in keys:
        raise ValueError("extra=['model']: 'model' holds the weights in the .pt; give the names of "
                         "engine.save(extra={...}) entries")
    return {key: read_extra(directory, key, verify=verify) for key in keys}


def _config_json(directory: Path, *, verify: bool) -> bytes | None:
    """The checkpoint's ``config.json``, checked against its manifest, or None when it kept none."""
    manifest = read_manifest(directory)
    listed = manifest is not None and layout.CONFIG_FILE in manifest.files
    if not listed and (verify or not (directory / layout.CONFIG_FILE).is_file()):
        return None
    return read_verified(directory, layout.CONFIG_FILE, manifest, MODEL_CONFIG)


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
