"""``dspark.DataLoader``: each rank loads only its rows of each global batch, in an order that is a
function of ``(seed, epoch)`` alone, and can stop and resume anywhere at any world size.

[Note: loader position] The loader's whole state is a position: ``(epoch, batches_consumed)`` plus
the settings that define the order (seed, global batch size, shuffle, drop_last, dataset length). A
batch counts as consumed once it is handed to the caller, not when a worker prefetched it. Every
``iter(loader)`` starts at the position: after a full pass that is the next epoch (which reshuffles
by itself; there is no ``set_epoch`` to forget), after a ``break`` it is the batch after the last one
handed out, and after ``load_state_dict`` it is the saved position. The position is global (no rank
in it), so a state saved at one world size resumes exactly at another. When the last batch of a
map-style epoch is handed out, the position moves to ``(epoch + 1, 0)`` at once, so that a checkpoint
taken then resumes at the next epoch rather than at an empty remainder of this one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset
from torch.utils.data._utils.collate import default_collate

from dspark.data.agreement import PASSES, check_same_settings, check_stream_in_step
from dspark.data.order import (
    BatchInfo,
    check_batch_size_value,
    check_global_batch_size,
    epoch_seed,
    global_batch_sizes,
    local_rows,
    smaller_batch_fix,
)
from dspark.data.padding import mark_current_batch, mark_pass_end
from dspark.data.sampler import GlobalBatchSampler
from dspark.data.stream import CollateWithInfo, RankStream

__all__ = ["DataLoader"]



def _built_where() -> str:
    """The file:line that built the loader: the first caller outside DSpark."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("dspark."):
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"

_STATE_KEYS = ("epoch", "batches_consumed", "seed", "global_batch_size", "shuffle", "drop_last",
               "num_samples")
_TORCH_BATCHING = {
    "batch_size": "global_batch_size= (samples per step summed over all ranks; each rank gets its share)",
    "sampler": "nothing: the loader is its own sampler (order by seed and epoch, rows by rank)",
    "batch_sampler": "nothing: the loader is its own sampler (order by seed and epoch, rows by rank)",
    "generator": "seed= (the order is a function of seed and epoch only)",
}


def _world_place(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None:
        from dspark import comm  # only when needed: tests and tools may pass the place explicitly

        world = comm.get_world()
        return world.rank, world.world_size
    if rank is None or world_size is None:
        raise ValueError(f"rank={rank!r} and world_size={world_size!r}: pass both, or neither (then "
                         "they come from dspark.init())")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1 (the number of ranks)")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r} must be an int in [0, world_size={world_size!r})")
    return rank, world_size


class DataLoader:
    """Load this rank's rows of each global batch of ``dataset`` (map-style or iterable), with
    PyTorch's DataLoader underneath (workers, pinned memory and collation as there).

    Example::

        loader = dspark.DataLoader(dataset, global_batch_size=256, shuffle=True, seed=0)
        for epoch in range(3):
            for x, y in loader:        # 256 / world_size rows on each rank; a new order each epoch
                engine.backward(loss_fn(engine(x), y))
                engine.step()

    Order: see [Note: global batch order] in :mod:`dspark.data.order` and, for iterable datasets,
    [Note: iterable datasets] in :mod:`dspark.data.stream`. Position and resume: see
    [Note: loader position] in :mod:`dspark.data.loader`. A dataset or stream with fewer samples than
    one global batch is a ``ValueError`` unless ``drop_last=False`` (then it is one partial batch).

    ``global_batch_size`` must divide by the world size, so that every rank's mean loss weighs the
    same number of samples; ``allow_uneven=True`` accepts any size that leaves no rank empty and
    splits it as evenly as possible (the first ``G % N`` ranks get one row more).
    ``drop_last=True`` (the default) drops the last, partial global batch of each epoch;
    ``drop_last=False`` serves it, split as evenly as possible over its own size, so any dataset
    length works and every sample is served exactly once per epoch (a rank gets one row fewer than
    others, or, when that batch holds fewer samples than there are ranks, one of its samples marked
    as padding: see [Note: padding batches] in :mod:`dspark.data.padding`). :attr:`batch_info` tells
    each batch's global and local sizes: weight an uneven batch with ``engine.backward(loss,
    weight=loader.batch_info.local_size)``, and evaluate with :func:`dspark.gather_for_metrics` /
    :func:`dspark.reduce_metrics`, which leave padding out.

    When the place in the world comes from ``dspark.init()``, every pass starts with one small
    all-gather that checks that every rank has the same dataset length, settings and position, and an
    iterable dataset's ranks agree before each batch that their streams go on (see
    [Note: data agreement] in :mod:`dspark.data.agreement`): every rank iterates such a loader. A
    pass on one rank alone (a plot, a sample dump) takes a loader built with ``rank=0, world_size=1``.
    ``shuffle`` must be False for an iterable dataset (it serves its own order). ``rank`` and
    ``world_size`` default to this process's place in :func:`dspark.init`'s world. Iterating never
    draws from torch's global random generator (worker seeds come from ``seed``, epoch and rank).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        allow_uneven: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout: float = 0.0,
        multiprocessing_context: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        **torch_only: Any,
    ) -> None:
        for name in torch_only:
            if name in _TORCH_BATCHING:
                raise TypeError(f"dspark.DataLoader takes no {name}=; use {_TORCH_BATCHING[name]}")
            raise TypeError(f"dspark.DataLoader got an unexpected keyword argument {name!r}")
        if global_batch_size is None:  # a keyword default only so that the message can say this
            raise TypeError("dspark.DataLoader needs global_batch_size= (samples per step summed over "
                            "all ranks; each rank gets its share)")
        check_batch_size_value(global_batch_size)  # a wrong value is named before the world is asked for
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        self.rank, self.world_size = _world_place(rank, world_size)
        # explicit places are a tool's or a test's, iterated by one process alone: nothing to agree with
        self._agree = rank is None and self.world_size > 1
        self._site = _built_where() if self._agree else ""
        check_global_batch_size(global_batch_size, self.world_size, allow_uneven=allow_uneven)
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn or default_collate
        self._is_iterable = isinstance(dataset, IterableDataset)
        self._torch_kwargs: dict[str, Any] = dict(
            num_workers=num_workers, pin_memory=pin_memory, persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor, worker_init_fn=worker_init_fn, timeout=timeout,
            multiprocessing_context=multiprocessing_context)
        self._epoch = 0
        self._consumed = 0
        self._generation = 0
        self._generator = torch.Generator()
        self._batch_info: BatchInfo | None = None
        self._sampler: GlobalBatchSampler | None = None
        self._torch_loader: TorchDataLoader[Any] | None = None
        if self._is_iterable:
            if self.shuffle:
                raise ValueError("shuffle=True with an iterable dataset: the loader cannot reorder a "
                                 "stream. Pass shuffle=False, and shuffle inside the dataset as a "
                                 "function of the epoch its set_epoch(epoch) method is given")
            if persistent_workers:
                raise ValueError("persistent_workers=True with an iterable dataset: its workers would "
                                 "keep reading the epoch they started with. Pass persistent_workers=False")
            self.num_samples: int | None = None
        else:
            self.num_samples = self._map_style_length(dataset)
            self._sampler = GlobalBatchSampler(
                self.num_samples, global_batch_size=global_batch_size, rank=self.rank,
                world_size=self.world_size, shuffle=self.shuffle, seed=seed, drop_last=self.drop_last)
            # one PyTorch loader for every pass: persistent workers survive, and the sampler it
            # consults in this process is told each pass's position
            self._torch_loader = TorchDataLoader(dataset, batch_sampler=self._sampler,
                                                 collate_fn=self.collate_fn,
                                                 generator=self._generator, **self._torch_kwargs)

    def _map_style_length(self, dataset: Any) -> int:
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
            raise TypeError(f"dataset of type {type(dataset).__name__} is neither map-style "
                            "(__getitem__ and __len__) nor a torch.utils.data.IterableDataset")
        num_samples = len(dataset)
        if num_samples < self.global_batch_size and (self.drop_last or not num_samples):
            raise ValueError(f"the dataset holds {num_samples} samples, fewer than one global batch of "
                             f"{self.global_batch_size}: no step could run. "
                             f"{smaller_batch_fix(num_samples, self.world_size)}; or, to evaluate, "
                             "drop_last=False serves them as one partial batch")
        return num_samples

    # -- position ----------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Global batches of :attr:`epoch` already handed out."""
        return self._consumed

    @property
    def batch_info(self) -> BatchInfo | None:
        """Where the batch last handed out sits (epoch, index, global and local sample counts);
        None before the first batch."""
        return self._batch_info

    @property
    def local_batch_size(self) -> int:
        """This rank's rows of a full global batch."""
        start, stop = local_rows(self.global_batch_size, self.world_size, self.rank)
        return stop - start

    def __len__(self) -> int:
        """Global batches in one epoch (each rank gets one local batch of each)."""
        if self._sampler is not None:
            return len(self._sampler.sizes)
        try:
            length = len(self.dataset)
        except TypeError:
            raise TypeError("this loader reads an iterable dataset without __len__: its number of "
                            "batches is known only at the end of each epoch") from None
        return len(global_batch_sizes(length, self.global_batch_size, drop_last=self.drop_last))

    def __iter__(self) -> Iterator[Any]:
        self._generation += 1
        return self._batches(self._generation)

    def _batches(self, generation: int) -> Iterator[Any]:
        self._check_current(generation)  # a generator starts at its first next(), not at iter()
        epoch, start = self._epoch, self._consumed
        if self._agree:
            check_same_settings(self._settings(), PASSES.start(self, self._site))
        # worker seeds (random augmentations) come from here, not from torch's global generator
        self._generator.manual_seed(epoch_seed(epoch_seed(self.seed, epoch), self.rank))
        if self._sampler is not None and self._torch_loader is not None:
            self._sampler.epoch, self._sampler.start_batch = epoch, start
            rows = padding_rows = 0
            for index, batch in enumerate(self._torch_loader, start=start):
                self._batch_info = info = self._sampler.batch_info(epoch, index)
                self._advance(last=index + 1 == len(self._sampler.sizes))
                rows, padding_rows = rows + info.local_size + info.padding, padding_rows + info.padding
                mark_current_batch(padding=info.padding > 0)
                yield batch
                self._check_current(generation)  # before fetching more: a stale pass takes nothing
            mark_pass_end(rows=rows, padding_rows=padding_rows)
            return
        stream = RankStream(self.dataset, global_batch_size=self.global_batch_size, rank=self.rank,
                            world_size=self.world_size, drop_last=self.drop_last, epoch=epoch,
                            start_batch=start)
        loader = TorchDataLoader(stream, batch_size=None, collate_fn=CollateWithInfo(self.collate_fn),
                                 generator=self._generator, **self._torch_kwargs)
        items = iter(loader)
        rows = padding_rows = 0
        while True:
            try:
                item = next(items, None)
            except Exception:
                if self._agree:  # the other ranks stop too, naming this one, rather than wait for it
                    check_stream_in_step(state="failed", global_size=0, epoch=epoch, index=self._consumed)
                raise
            if self._agree:
                check_stream_in_step(state="ended" if item is None else "batch",
                                     global_size=0 if item is None else item[0].global_size,
                                     epoch=epoch, index=self._consumed)
            if item is None:
                break
            info, batch = item
            self._batch_info = info
            self._advance(last=False)
            rows, padding_rows = rows + info.local_size + info.padding, padding_rows + info.padding
            mark_current_batch(padding=info.padding > 0)
            yield batch
            self._check_current(generation)
        mark_pass_end(rows=rows, padding_rows=padding_rows)
        self._epoch, self._consumed = epoch + 1, 0  # the stream's end is this epoch's end

    def _settings(self) -> dict[str, int]:
        """What every rank's loader must agree on when a pass starts (see [Note: data agreement])."""
        try:
            length = len(self.dataset) if self.num_samples is None else self.num_samples
        except TypeError:
            length = -1  # a stream without __len__: its batches are compared one by one instead
        return {"dataset length": length, "seed": self.seed, "global_batch_size": self.global_batch_size,
                "shuffle": int(self.shuffle), "drop_last": int(self.drop_last), "epoch": self._epoch,
                "batches_consumed": self._consumed}

    def _advance(self, *, last: bool) -> None:
        if last:
            self._epoch, self._consumed = self._epoch + 1, 0
        else:
            self._consumed += 1

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise RuntimeError("this iterator of a dspark.DataLoader is stale: a newer iter(loader) "
                               "or load_state_dict() moved the loader's position since it started; "
                               "iterate the newest iterator only")

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loader's position and the settings that define its order (plain ints and bools, JSON
        ready). No rank or world size in it: it resumes at any world size.

        Example::

            state = loader.state_dict()   # {"epoch": 1, "batches_consumed": 17, "seed": 0, ...}
        """
        return {"epoch": self._epoch, "batches_consumed": self._consumed, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the position in ``state`` (from :meth:`state_dict`, at any world size): the next
        batch is the one the saving run would have served next. Settings that define the order must
        match this loader's; a mismatch is a ``ValueError`` naming them.

        Example::

            loader.load_state_dict(json.loads(Path("ckpt/loader.json").read_text()))
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"loader state lacks {', '.join(missing)}: expected the keys of "
                             f"dspark.DataLoader.state_dict() ({', '.join(_STATE_KEYS)})")
        mine = self.state_dict()
        differ = [f"{key}={state[key]!r} (this loader: {mine[key]!r})" for key in _STATE_KEYS[2:]
                  if state[key] != mine[key]]
        if differ:
            raise ValueError(f"the loader state was saved with {'; '.join(differ)}: the same position "
                             "would be other samples. Build the loader with the saved settings")
        epoch, consumed = state["epoch"], state["batches_consumed"]
        if not (isinstance(epoch, int) and epoch >= 0 and isinstance(consumed, int) and consumed >= 0):
            raise ValueError(f"loader state epoch={epoch!r}, batches_consumed={consumed!r}: both must "
                             "be ints >= 0")
        if self._sampler is not None and consumed >= len(self._sampler.sizes):
            raise ValueError(f"loader state batches_consumed={consumed} is not below the "
                             f"{len(self._sampler.sizes)} global batches of an epoch")
        self._epoch, self._consumed = epoch, consumed
        self._batch_info = None
        self._generation += 1
