"""The replication audit: every tensor a rank holds, next to what its placement needs (``engine.audit()``).

[Note: replication audit] The seed's bug held a whole batch on every rank where each should have held
half, and nothing said so. ``engine.audit()`` lists, on this rank, one row per

* parameter (``kind="param"``): its zero3 shard, plus the whole parameter while it is gathered; or the
  whole parameter under the other strategies;
* gradient storage (``"grad"``): each bucket's buffer as held now (whole gradients under
  replicate/zero1, the padded shard under zero2/zero3, between a window's first gradient and its
  optimizer step; none after ``engine.step()``, which frees them), and any gradient held outside the
  buckets (one process: every parameter's gradient);
* optimizer state (``"optimizer"``): the state tensors of each parameter (its rows under zero1-3);
* the last input batch (``"batch"``): the tensors of the last training forward's arguments, as the
  engine records them (see [Note: forward inputs] in :mod:`dspark.engine.inputs`).

``bytes`` is the storage this rank really holds (a storage shared by several tensors counts once, in
the first row that meets it; the batch counts the bytes of its tensors, not of a larger tensor they
may be views of). ``expected_bytes`` is what the row's placement needs: a padded ``1/N`` chunk of rows
for a ``Shard(dim=0)`` tensor, the whole tensor for a ``Replicate()`` one. ``factor`` is their ratio.
Whether a batch is split is read from the data: every rank's batch fingerprint
(:mod:`dspark.tensor.fingerprint`) is all-gathered, and a batch identical on ``k`` ranks counts
``1/k`` of its bytes as expected (factor ``k``, placement ``Replicate()``). The audit is a collective.
Communication scratch buffers are not rows: ``engine.memory_report()["comm_buffer_bytes"]`` has them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dspark import comm
from dspark.engine.inputs import ForwardInputs
from dspark.engine.param_slot import ParamSlot
from dspark.policy.state_bytes import expected_state_bytes, optimizer_state_elements
from dspark.policy.strategies import ShardingPolicy
from dspark.tensor import Replicate, Shard
from dspark.tensor.fingerprint import FINGERPRINT_LEN, identical_ranks
from dspark.tensor.shard_math import chunk_size
from dspark.tensor.storage import storage_bytes

__all__ = ["AUDIT_KINDS", "AUDIT_TOLERANCE", "above_share", "audit_rows", "format_audit"]

AUDIT_KINDS = ("param", "grad", "optimizer", "batch")
AUDIT_TOLERANCE = 1.05
"""A row is above its share when ``factor`` exceeds this (expected bytes already include padding)."""

_SHARD = repr(Shard(0))
_REPLICATE = repr(Replicate())


def _row(name: str, kind: str, placement: str, nbytes: int, expected: int) -> dict[str, Any]:
    factor = nbytes / expected if expected else float("inf")
    return {"name": name, "kind": kind, "placement": placement, "bytes": int(nbytes),
            "expected_bytes": int(expected), "factor": factor}


def _share_bytes(shape: torch.Size, itemsize: int, sharded: bool, num_ranks: int) -> int:
    """Bytes one rank needs for a tensor of ``shape``: a padded chunk of rows, or all of it."""
    rows = shape[0] if len(shape) else 1
    row_numel = shape.numel() // rows if rows else 0
    held_rows = chunk_size(rows, num_ranks) if sharded else rows
    return held_rows * row_numel * itemsize


def _names(slots: Sequence[ParamSlot], most: int = 3) -> str:
    shown = ", ".join(s.name for s in slots[:most])
    return shown + (f" +{len(slots) - most} more" if len(slots) > most else "")


def audit_rows(*, module: nn.Module, slots: Iterable[ParamSlot], strategy: ShardingPolicy,
               params_sharded: bool, buckets: Sequence[Any], optimizer: torch.optim.Optimizer,
               batch: ForwardInputs | None, rank: int, num_ranks: int,
               device: torch.device, shard_rank: int | None = None,
               shard_group_size: int | None = None) -> list[dict[str, Any]]:
    """The audit's rows on this rank (see [Note: replication audit]); a collective. A sharded tensor's
    share is the shard group's (``shard_rank`` of ``shard_group_size``; by default the world's), the
    batch's the world's."""
    group_rank = rank if shard_rank is None else shard_rank
    group_size = num_ranks if shard_group_size is None else shard_group_size
    seen: set[int] = set()
    all_slots = list(slots)
    slot_of = {id(s.param): s for s in all_slots}
    trainable = [s for s in all_slots if s.requires_grad]
    rows: list[dict[str, Any]] = []

    for name, p in module.named_parameters():
        itemsize = p.element_size()
        slot = slot_of.get(id(p))
        if params_sharded and slot is not None:
            held = storage_bytes([slot.shard_flat, p.detach()], seen)  # a gathered one holds both
            rows.append(_row(name, "param", _SHARD, held,
                             _share_bytes(slot.shape, itemsize, True, group_size)))
        else:
            rows.append(_row(name, "param", _REPLICATE, storage_bytes([p.detach()], seen),
                             p.numel() * itemsize))

    for bucket in buckets:
        buffer = bucket.shard_buffer if bucket.sharded else bucket.grad_buffer
        expected = sum(_share_bytes(s.shape, s.param.element_size(), bucket.sharded, group_size)
                       for s in bucket.slots)
        rows.append(_row(f"gradient bucket {bucket.index} ({_names(bucket.slots)})", "grad",
                         _SHARD if bucket.sharded else _REPLICATE, storage_bytes([buffer], seen), expected))
    for slot in trainable:  # gradients outside the buckets (all of them on one rank)
        held = storage_bytes([slot.param.grad, slot.shard_grad,
                              None if slot.opt_param is None else slot.opt_param.grad], seen)
        if held:
            sharded = strategy.shard_grads
            rows.append(_row(f"gradient of {slot.name}", "grad", _SHARD if sharded else _REPLICATE, held,
                             _share_bytes(slot.shape, slot.param.element_size(), sharded, group_size)))

    per_element = optimizer_state_elements(optimizer)
    for slot in trainable:
        key = slot.opt_param if strategy.shard_optimizer else slot.param
        state = optimizer.state.get(key, {}) if key is not None else {}
        held = storage_bytes((v for v in state.values() if isinstance(v, torch.Tensor)), seen)
        if not held:
            continue  # no state yet (before the first step), or no rows on this rank
        meta = torch.empty(slot.shape, dtype=slot.dtype, device="meta")
        expected = expected_state_bytes([meta], strategy, rank=group_rank, num_ranks=group_size,
                                        optimizer_state=per_element)["optimizer"]
        rows.append(_row(slot.name, "optimizer", _SHARD if strategy.shard_optimizer else _REPLICATE,
                         held, expected))

    rows.extend(_batch_rows(batch, rank=rank, num_ranks=num_ranks, device=device))
    return rows


def _batch_rows(batch: ForwardInputs | None, *, rank: int, num_ranks: int,
                device: torch.device) -> list[dict[str, Any]]:
    """The input batch's row: every rank's fingerprint is all-gathered (collective), and the ranks
    holding the same batch as this one divide its expected bytes."""
    mine = (batch.fingerprint() if batch is not None
            else torch.zeros(FINGERPRINT_LEN, dtype=torch.float64))  # no elements: matches nothing
    everyone = comm.all_gather(mine.to(device=device, dtype=torch.float64), label="dspark.audit.all_gather")
    if batch is None:
        return []
    same = {rank} | {b if a == rank else a for a, b in identical_ranks(everyone) if rank in (a, b)}
    k = len(same)
    if k == 1:
        placement = _SHARD
    elif k == num_ranks:
        placement = _REPLICATE
    else:
        placement = f"{_REPLICATE} on ranks {', '.join(map(str, sorted(same)))}"
    return [_row("input batch", "batch", placement, batch.nbytes, -(-batch.nbytes // k))]


def above_share(rows: Iterable[dict[str, Any]], *, tolerance: float = AUDIT_TOLERANCE) -> list[dict[str, Any]]:
    """The rows whose ``factor`` exceeds ``tolerance``: tensors held beyond what their placement needs.

    Example::

        above_share(engine.audit())   # [] on a healthy run
    """
    return [row for row in rows if row["factor"] > tolerance]


def format_audit(rows: Iterable[dict[str, Any]], *, num_ranks: int | None = None,
                 tolerance: float = AUDIT_TOLERANCE) -> str:
    """One line per row above its share, in words, or a line saying there is none. ``num_ranks``
    defaults to the current world's size.

    Example::

        print(format_audit(engine.audit()))
        # input batch: 2.0x a 1/2 share, replicated on every rank
    """
    rows = list(rows)
    n = comm.get_world().world_size if num_ranks is None else num_ranks
    over = above_share(rows, tolerance=tolerance)
    if not over:
        return f"nothing above its share ({len(rows)} tensor{'' if len(rows) == 1 else 's'} checked on this rank)"
    return "\n".join(f"{_label(row)}: {row['factor']:.1f}x {_share(row, n)}{_cause(row)}" for row in over)


def _label(row: dict[str, Any]) -> str:
    kind, name = row["kind"], row["name"]
    if kind == "param":
        return f"parameter {name}"
    if kind == "optimizer":
        return f"optimizer state of {name}"
    return str(name)


def _share(row: dict[str, Any], num_ranks: int) -> str:
    if row["kind"] == "batch" or str(row["placement"]).startswith("Shard"):
        return f"a 1/{num_ranks} share"
    return "one whole copy"


def _cause(row: dict[str, Any]) -> str:
    kind, placement = row["kind"], str(row["placement"])
    if kind == "batch":
        if placement == _REPLICATE:
            return ", replicated on every rank"
        return f", identical on ranks {placement.split(' on ranks ', 1)[1]}"
    if kind == "param" and placement == _SHARD:
        return ", held whole (gathered) besides its shard where the strategy shards it"
    if kind == "grad" and placement == _SHARD:
        return ", a whole gradient held where the strategy keeps a shard"
    return ", more storage than the tensor needs"
