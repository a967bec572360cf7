"""Evaluation across ranks: every rank's predictions gathered in dataset order, and metrics averaged
with the right weights, so that N ranks report what one process computes on the whole set.

[Note: gathering in dataset order] ``dspark.DataLoader`` cuts each global batch into contiguous runs
of rows in rank order (rank 0 the first rows, then rank 1, ...; see [Note: even split of a batch] in
:mod:`dspark.data.order`): a last, partial batch gives some ranks one row fewer, or none, and a rank
with none holds a padding batch, which the gather leaves out (see [Note: padding batches] in
:mod:`dspark.data.padding`). So the ranks' rows of one batch, concatenated in rank order, are that
global batch as one process sees it, each sample once. The gather moves rows of different counts by
filling each rank's part up to the longest for the collective and cutting the filling off again on
arrival; none of it reaches the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from dspark import comm
from dspark.data.padding import current_batch_is_padding, rows_with_padding

__all__ = ["gather_for_metrics", "reduce_metrics"]

T = TypeVar("T")


def _describe(leaf: torch.Tensor) -> tuple[int, tuple[int, ...], str]:
    return leaf.shape[0], tuple(leaf.shape[1:]), str(leaf.dtype)


def gather_for_metrics(x: T) -> T:
    """Every rank's rows of ``x`` (a tensor, or a tuple/list/dict of them, nested), concatenated in
    rank order along dim 0, on every rank: with batches from :class:`dspark.DataLoader`, the global
    batch in the order one process sees it, each sample exactly once (see
    [Note: gathering in dataset order]). Every tensor's dim 0 is its rows; ranks may hold different
    numbers of rows (zero included) but the same trailing shape and dtype. A rank whose current
    batch is padding adds no rows (see [Note: padding batches] in :mod:`dspark.data.padding`).

    Example::

        for x, y in val_loader:
            preds, labels = dspark.gather_for_metrics((engine(x).argmax(-1), y))
            correct += int((preds == labels).sum())     # the same count on every rank
    """
    leaves, spec = pytree.tree_flatten(x)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"gather_for_metrics: part {i} of the input is a {type(leaf).__name__}; "
                            "pass tensors (or tuples/lists/dicts of them)")
        if leaf.ndim == 0:
            raise ValueError(f"gather_for_metrics: part {i} is a scalar tensor, which has no rows to "
                             "gather; for a per-rank value (a mean loss, a count) use "
                             "dspark.reduce_metrics({...}, weight=n)")
    world = comm.get_world()
    if world.world_size == 1:
        return x
    if current_batch_is_padding():
        leaves = [leaf[:0] for leaf in leaves]
    pass_rows = rows_with_padding()
    kept_padding = pass_rows if pass_rows is not None and all(leaf.shape[0] == pass_rows for leaf in leaves) else None
    described = comm.all_gather_object((str(spec), [_describe(leaf) for leaf in leaves], kept_padding),
                                       label="dspark.gather_for_metrics.layout")
    _refuse_kept_padding("gather_for_metrics", "rows", [kept for _, _, kept in described])
    _check_alike([(spec_r, parts) for spec_r, parts, _ in described])
    gathered = []
    for i, leaf in enumerate(leaves):
        counts = [parts[i][0] for _, parts, _ in described]
        longest = max(counts)
        padded = leaf.new_zeros((longest, *leaf.shape[1:]))
        padded[: leaf.shape[0]] = leaf.detach()
        out = leaf.new_empty((world.world_size, longest, *leaf.shape[1:]))
        comm.all_gather_into_tensor(out, padded.contiguous(), label="dspark.gather_for_metrics.all_gather")
        gathered.append(torch.cat([out[r, :n] for r, n in enumerate(counts)]))
    result: T = pytree.tree_unflatten(gathered, spec)
    return result


def _check_alike(described: list[tuple[str, list[tuple[int, tuple[int, ...], str]]]]) -> None:
    specs = {spec for spec, _ in described}
    if len(specs) > 1:
        raise ValueError("gather_for_metrics: the ranks passed differently nested inputs: "
                         + "; ".join(f"rank {r}: {spec}" for r, (spec, _) in enumerate(described)))
    for i in range(len(described[0][1])):
        kinds = [(parts[i][1], parts[i][2]) for _, parts in described]
        if len(set(kinds)) > 1:
            raise ValueError(
                f"gather_for_metrics: part {i} differs between ranks beyond its rows: "
                + ", ".join(f"rank {r}: rows x {shape} {dtype}" for r, (shape, dtype) in enumerate(kinds))
                + "; every rank must pass the same trailing shape and dtype")


def _refuse_kept_padding(call: str, what: str, kept: list[int | None]) -> None:
    """Refuse, on every rank, rows kept over a whole pass that ended on padding (see [Note: padding
    batches] in :mod:`dspark.data.padding`): ``kept[r]`` is rank ``r``'s row count if its input was
    exactly those rows."""
    ranks = [(r, n) for r, n in enumerate(kept) if n is not None]
    if ranks:
        raise ValueError(
            f"{call}: " + ", ".join(f"rank {r}'s {what} ({n})" for r, n in ranks) + " = the rows its last "
            "pass over a dspark.DataLoader handed out, its padding batch included (a copy of a sample "
            "another rank holds), so that sample would count twice. Gather or reduce per batch, inside "
            "the loop, or keep a batch's rows only when not loader.batch_info.padding (and weigh by "
            "loader.batch_info.local_size)")


def reduce_metrics(metrics: Mapping[str, Any], *, weight: float | int | torch.Tensor = 1.0
                   ) -> dict[str, torch.Tensor]:
    """The weighted mean of each metric over all ranks, on every rank: ``sum_r(w_r * m_r) /
    sum_r(w_r)``, with ``w_r`` this rank's ``weight`` (the samples or tokens its metrics average
    over). A metric is a number or a tensor (same shape on every rank; per-class values average
    element-wise). A rank with ``weight=0`` counts for nothing, even if its metric is NaN (the mean
    of no rows), and so does a rank whose current batch is padding (see [Note: padding batches] in
    :mod:`dspark.data.padding`). Returns float64 tensors on the CPU, shaped as the inputs (two
    collectives: the names and shapes compared, then one all-reduce).

    Example::

        out = dspark.reduce_metrics({"loss": loss_sum / n, "acc": correct / n}, weight=n)
        print(f"val loss {out['loss']:.4f}")   # the mean over every rank's n samples
    """
    if not metrics:
        raise ValueError("reduce_metrics: no metrics given; pass e.g. {'loss': loss}")
    w = float(weight.detach().float().item()) if isinstance(weight, torch.Tensor) else float(weight)
    if not (w >= 0.0 and w != float("inf")):
        raise ValueError(f"reduce_metrics: weight={weight!r} must be a finite number >= 0 (the samples "
                         "or tokens this rank's metrics average over)")
    if current_batch_is_padding():
        w = 0.0
    names = list(metrics)
    values = [torch.as_tensor(metrics[name]).detach().to("cpu", torch.float64) for name in names]
    # entry 0 counts the ranks, entry 1 sums the weights
    flat = torch.cat([torch.tensor([1.0, w], dtype=torch.float64)]
                     + [(v * w if w > 0 else torch.zeros_like(v)).reshape(-1) for v in values])
    world = comm.get_world()
    packed = flat.to(world.device) if world.device.type != "cpu" else flat
    pass_rows = rows_with_padding()
    kept_padding = pass_rows if pass_rows is not None and w == pass_rows else None
    # metrics that differ in names or shapes between ranks would misalign the sums silently
    described = comm.all_gather_object(([(name, tuple(v.shape)) for name, v in zip(names, values, strict=True)],
                                        kept_padding), label="dspark.reduce_metrics.layout")
    _refuse_kept_padding("reduce_metrics", "weight", [kept for _, kept in described])
    layouts = [layout for layout, _ in described]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError("reduce_metrics: the ranks passed different metrics ("
                         + "; ".join(f"rank {r}: {layout}" for r, layout in enumerate(layouts))
                         + "); pass the same names and shapes on every rank")
    comm.all_reduce(packed, label="dspark.reduce_metrics.all_reduce")
    total = packed.to("cpu")
    total_weight = float(total[1])
    if total_weight <= 0.0:
        raise ValueError(f"reduce_metrics: the weights sum to {total_weight} over {int(total[0])} ranks: "
                         "no rank had anything to average")
    out: dict[str, torch.Tensor] = {}
    at = 2
    for name, v in zip(names, values, strict=True):
        out[name] = (total[at: at + v.numel()] / total_weight).reshape(v.shape)
        at += v.numel()
    return out
