"""One ``ParamSlot`` per trainable parameter: where its shard lives, how big it is on this rank, and
(under zero3) whether its full value is currently gathered.

[Note: row sharding] Every parameter is split along dim 0 (a 0-d parameter counts as one row) under the
uneven split rule of :mod:`dspark.tensor.shard_math`: rank ``r`` owns rows ``[start, stop)`` of ``rows``,
and collectives move pieces padded to ``chunk`` rows. Optimizer state follows the same split, so each
parameter's shard and state are ``Shard(0)`` DistTensors that PyTorch's distributed checkpoint can save
per rank and reload at another world size.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dspark.tensor import DistTensor, Shard
from dspark.tensor.shard_math import chunk_size, shard_range

__all__ = ["ParamSlot"]

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    key = (t.dtype, t.device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return _EMPTY[key]


class ParamSlot:
    """Bookkeeping for one unique parameter (tied parameters share a slot and list every name)."""

    def __init__(self, names: list[str], param: nn.Parameter, *, rank: int, num_ranks: int) -> None:
        self.names = names
        self.param = param
        self.shape = param.shape
        self.dtype = param.dtype
        self.numel = param.numel()
        self.rows = param.shape[0] if param.dim() > 0 else 1
        self.row_numel = math.prod(param.shape[1:]) if param.dim() > 0 else 1
        self.num_ranks = num_ranks
        self.chunk = chunk_size(self.rows, num_ranks)
        self.start, self.stop = shard_range(self.rows, num_ranks, rank)
        self.local_rows = self.stop - self.start
        self.padded_shard: torch.Tensor | None = None  # zero3: this rank's chunk rows, padded
        self.opt_param: nn.Parameter | None = None  # what the optimizer updates
        self.shard_grad: torch.Tensor | None = None  # zero2/3: this rank's reduced gradient, padded
        self.gathered = True
        self.pending: Any = None  # zero3: the in-flight gather that will fill this parameter

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard (what every rank sends in a collective)."""
        return self.chunk * self.row_numel

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def opt_shape(self) -> tuple[int, ...]:
        return (self.local_rows, *self.shape[1:]) if len(self.shape) > 0 else (self.local_rows,)

    def rows_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (full-sized) as ``(rows, *rest)``, 0-d parameters as ``(1,)``."""
        return t.reshape(1) if t.dim() == 0 else t

    # -- sharded layouts -------------------------------------------------------------------------
    def view_shard_of_full(self) -> nn.Parameter:
        """zero1/zero2: the optimizer's parameter is this rank's rows of the full parameter, as a view
        (no extra memory: the optimizer updates the model's storage in place)."""
        rows = self.rows_view(self.param.detach())
        self.opt_param = nn.Parameter(rows[self.start:self.stop], requires_grad=True)
        return self.opt_param

    def shard_and_free_full(self) -> nn.Parameter:
        """zero3: keep this rank's rows in a padded shard, and free the full parameter."""
        full = self.rows_view(self.param.detach())
        padded = full.new_zeros((self.chunk, *full.shape[1:]))
        padded[: self.local_rows] = full[self.start:self.stop]
        self.padded_shard = padded
        self.opt_param = nn.Parameter(padded[: self.local_rows], requires_grad=True)
        self.free_full()
        return self.opt_param

    def dist_shard(self) -> DistTensor:
        """This rank's rows as a ``Shard(0)`` DistTensor over the parameter's global shape."""
        if self.opt_param is None:
            raise AssertionError(f"{self.name}: no shard exists under a replicate strategy")
        global_shape = tuple(self.shape) if len(self.shape) else (1,)
        return DistTensor(self.opt_param.detach(), Shard(0), global_shape)

    # -- zero3: gather / free --------------------------------------------------------------------
    def free_full(self) -> None:
        self.param.data = _empty_like(self.param)
        self.gathered = False

    def set_full(self, padded_full: torch.Tensor) -> None:
        """Install the gathered parameter (``chunk * N`` rows, the padding at the end)."""
        self.param.data = padded_full.reshape(-1)[: self.numel].view(self.shape)
        self.gathered = True
        self.pending = None
