"""HuggingFace's weight files, through the ``safetensors`` library: a ``.safetensors`` file, or a
model directory holding ``model.safetensors`` or shards plus ``model.safetensors.index.json``.

[Note: HuggingFace layout] A directory written here is what ``transformers``' ``save_pretrained``
writes: tensors grouped in file order into shards of at most ``max_shard_size`` bytes (a tensor
larger than that gets a shard of its own), named ``model-00001-of-00003.safetensors``, and an index
``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``; a model that fits in one shard
is the single file ``model.safetensors`` and no index. Every file carries the metadata
``{"format": "pt"}``, which ``transformers`` checks. The shards are planned from shapes and dtypes
before any tensor exists, so a writer can receive the tensors one by one (gathered unit by unit, or
read from a checkpoint) and hold at most one shard.

Reading parses each file's header once and reads only the rows asked for (see [Note: safetensors
read once] in :mod:`dspark.checkpoint.safetensors_file`); writing goes through ``safetensors``.

Example::

    plan = plan_shards([("w", 40), ("b", 8)], max_shard_bytes=32)   # [['w'], ['b']]
    with ShardWriter(Path("out"), plan) as writer:
        writer.add("w", torch.zeros(10)); writer.add("b", torch.zeros(2))
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from dspark.checkpoint.plain_files import HF_INDEX, read_plain_file
from dspark.checkpoint.safetensors_file import SafetensorsEntry, read_header, read_rows
from dspark.errors import CheckpointError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "SafetensorsSource", "ShardWriter", "TensorHeader",
           "parse_size", "plan_shards", "shard_file_names", "tensor_bytes"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_METADATA = {"format": "pt"}

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or a string such as ``"5GB"`` (10**9 bytes, as HuggingFace reads it)
    or ``"500MiB"``.

    Example::

        parse_size("5GB")     # 5000000000
        parse_size("2MiB")    # 2097152
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size={size!r} is not a size: give bytes (an int) or a number "
                             f"with a unit, one of {sorted(u for u in _UNITS if u)} (e.g. '5GB')")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    else:
        raise TypeError(f"max_shard_size={size!r} must be an int (bytes) or a string such as '5GB'")
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be more than 0 bytes")
    return value


def plan_shards(sizes: Sequence[tuple[str, int]], *, max_shard_bytes: int) -> list[list[str]]:
    """The names of each shard, in order: consecutive tensors while they fit in ``max_shard_bytes``
    (a larger tensor alone). ``sizes`` lists ``(name, bytes)`` in the order they are written.

    Example::

        plan_shards([("a", 6), ("b", 6), ("c", 20)], max_shard_bytes=12)   # [['a', 'b'], ['c']]
    """
    shards: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not shards or (used + size > max_shard_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """File names of ``num_shards`` shards, as ``transformers`` names them.

    Example::

        shard_file_names(1)   # ['model.safetensors']
        shard_file_names(2)   # ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    if num_shards <= 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


class ShardWriter:
    """Writes the tensors of a :func:`plan_shards` plan into ``directory`` as they arrive (in any
    order), each shard once all its tensors are there, then the index; holds at most the shards not
    yet complete. ``single_file``: write everything as that one file instead (no index)."""

    def __init__(self, directory: Path, plan: Sequence[Sequence[str]], *,
                 single_file: Path | None = None) -> None:
        self.directory = directory
        self.single_file = single_file
        self.plan = [list(names) for names in plan] if single_file is None else [
            [n for names in plan for n in names]]
        files = [single_file.name] if single_file is not None else shard_file_names(len(self.plan))
        self.file_of = {name: files[i] for i, names in enumerate(self.plan) for name in names}
        self._shard_of = {name: i for i, names in enumerate(self.plan) for name in names}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._total_bytes = 0
        self._done: set[int] = set()
        self.written: list[Path] = []

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 trace: TracebackType | None) -> None:
        if kind is None:
            self.finish()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Hand over ``name``'s value (a CPU tensor the writer may keep until its shard is written)."""
        index = self._shard_of.get(name)
        if index is None:
            raise AssertionError(f"{name!r} is in no shard of the plan")
        shard = self._pending.setdefault(index, {})
        shard[name] = tensor.detach().contiguous()
        if len(shard) == len(self.plan[index]):
            self._write(index)

    def _write(self, index: int) -> None:
        from safetensors.torch import save_file

        tensors = self._pending.pop(index)
        ordered = {name: tensors[name] for name in self.plan[index]}
        path = (self.single_file if self.single_file is not None
                else self.directory / shard_file_names(len(self.plan))[index])
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(ordered, str(path), metadata=_METADATA)
        self._total_bytes += sum(t.numel() * t.element_size() for t in ordered.values())
        self._done.add(index)
        self.written.append(path)

    def finish(self) -> list[Path]:
        """Check every tensor arrived, write the index (several shards), return the files written."""
        missing = [n for i, names in enumerate(self.plan) if i not in self._done
                   for n in names if n not in self._pending.get(i, {})]
        if missing:
            raise AssertionError(f"the shard writer did not receive {missing[:5]}")
        if self.single_file is None and len(self.plan) > 1:
            index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(self.file_of)}
            with open(self.directory / INDEX_FILE, "w", encoding="utf-8") as out:
                json.dump(index, out, indent=2)
                out.write("\n")
        return list(self.written)


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """A tensor of a safetensors source, known from its header alone."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class SafetensorsSource:
    """The tensors of a ``.safetensors`` file or a HuggingFace model directory, read lazily: each
    file's header is parsed once, within its bound, and each read takes only the rows asked for
    (see [Note: safetensors read once] in :mod:`dspark.checkpoint.safetensors_file`).

    Example::

        source = SafetensorsSource("gpt2")          # model.safetensors or shards + index.json
        source.headers["wte.weight"].shape          # (50257, 768)
        rows = source.read("wte.weight", 0, 100)    # rows 0..99 only, read when asked
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path={path!r} must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        self.files = _files_of(self.path)
        self.headers: dict[str, TensorHeader] = {}
        self._entries: dict[str, SafetensorsEntry] = {}
        for file in self.files:
            for name, entry in read_header(file).items():
                self.headers[name] = TensorHeader(file, entry.shape, entry.dtype)
                self._entries[name] = entry

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of ``name`` (the whole tensor when both are None; a 0-d tensor whole),
        read into a fresh buffer: nothing of the file stays mapped."""
        return read_rows(self.headers[name].file, self._entries[name], start, stop)

    def close(self) -> None:
        """Nothing stays open between reads; kept so callers can release a source explicitly."""


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{str(path)!r} is not a .safetensors file (give a .safetensors file or a "
                             "HuggingFace model directory)")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no weights at {str(path)!r}: give a .safetensors file or a "
                                "HuggingFace model directory")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(read_plain_file(index, HF_INDEX))["weight_map"]
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"{str(index)!r} is not a safetensors index ({type(exc).__name__}: {exc})") from exc
        if not isinstance(weight_map, Mapping):
            raise ValueError(f"{str(index)!r}: weight_map must map names to files")
        files = []
        for file in dict.fromkeys(weight_map.values()):
            if not isinstance(file, str) or Path(file).name != file:
                raise ValueError(f"{str(index)!r} names shard {file!r}, which is not a file name in "
                                 "the directory")
            if not (path / file).is_file():
                raise FileNotFoundError(f"{str(index)!r} names shard {file!r}, which is missing")
            files.append(path / file)
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    found = sorted(p.name for p in path.glob("*.safetensors"))
    hint = f" (it holds {found[:3]}, but no {INDEX_FILE} says which are the model)" if found else ""
    raise FileNotFoundError(f"{str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}; "
                            "a .bin (pickle) checkpoint is not read: convert it to safetensors")


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``: ``tensor_bytes((3, 2), torch.bfloat16)`` is 12."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
