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

[Note: a pass on some ranks only] A loop over a loader that runs on some ranks only (DDP's ``if
master_process: estimate_loss()`` kept, over a validation loader) starts a pass there alone: its
check then pairs with whatever check the other ranks make next, usually another loader's, whose
seed and length differ, and "the loaders disagree" would hide what happened. So each pass's check
also carries which loader it is over (its number among this process's checking loaders, in the
order of their first passes) and how many passes this process has started over all of them. Ranks
that differ in either ran a loop the others did not, and the ``ValueError`` says that, naming each
rank's pass and where its loader was built (gathered then, on every rank), before the settings are
compared. (A loader built on some ranks and never iterated gets no number and changes nothing; after
the error, and in a new world, every rank numbers afresh.)
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import torch

from dspark import comm

__all__ = ["PASSES", "PassNumbers", "PassOrigin", "check_same_settings", "check_stream_in_step"]


class PassOrigin(NamedTuple):
    """Which pass of this process starts, over which loader (see [Note: a pass on some ranks only])."""

    loader: int
    """The loader's number among this process's checking loaders, in the order of their first passes."""
    passes: int
    """Passes this process has started over all its checking loaders, this one included."""
    site: str
    """Where the loader was built (``file:line`` of the caller)."""

    def describe(self) -> str:
        return f"its pass {self.passes}, over its loader {self.loader} (built at {self.site})"


class PassNumbers:
    """This process's loaders that check with the other ranks, numbered at their first pass, and the
    passes they started (see [Note: a pass on some ranks only]). A new world, and a difference found
    (every rank raises it), start again from one, so that ranks that go on stay in step.

    Example::

        origin = PASSES.start(loader, "train.py:40")   # PassOrigin(loader=1, passes=1, ...)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._loaders = itertools.count(1)
        self._passes = itertools.count(1)
        self._numbers: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    def start(self, loader: object, site: str) -> PassOrigin:
        """The origin of the pass ``loader`` (built at ``site``) starts now."""
        number = self._numbers.get(loader)
        if number is None:
            number = self._numbers[loader] = next(self._loaders)
        return PassOrigin(loader=number, passes=next(self._passes), site=site)


PASSES = PassNumbers()
comm.add_shutdown_hook(PASSES.reset)


def _gather(values: list[int]) -> list[list[int]]:
    world = comm.get_world()
    mine = torch.tensor(values, dtype=torch.int64, device=world.device)
    return [[int(v) for v in row.tolist()] for row in comm.all_gather(mine, label="data agreement")]


def _per_rank(values: list[int]) -> str:
    return ", ".join(f"{v} on rank {r}" for r, v in enumerate(values))


def check_same_settings(settings: Mapping[str, int], origin: PassOrigin | None = None) -> None:
    """Raise ``ValueError`` on every rank unless every rank passes the same ``settings`` and starts a
    pass of the same ``origin`` (one all-gather of ``len(settings) + 2`` int64 values; see [Note: a
    pass on some ranks only]).

    Example::

        check_same_settings({"dataset length": len(dataset), "seed": 0, "epoch": 1},
                            PassOrigin(loader=1, passes=3, site="train.py:40"))
    """
    names = list(settings)
    where = [0, 0] if origin is None else [origin.loader, origin.passes]
    rows = _gather([*where, *(int(settings[name]) for name in names)])
    if origin is not None and len({tuple(row[:2]) for row in rows}) > 1:
        PASSES.reset()
        _raise_pass_on_some_ranks(origin)
    rows = [row[2:] for row in rows]
    differ = [f"{name}: {_per_rank([row[i] for row in rows])}" for i, name in enumerate(names)
              if len({row[i] for row in rows}) > 1]
    if differ:
        raise ValueError(
            f"rank {comm.get_world().rank}: the ranks' dspark.DataLoaders disagree ({'; '.join(differ)}): "
            "the ranks would train on different batches and drift apart. Give every rank the same "
            "dataset (the same files and filters) and the same loader settings, and resume every rank "
            "from the same loader state")


def _raise_pass_on_some_ranks(origin: PassOrigin) -> None:
    """Every rank saw the same rows: every rank gathers where its loader was built, and raises."""
    origins = comm.all_gather_object(tuple(origin), label="data agreement: loader sites")
    each = "; ".join(f"rank {r}: {PassOrigin(*o).describe()}" for r, o in enumerate(origins))
    raise ValueError(
        f"rank {comm.get_world().rank}: the ranks started different passes over their dspark.DataLoaders "
        f"({each}): one rank ran a loop over a dspark.DataLoader that the others did not, such as an "
        "evaluation under `if master_process:` kept from a DDP loop, or a loop on some ranks only. "
        "Every rank must iterate every dspark.DataLoader, pass for pass: evaluate on every rank (each "
        "on its rows; dspark.reduce_metrics or dspark.gather_for_metrics combine them), or give the "
        "one-rank loop a loader built with rank=0, world_size=1")


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
