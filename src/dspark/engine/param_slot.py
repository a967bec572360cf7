"""One ``ParamSlot`` per unique parameter: its memory layout, where its shard lives, how big it is on this
rank, and its state: what the strategy keeps of it on this rank right now.

[Note: slot states] What a slot holds depends on the strategy, and under zero3 on the moment, so it
is a stated value, :class:`SlotState`, checked where it matters (:meth:`ParamSlot.assert_in`):

- ``WHOLE``: the parameter whole, updated whole by the optimizer (replicate; frozen parameters kept
  as built). Its gradient's place in a bucket is ``grad_view``.
- ``WHOLE_ROWS``: the parameter whole, in place; the optimizer updates ``opt_param``, a view of this
  rank's rows of it (zero1, zero2; zero3 on one rank). zero1 reduces into ``grad_view``, zero2 keeps
  its rows of the gradient in ``shard_grad``.
- ``SHARDED``: zero3 on several ranks between uses: only this rank's rows, padded (``shard_flat``,
  viewed as ``padded_shard``; ``opt_param`` is a view of them), the parameter itself an empty
  tensor; ``pending`` is the gather in flight, if one is.
- ``GATHERED``: zero3 on several ranks while a unit runs: the whole parameter installed from a
  gather, the shard kept beside it.

``WHOLE -> WHOLE_ROWS`` (:meth:`ParamSlot.view_shard_of_full`) and ``WHOLE -> SHARDED``
(:meth:`ParamSlot.shard_and_free_full`) happen once, at construction; zero3 then moves each slot
``SHARDED -> GATHERED`` (:meth:`ParamSlot.set_full`) and back (:meth:`ParamSlot.free_full`).

[Note: row sharding] Every parameter is split along dim 0 (a 0-d parameter counts as one row) under the
uneven split rule of :mod:`dspark.tensor.shard_math`: rank ``r`` owns rows ``[start, stop)`` of ``rows``,
and collectives move pieces padded to ``chunk`` rows. Optimizer state follows the same split, so each
parameter's shard and state are ``Shard(0)`` DistTensors that PyTorch's distributed checkpoint can save
per rank and reload at another world size.

[Note: memory layout] A parameter keeps the strides it was built with (``channels_last`` convolutions
included): every flat buffer DSpark copies it into holds its elements in *memory order*, and every
parameter-shaped view of such a buffer is made with the parameter's own strides (``as_strided``).
Row sharding needs dim 0 to be the outermost dimension in memory, which holds for contiguous and
channels_last tensors; a parameter laid out otherwise (a transposed view) is made contiguous once.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Any

import torch
from torch import nn

from dspark.tensor import DistTensor, Shard
from dspark.tensor.shard_math import chunk_size, shard_range

__all__ = ["SHARDED_STATES", "ParamSlot", "SlotState", "memory_order_strides"]

log = logging.getLogger(__name__)

_EMPTY: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    key = (t.dtype, t.device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=t.dtype, device=t.device)
    return _EMPTY[key]


def memory_order_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """``t``'s strides when its elements fill one dense block with dim 0 outermost (contiguous and
    channels_last tensors), else None.

    Example::

        memory_order_strides(torch.empty(4, 3, 2, 2).to(memory_format=torch.channels_last))
        # (12, 1, 6, 3)
        memory_order_strides(torch.empty(3, 4).t())   # None: dim 0 is not outermost
    """
    if t.dim() == 0:
        return ()
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(d) != 1 and t.stride(d) != expected:
            return None
        expected *= t.size(d)
    rows = t.size(0)
    if rows > 1 and t.stride(0) != t.numel() // rows:
        return None
    return tuple(t.stride())


class SlotState(enum.Enum):
    """What a :class:`ParamSlot` holds on this rank (see [Note: slot states])."""

    WHOLE = "whole"
    WHOLE_ROWS = "whole, the optimizer on this rank's rows"
    SHARDED = "this rank's rows only"
    GATHERED = "gathered whole, its rows kept"


SHARDED_STATES = (SlotState.SHARDED, SlotState.GATHERED)
"""The states of a slot whose parameter zero3 shards on several ranks (its rows in ``padded_shard``)."""


class ParamSlot:
    """Bookkeeping for one unique parameter (tied parameters share a slot and list every name); its
    ``state`` says which of its fields are live (see [Note: slot states])."""

    def __init__(self, names: list[str], param: nn.Parameter, *, rank: int, num_ranks: int) -> None:
        strides = memory_order_strides(param)
        if strides is None:
            log.info("%s: strides %s do not keep dim 0 outermost; made contiguous", names[0],
                     tuple(param.stride()))
            param.data = param.data.contiguous()
            strides = tuple(param.stride())
        self.names = names
        self.param = param
        self.requires_grad = param.requires_grad
        self.shape = param.shape
        self.strides = strides
        self.dtype = param.dtype
        self.numel = param.numel()
        self.rows = param.shape[0] if param.dim() > 0 else 1
        self.row_numel = math.prod(param.shape[1:]) if param.dim() > 0 else 1
        self.num_ranks = num_ranks
        self.chunk = chunk_size(self.rows, num_ranks)
        self.start, self.stop = shard_range(self.rows, num_ranks, rank)
        self.local_rows = self.stop - self.start
        self.state = SlotState.WHOLE
        self.shard_flat: torch.Tensor | None = None  # SHARDED_STATES: this rank's chunk rows, padded, flat
        self.padded_shard: torch.Tensor | None = None  # SHARDED_STATES: shard_flat viewed as (chunk, *rest)
        self.opt_param: nn.Parameter | None = None  # WHOLE_ROWS, SHARDED_STATES: what the optimizer updates
        self.shard_grad: torch.Tensor | None = None  # zero2/3: this rank's reduced gradient, flat, padded
        self.grad_view: torch.Tensor | None = None  # replicate/zero1: the gradient's place in its bucket
        self.pending: Any = None  # SHARDED: the in-flight gather that will fill this parameter
        self.arrivals = 0  # gradient accumulations seen in this backward
        self.expected_arrivals = 1  # accumulations per backward, learned on the first step
        self.used = False  # a gradient arrived in this accumulation window

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def gathered(self) -> bool:
        """The whole parameter is in place (every state but ``SHARDED``)."""
        return self.state is not SlotState.SHARDED

    def assert_in(self, *states: SlotState, doing: str) -> None:
        """Raise ``AssertionError`` naming the slot, its state and ``doing`` unless it is in one of
        ``states`` (an engine bug, never a user's: see [Note: slot states]).

        Example::

            slot.assert_in(SlotState.SHARDED, doing="installing a gathered parameter")
        """
        if self.state not in states:
            raise AssertionError(f"{self.name}: {doing} in state {self.state.name} ({self.state.value}); "
                                 f"expected {' or '.join(s.name for s in states)}")

    def held(self) -> torch.Tensor:
        """The tensor whose storage holds this parameter's values on this rank: its padded rows under
        zero3 on several ranks, else the parameter."""
        if self.state in SHARDED_STATES:
            if self.padded_shard is None:
                raise AssertionError(f"{self.name}: state {self.state.name} without a shard")
            return self.padded_shard
        return self.param

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

    @property
    def grad_complete(self) -> bool:
        """Every gradient this backward brings for the parameter has been accumulated."""
        return self.arrivals >= self.expected_arrivals

    # -- views in memory order -------------------------------------------------------------------
    def rows_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (full-sized) as ``(rows, *rest)``, 0-d parameters as ``(1,)``."""
        return t.reshape(1) if t.dim() == 0 else t

    def _rows_strides(self) -> tuple[int, ...]:
        return (self.row_numel, *self.strides[1:]) if len(self.shape) else (1,)

    def view_rows(self, flat: torch.Tensor, rows: int) -> torch.Tensor:
        """``rows`` rows of this parameter laid in memory order at the start of the 1-D ``flat``."""
        shape = (rows, *self.shape[1:]) if len(self.shape) else (rows,)
        return flat.as_strided(shape, self._rows_strides())

    def view_full(self, flat: torch.Tensor) -> torch.Tensor:
        """The whole parameter laid in memory order at the start of the 1-D ``flat``."""
        return flat.as_strided(self.shape, self.strides)

    def copy_to_flat(self, flat: torch.Tensor, t: torch.Tensor) -> None:
        """Write the parameter-shaped ``t`` (any strides) into ``flat`` in memory order."""
        self.view_full(flat).copy_(t)

    # -- sharded layouts -------------------------------------------------------------------------
    def view_shard_of_full(self) -> nn.Parameter:
        """zero1/zero2: the optimizer's parameter is this rank's rows of the full parameter, as a view
        (no extra memory: the optimizer updates the model's storage in place). ``WHOLE -> WHOLE_ROWS``."""
        self.assert_in(SlotState.WHOLE, doing="viewing this rank's rows for the optimizer")
        rows = self.rows_view(self.param.detach())
        self.opt_param = nn.Parameter(rows[self.start:self.stop], requires_grad=self.requires_grad)
        self.state = SlotState.WHOLE_ROWS
        return self.opt_param

    def shard_and_free_full(self) -> nn.Parameter | None:
        """zero3: keep this rank's rows in a padded shard, and free the full parameter.
        ``WHOLE -> SHARDED``."""
        self.assert_in(SlotState.WHOLE, doing="sharding the parameter")
        full = self.param.detach()
        flat = torch.zeros(self.shard_numel, dtype=self.dtype, device=full.device)
        self.shard_flat = flat
        self.padded_shard = self.view_rows(flat, self.chunk)
        self.padded_shard[: self.local_rows].copy_(self.rows_view(full)[self.start:self.stop])
        if self.requires_grad:
            self.opt_param = nn.Parameter(self.padded_shard[: self.local_rows], requires_grad=True)
        self.state = SlotState.GATHERED  # the full value is still in place: free it as zero3 does
        self.free_full()
        return self.opt_param

    def local_shard(self) -> torch.Tensor:
        """This rank's rows of the parameter's current value (sharded strategies)."""
        if self.state in SHARDED_STATES:
            return self.held()[: self.local_rows]
        if self.state is SlotState.WHOLE_ROWS and self.opt_param is not None:
            return self.opt_param.detach()
        return self.rows_view(self.param.detach())[self.start:self.stop]

    def dist_shard(self) -> DistTensor:
        """This rank's rows as a ``Shard(0)`` DistTensor over the parameter's global shape."""
        global_shape = tuple(self.shape) if len(self.shape) else (1,)
        return DistTensor(self.local_shard(), Shard(0), global_shape)

    def shard_grad_rows(self) -> torch.Tensor | None:
        """zero2/3: this rank's reduced gradient shaped like its rows (None when no rank produced one)."""
        if self.shard_grad is None:
            return None
        return self.view_rows(self.shard_grad, self.local_rows)

    # -- zero3: gather / free --------------------------------------------------------------------
    def free_full(self) -> None:
        """zero3: drop the whole parameter, keeping this rank's rows. ``GATHERED -> SHARDED``."""
        self.assert_in(SlotState.GATHERED, doing="freeing the gathered parameter")
        self.param.data = _empty_like(self.param)
        self.state = SlotState.SHARDED

    def set_full(self, padded_full: torch.Tensor) -> None:
        """Install the gathered parameter: ``padded_full`` is 1-D, ``chunk * N`` rows in memory order
        (the padding at the end), dense. ``SHARDED -> GATHERED``."""
        self.assert_in(SlotState.SHARDED, doing="installing a gathered parameter")
        if padded_full.dim() != 1 or (padded_full.numel() > 1 and padded_full.stride(0) != 1):
            raise AssertionError(f"{self.name}: set_full needs a dense 1-D tensor, got shape "
                                 f"{tuple(padded_full.shape)} strides {padded_full.stride()}")
        self.param.data = self.view_full(padded_full)
        self.state = SlotState.GATHERED
        self.pending = None
