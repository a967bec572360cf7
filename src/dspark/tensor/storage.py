"""The bytes tensors really hold: the one storage counter the engine's reports, the planner's probe
and the lab's measurements all use.

[Note: storage bytes] Memory is held by storages, not tensors: views, tied weights, a parameter and
the flat buffer it is a view of share one. So a tensor counts as the whole storage behind it, each
storage once, keyed by its data pointer (two live storages never share one). A storage freed in
place (FSDP2's resharded parameters, zero3's freed ones: zero bytes, or a storage that raises when
asked) holds nothing; meta tensors hold nothing; a DTensor holds its local shard's storage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["storage_bytes", "storage_key"]


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(data pointer, bytes)`` of the storage behind ``tensor``, or None where it holds nothing
    (see [Note: storage bytes]).

    Example::

        t = torch.zeros(4); storage_key(t[2:]) == storage_key(t)   # True: one storage
    """
    to_local = getattr(tensor, "to_local", None)  # a DTensor: its shard's storage
    if callable(to_local):
        tensor = to_local()
    if tensor.is_meta:
        return None
    try:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
    except RuntimeError:  # a storage freed in place, a sparse tensor: no storage of its own here
        return None
    return (storage.data_ptr(), nbytes) if nbytes else None


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None, *,
                  device_type: str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped), each counted once
    (see [Note: storage bytes]); with ``device_type``, only tensors on that kind of device. Pass the
    same ``seen`` set to several calls to count a storage only in the first that meets it.

    Example::

        w = torch.zeros(1000)
        storage_bytes([w, w[:10], w.view(10, 100)])   # 4000
        seen = set(); storage_bytes([w], seen), storage_bytes([w[1:]], seen)   # (4000, 0)
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None or (device_type is not None and tensor.device.type != device_type):
            continue
        key = storage_key(tensor)
        if key is None or key[0] in seen:
            continue
        seen.add(key[0])
        total += key[1]
    return total
