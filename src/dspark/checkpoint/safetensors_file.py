"""One ``.safetensors`` file, its header parsed once and bounded, its tensors' rows read by offset.

[Note: safetensors read once] The format is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets from
the end of the header) and the tensors' bytes. The ``safetensors`` library parses the header at
every ``safe_open``, and a load that opens the file for each tensor (so that the pages read leave
with each read) parsed it once per tensor: a crafted header of many tensors costs the square of
their number. Here the header is read once, within its bound (see [Note: bounds on what is read] in
:mod:`dspark.checkpoint.plain_files`), checked (every tensor's bytes inside the file and of its
shape's size), and each read is one ``pread`` of the rows asked for into a fresh buffer: nothing
stays mapped, and no header is parsed again. Writing stays with the library (``save_file``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.checkpoint.plain_files import SAFETENSORS_HEADER, check_values
from dspark.errors import CheckpointError

__all__ = ["SafetensorsEntry", "read_header", "read_rows"]

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
          "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True, slots=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: where its bytes are (from the file's start)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


def read_header(file: Path) -> dict[str, SafetensorsEntry]:
    """The tensors of ``file`` by name (its ``__metadata__`` left out); ``CheckpointError`` naming the
    file when its header is over the bound or does not describe its bytes.

    Example::

        read_header(Path("model.safetensors"))["wte.weight"].shape   # (50257, 768)
    """
    with open(file, "rb") as handle:
        size_bytes = os.fstat(handle.fileno()).st_size
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode) or size_bytes < 8:
            raise CheckpointError(f"{str(file)!r} is not a safetensors file (no 8-byte header length)")
        header_bytes = int.from_bytes(handle.read(8), "little")
        if header_bytes > SAFETENSORS_HEADER.max_bytes:
            raise CheckpointError(f"{str(file)!r} has a header of {header_bytes} bytes, more than the "
                                  f"{SAFETENSORS_HEADER.max_bytes} DSpark reads of {SAFETENSORS_HEADER.what} "
                                  "(see 'Bounds on what is read' in docs/checkpoints.md): it is damaged "
                                  "or was crafted")
        if 8 + header_bytes > size_bytes:
            raise CheckpointError(f"{str(file)!r} says its header has {header_bytes} bytes, past the "
                                  f"end of its {size_bytes}: the file is cut short or damaged")
        data = handle.read(header_bytes)
    check_values(file, data, SAFETENSORS_HEADER)
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("the header is not a JSON object")
        start = 8 + header_bytes
        return {name: _entry(name, item, start, size_bytes) for name, item in raw.items()
                if name != "__metadata__"}
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CheckpointError(f"{str(file)!r} is not a safetensors file DSpark can read "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from exc


def _entry(name: str, item: Any, start: int, size_bytes: int) -> SafetensorsEntry:
    if not isinstance(item, dict) or item.get("dtype") not in DTYPES:
        raise ValueError(f"tensor {name!r}: dtype {item.get('dtype') if isinstance(item, dict) else item!r}"
                         f" is not one DSpark reads ({sorted(DTYPES)})")
    shape, offsets = item.get("shape"), item.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    dtype = DTYPES[item["dtype"]]
    begin, end = offsets
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end or end - begin != nbytes or start + end > size_bytes:
        raise ValueError(f"tensor {name!r}: bytes {begin}-{end} do not hold its {nbytes} bytes inside "
                         f"the file's {size_bytes - start} bytes of data")
    return SafetensorsEntry(tuple(shape), dtype, start + begin, nbytes)


def read_rows(file: Path, entry: SafetensorsEntry, start: int | None = None,
              stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of a tensor (all of it when both are None, a 0-d tensor whole), read into
    a fresh buffer with one ``pread``.

    Example::

        read_rows(Path("model.safetensors"), header["wte.weight"], 0, 100).shape   # (100, 768)
    """
    shape = entry.shape
    if shape and (start is not None or stop is not None):
        first, last, _ = slice(start, stop).indices(shape[0])
        rows = max(0, last - first)
        row_bytes = entry.nbytes // shape[0] if shape[0] else 0
        offset, nbytes, shape = entry.offset + first * row_bytes, rows * row_bytes, (rows, *shape[1:])
    else:
        offset, nbytes = entry.offset, entry.nbytes
    if not nbytes:
        return torch.empty(shape, dtype=entry.dtype)
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    fd = os.open(file, os.O_RDONLY)
    try:
        while got < nbytes:  # one call reads at most 0x7ffff000 bytes (Linux's read limit)
            done = os.preadv(fd, [view[got:]], offset + got)
            if done == 0:
                raise CheckpointError(f"{str(file)!r} ended after {got} of the {nbytes} bytes at "
                                      f"{offset}: the file is cut short")
            got += done
    finally:
        os.close(fd)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(entry.dtype).reshape(shape)
