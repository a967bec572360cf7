"""zero3's all-gathers: one :class:`Gather` per dtype of a unit's parameters, and the 8-byte tag
each rank adds to it so that the ranks find out when they gather different things
(:class:`GatherTags`, [Note: gather tags]). :mod:`dspark.engine.zero3_units` decides when to gather.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from dspark import comm, cpu_malloc
from dspark.engine.param_slot import ParamSlot, SlotState
from dspark.errors import CollectiveError
from dspark.policy.units import TAG_BYTES

__all__ = ["BACKWARD", "DEFERRED_TAG_CHECKS", "FORWARD", "NO_GRAD", "PURPOSES", "Gather",
           "GatherTags", "tag_tensor", "tags_of"]

FORWARD, NO_GRAD, BACKWARD = 1, 2, 3
"""The phases a gather can serve besides :data:`PURPOSES`: a training forward, a forward without
grad, backward."""
PURPOSES = ("full_state_dict", "save_pretrained")
"""The engine's own calls that gather parameters outside a forward, each its phase in gather tags."""
_PHASE_NAMES = {FORWARD: "a training forward", NO_GRAD: "a forward without grad (evaluation)",
                BACKWARD: "backward", **{4 + i: f"engine.{name}()" for i, name in enumerate(PURPOSES)}}
DEFERRED_TAG_CHECKS = 256
"""On an accelerator, gather tags are checked at the end of backward or after this many gathers."""


class Gather:
    """One all-gather of several same-dtype parameters' shards and an 8-byte tag saying what it
    gathers (see [Note: gather tags]): ``comm.all_gather_parts`` lands every rank's shard of
    parameter ``i`` in its own full, padded storage (``chunk * N`` rows, memory order), which is
    installed as the parameter (and recorded in ``installed``, storage pointer -> slot), and every
    rank's tag in ``tags``, which ``check`` reads once the gather landed."""

    def __init__(self, slots: list[ParamSlot], label: str, installed: dict[int, ParamSlot],
                 tag: int, check: Callable[[Gather, torch.Tensor], None], group: comm.Group | None = None) -> None:
        self.slots = slots
        self.installed = installed
        self.tag = tag
        self._check = check
        header = tag_tensor(tag, slots[0].dtype, slots[0].param.device)
        n = slots[0].num_ranks
        shards = [_shard(s) for s in slots]
        # each parameter's full, padded storage (chunk * N rows, memory order), and every rank's tag
        self.fulls: list[torch.Tensor] | None = [_fresh_full(t, n) for t in shards]
        self.tags = header.new_empty((n, header.numel()))
        self.handle: comm.Handle | None = comm.all_gather_parts(
            [*shards, header], [*self.fulls, self.tags], async_op=True, group=group, label=label)
        for slot in slots:
            slot.pending = self

    def finish(self) -> None:
        if self.handle is None:
            return
        self.handle.wait()
        self.handle = None
        fulls, self.fulls = self.fulls, None
        try:
            self._check(self, tags_of(self.tags))
        except BaseException:
            for slot in self.slots:  # nothing was installed: later gathers must not wait on this one
                if slot.pending is self:
                    slot.pending = None
            raise
        assert fulls is not None
        for slot, full in zip(self.slots, fulls, strict=True):
            if slot.pending is self:
                slot.set_full(full)
                self.installed[slot.param.untyped_storage().data_ptr()] = slot


def _fresh_full(shard: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Storage for a parameter gathered from ``shard``: on a CPU, one the C library maps apart gets
    huge pages, since it is faulted in afresh at every gather (see [Note: huge pages for mapped
    storages] in :mod:`dspark.cpu_malloc`)."""
    full = shard.new_empty(num_ranks * shard.numel())
    if full.device.type == "cpu":
        cpu_malloc.advise_huge_pages(full.data_ptr(), full.numel() * full.element_size())
    return full


@functools.lru_cache(maxsize=4096)
def tag_tensor(tag: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tag`` as the raw bytes of a few elements of ``dtype`` (a gather copies bytes: any dtype
    carries them exactly); cached, read only.

    Example::

        tags_of(torch.stack([tag_tensor(7, torch.bfloat16, cpu)])).tolist()   # [7]
    """
    raw = torch.tensor([tag], dtype=torch.int64, device=device)  # TAG_BYTES
    if dtype.itemsize <= raw.element_size():  # a whole number of elements: one tensor, no copy (the
        return raw.view(dtype)                 # cache misses at every gather of a model of many units)
    header = torch.zeros(-(-TAG_BYTES // dtype.itemsize), dtype=dtype, device=device)
    header.view(torch.uint8)[:TAG_BYTES].copy_(raw.view(torch.uint8))
    return header


def tags_of(headers: torch.Tensor) -> torch.Tensor:
    """Each rank's tag (int64, one per row) from the gathered headers ``(N, elements)``."""
    raw = headers.contiguous().view(torch.uint8)[:, :TAG_BYTES]
    return raw.contiguous().view(torch.int64).view(-1).clone()  # never a view of the gather's buffer


def _shard(slot: ParamSlot) -> torch.Tensor:
    slot.assert_in(SlotState.SHARDED, doing="starting a gather")
    if slot.shard_flat is None:
        raise AssertionError(f"{slot.name}: gather without a shard")
    return slot.shard_flat


class GatherTags:
    """What each gather's tag says on this rank, and the check of every rank's tags.

    [Note: gather tags] Every rank must gather the same parameters in the same order, for the same
    purpose; a rank that runs a forward of its own (an evaluation on rank 0 only, one more generated
    token) would otherwise pair its gathers with its peers' next ones: the same sizes exchange the
    wrong data, or the job hangs at the first collective that differs, until the timeout. So each
    rank's piece of a gather ends with 8 bytes naming its first and last parameter, the phase
    (training forward, forward without grad, backward, or the engine call that gathers, e.g.
    engine.full_state_dict()) and the accumulation window's index modulo 128 (so that a rank that
    skipped a batch or a step parts from its peers at its next gather), and every rank compares the
    tags it receives: a mismatch is a CollectiveError on every rank, at the gather where the ranks
    parted. Bits: window << 56 | phase << 48 | first << 24 | last.
    On CPU the check reads the tags when the gather lands; on an accelerator (``defer``) it is
    batched to the end of backward (or every :data:`DEFERRED_TAG_CHECKS` gathers), so that no gather
    adds a host sync.
    """

    def __init__(self, slots: list[ParamSlot], *, in_backward: Callable[[], bool],
                 window: Callable[[], int], ranks: Callable[[int], int] = lambda r: r) -> None:
        self._slots = slots
        self._ranks = ranks  # a gather's rank -> the world's (hybrid: gathers run in a shard group)
        self._position = {id(s): i for i, s in enumerate(slots)}
        self._in_backward = in_backward
        self._window = window  # see [Note: ranks in step] in dspark.engine.window
        self.activity: int | None = None
        """The phase of an engine call of its own that gathers now (``4 + PURPOSES.index(name)``)."""
        self.defer = any(s.param.device.type != "cpu" for s in slots)
        """Check in batches: on an accelerator, reading a gather's tags would sync the host."""
        self.deferred: list[tuple[int, torch.Tensor]] = []
        """(this rank's tag, every rank's tags) of the gathers not checked yet."""

    def tag(self, group: list[ParamSlot]) -> int:
        """This rank's tag for a gather of ``group`` now."""
        phase = self.activity or (
            BACKWARD if self._in_backward() else (FORWARD if torch.is_grad_enabled() else NO_GRAD))
        return (((self._window() % 128) << 56) | (phase << 48) | (self._position[id(group[0])] << 24)
                | self._position[id(group[-1])])

    def check(self, gather: Gather, tags: torch.Tensor) -> None:
        """Compare every rank's ``tags`` of ``gather`` with its own, now or (``defer``) later."""
        if not self.defer:
            self._verify(gather.tag, tags.tolist())
            return
        self.deferred.append((gather.tag, tags))
        if len(self.deferred) >= DEFERRED_TAG_CHECKS:
            self.verify_deferred()

    def verify_deferred(self) -> None:
        """Check the tags :meth:`check` kept for later (one host sync for all of them)."""
        deferred, self.deferred = self.deferred, []
        if deferred:
            received = torch.stack([tags for _, tags in deferred]).tolist()  # one host sync
            for (mine, _), tags in zip(deferred, received, strict=True):
                self._verify(mine, tags)

    def _verify(self, mine: int, tags: list[int]) -> None:
        other = next((r for r, tag in enumerate(tags) if tag != mine), None)
        if other is None:
            return
        me = comm.get_world().rank
        windows = (mine >> 56) != (tags[other] >> 56)
        training = ("In training, a unit that runs on some ranks only (an early exit, LayerDrop, expert "
                    "routing that skips a block on one rank): make the choice the same on every rank (seed "
                    "it alike), or run the skipped unit with a zero contribution (e.g. on an empty batch, "
                    "or multiplied by 0).")
        evaluation = ("In evaluation: evaluate on every rank (each on its own share of the data), not on "
                      "rank 0 alone; generate the same number of tokens on every rank (HuggingFace's "
                      "generate(): synced_gpus=True, the default DSpark gives the engine's module); for an "
                      "evaluation on one rank, load engine.full_state_dict() into a plain copy of the model.")
        phases = {(tag >> 48) & 0xFF for tag in (mine, tags[other])}
        if NO_GRAD in phases and len(phases) == 2:  # one side evaluates, the other does not
            advice = ("One side ran a forward without grad that the other did not: an evaluation on some "
                      "ranks only, such as `if master_process: estimate_loss()` kept from a DDP loop. "
                      f"{evaluation} {training}")
        else:
            advice = f"{training} {evaluation}"
        raise CollectiveError(
            f"rank {me}: under zero3 the ranks gathered different parameters in one all-gather: this "
            f"rank gathered {self._describe(mine, windows)}, rank {self._ranks(other)} "
            f"{self._describe(tags[other], windows)}. {advice} Each zero3 forward and backward gathers "
            "parameters together with every rank, so every rank must run the same units in the same "
            "order; or train with strategy='zero2', which runs such models as one process does.")

    def _describe(self, tag: int, window: bool = False) -> str:
        phase, first, last = (tag >> 48) & 0xFF, (tag >> 24) & 0xFFFFFF, tag & 0xFFFFFF
        if phase not in _PHASE_NAMES or first >= len(self._slots) or last >= len(self._slots):
            return f"something else (tag {tag:#x}: not a zero3 gather of this model)"
        names = self._slots[first].name if first == last else (
            f"{self._slots[first].name} ... {self._slots[last].name}")
        where = f" in accumulation window {tag >> 56} (mod 128)" if window else ""
        return f"{names} for {_PHASE_NAMES[phase]}{where}"
