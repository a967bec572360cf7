"""A batch with no rows, shaped like a real one: what a rank gets when an epoch's last, partial global
batch holds fewer samples than there are ranks (see [Note: even split of a batch] in
:mod:`dspark.data.order`).

The loader fetches and collates one sample of that global batch on such a rank (a template), then
keeps zero rows of it: every tensor keeps its dtype, device and trailing shape, so the model's forward
runs on it (as it must on every rank: collectives pair up) and the loss weighs nothing with
``engine.backward(loss, weight=loader.batch_info.local_size)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["zero_rows"]


def _is_plain(value: Any) -> bool:
    return not isinstance(value, (torch.Tensor, np.ndarray, Mapping, list, tuple)) and not (
        dataclasses.is_dataclass(value))


def zero_rows(batch: Any) -> Any:
    """``batch`` (a collated batch: tensors, numpy arrays, lists of per-sample values, nested in
    tuples, lists, dicts and dataclasses) with every per-sample part cut to zero rows.

    Example::

        zero_rows((torch.ones(1, 3), ["a"]))   # (tensor of shape (0, 3), [])
    """
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch[:0] if batch.ndim > 0 else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: zero_rows(v) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(zero_rows(v) for v in batch))
    if isinstance(batch, (tuple, list)):
        if batch and all(_is_plain(v) for v in batch):
            return type(batch)()  # one value per sample (collated strings, ids)
        return type(batch)(zero_rows(v) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: zero_rows(getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return batch
