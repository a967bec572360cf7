"""Checks that every rank's loader walks the same data in step: one small all-gather at the start of
each pass (the settings and position that define the order), and, for an iterable dataset, one per
batch (whether the stream still had a batch), so that ranks never drift apart silently.

[Note: data agreement] N ranks train one model only if batch ``b`` of epoch ``e`` is the same global
batch on every rank. A dataset whose length differs between ranks (another file list, a filter that
depends on the host) gives each rank another order and another number of batches: the gradient
reductions then pair rank 0's batch with rank 1's other batch, or one rank starts the next epoch while
the other is still in this one. Map-style: the length, seed, global batch size, shuffle, drop_last and
the position are compared when a pass starts; any difference is a ``ValueError`` on every rank naming
each rank's value. Iterable: every rank reads the same stream, so the ranks compare, before each batch
is handed out, whether they have one and how large its global batch is; a stream that ended on some
ranks only is a ``ValueError`` on every rank naming them, at that batch. Only a loader whose place in
the world came from ``dspark.init()`` checks (one built with explicit ``rank=``/``world_size=`` is a
tool's or a test's, and may be iterated by one process alone).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dspark import comm

__all__ = ["check_same_settings", "check_stream_in_step"]


def _gather(values: list[int]) -> list[list[int]]:
    world = comm.get_world()
    mine = torch.tensor(values, dtype=torch.int64, device=world.device)
    return [[int(v) for v in row.tolist()] for row in comm.all_gather(mine, label="data agreement")]


def _per_rank(values: list[int]) -> str:
    return ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))


def check_same_settings(settings: Mapping[str, int]) -> None:
    """Raise ``ValueError`` on every rank unless every rank passes the same ``settings`` (one
    all-gather of ``len(settings)`` int64 values).

    Example::

        check_same_settings({"dataset length": len(dataset), "seed": 0, "epoch": 1})
    """
    names = list(settings)
    rows = _gather([int(settings[name]) for name in names])
    differ = [f"{name}: {_per_rank([row[i] for row in rows])}" for i, name in enumerate(names)
              if len({row[i] for row in rows}) > 1]
    if differ:
        raise ValueError(
            f"rank {comm.get_world().rank}: the ranks' dspark.DataLoaders disagree ({'; '.join(differ)}): "
            "the ranks would train on different batches and drift apart. Give every rank the same "
            "dataset (the same files and filters) and the same loader settings, and resume every rank "
            "from the same loader state")


_STATES = {"ended": 0, "batch": 1, "failed": 2}


def check_stream_in_step(*, state: str, global_size: int, epoch: int, index: int) -> None:
    """Raise on every rank unless every rank's stream has global batch ``index`` of ``epoch``, of the
    same size, or every rank's stream has ended (one all-gather of two int64s). ``state`` is this
    rank's: ``"batch"``, ``"ended"``, or ``"failed"`` (reading raised: the caller re-raises it, and the
    other ranks raise a ``RuntimeError`` naming this rank instead of waiting for it).

    Example::

        check_stream_in_step(state="batch", global_size=64, epoch=0, index=3)
    """
    rows = _gather([_STATES[state], global_size if state == "batch" else 0])
    failed = [r for r, row in enumerate(rows) if row[0] == _STATES["failed"]]
    if failed:
        if state == "failed":
            return
        raise RuntimeError(
            f"rank {comm.get_world().rank}: reading global batch {index} of epoch {epoch} of the iterable "
            f"dataset raised on rank(s) {', '.join(map(str, failed))} (its traceback is in that rank's "
            "output); this rank stops with it")
    having = [r for r, row in enumerate(rows) if row[0] == _STATES["batch"]]
    if having and len(having) < len(rows):
        ended = [r for r in range(len(rows)) if r not in having]
        raise ValueError(
            f"rank {comm.get_world().rank}: the iterable dataset's stream ended on rank(s) "
            f"{', '.join(map(str, ended))} after {index} global batches of epoch {epoch}, while rank(s) "
            f"{', '.join(map(str, having))} still had samples: every rank must read the same stream "
            "(dspark.DataLoader takes each rank's rows itself; a dataset must not split itself by rank)")
    sizes = [row[1] for row in rows]
    if having and len(set(sizes)) > 1:
        raise ValueError(
            f"rank {comm.get_world().rank}: global batch {index} of epoch {epoch} of the iterable "
            f"dataset holds {_per_rank(sizes)} samples: the ranks' streams differ in length; every "
            "rank must read the same stream")
