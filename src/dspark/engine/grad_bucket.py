"""Gradient buckets: gradients of one dtype grouped (about ``bucket_mb`` each) so that one collective
reduces many of them, launched from autograd hooks as soon as every gradient of the bucket is ready.

[Note: gradients live in buckets] Under replicate and zero1 every rank keeps whole gradients, so each
bucket owns one flat buffer and each parameter's ``.grad`` *is* a view into it (with the parameter's
strides, see [Note: memory layout]): the all-reduce runs in place, with no copy in or out and no
second copy of the gradients. The buffer exists from the window's first gradient to the optimizer
step, like gradients under ``zero_grad(set_to_none=True)`` in one process: between steps a rank
holds no gradient, so the next forward's activation peak does not include them (DDP keeps its
buckets, a second copy of the gradients, for the whole run). Under zero2 and zero3 a rank keeps
only its shard of each gradient: the bucket owns a flat *shard* buffer (``1/N`` of the
gradients), likewise from its launch to the optimizer step, and the whole gradients go into a pooled
send buffer (see [Note: packed as they arrive]); pooled
buffers are reused by later buckets once their collective has landed, so sending costs about two
buckets of memory, not a copy of the model's gradients, and the pool is emptied when the reduction
ends: a bucket as large as GPT-2's embedding gradient would otherwise stay allocated through
the next step's activation peak. (On CPU the engine's malloc setting keeps buffers up to glibc's
largest mmap threshold in the heap, so allocating them again each step costs no page faults: see
:mod:`dspark.cpu_malloc`.)

[Note: packed as they arrive] Under zero2 and zero3 each gradient is copied into its bucket's send
buffer the moment it is complete (from the second window on, once the counts per backward are known:
[Note: the first step observes]) and its whole tensor is freed there, so a rank never holds a
bucket's whole gradients *and* its send buffer: packing them all at launch held both, a bucket's
worth more than one process holds at the end of backward. A bucket of one parameter whose rows
split evenly over the ranks sends the gradient autograd made as it is (in memory order it already
is the send layout): no buffer, no copy. A bucket whose pooled buffer another bucket is still
filling gets a buffer of its own.

[Note: send layout] A sharded bucket sends an ``(N, seg)`` buffer: row ``r`` holds chunk ``r`` (padded)
of every parameter in turn, so a reduce-scatter hands rank ``r`` exactly its rows (on gloo,
``comm.reduce_scatter_tensor`` runs it as an all-to-all and a local sum). A backend without a
reduce-scatter (MPI) all-reduces the same buffer in place and each rank copies out its row.

[Note: two-level reduction] Under hybrid sharding ``N`` is the shard group's size and the sharded
collectives run in the shard group (see [Note: hybrid sharding] in :mod:`dspark.policy.rank_groups`);
each rank's reduced shard is then all-reduced across its replica group, the ranks holding the same
rows in the other groups, so that it sums every rank's gradients. That second collective starts
once the first has landed (:meth:`GradBucket.reduce_across`): a bucket's when the next bucket is
launched during backward (so that it runs beside the rest of backward), the remaining ones at the end
of backward, before any wait for them, or earlier where a pooled buffer is reused. Every rank makes
these calls in the same order (same buckets, same code path), which keeps each group's collectives
in one order on all its ranks. Whole gradients (zero1) are all-reduced over the world in
one collective, as under zero1.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from dspark import comm
from dspark.engine.finite_check import scale_and_check
from dspark.engine.param_slot import ParamSlot, SlotState
from dspark.engine.row_gather import in_place_parts, land_packed_rows, lands_in_place

__all__ = ["BufferPool", "GradBucket", "make_buckets", "memory_order_flat"]

log = logging.getLogger(__name__)


class BufferPool:
    """Flat communication buffers reused in turn (``depth`` per dtype). A buffer goes to the next bucket
    only after the bucket that held it has collected its result, so reuse never races a collective."""

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._owners: dict[tuple[torch.dtype, int], GradBucket] = {}
        self._turn: dict[torch.dtype, int] = {}

    def take(self, owner: GradBucket, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        key = self.wait_turn(owner, dtype)
        if key is None:
            # the bucket before in this turn is still packing gradients into its buffer (see
            # [Note: packed as they arrive]): this one gets a buffer of its own, outside the pool
            return torch.empty(numel, dtype=dtype, device=device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]

    def wait_turn(self, owner: GradBucket, dtype: torch.dtype) -> tuple[torch.dtype, int] | None:
        """Take the next turn for ``owner``: the bucket that held it collects its result first, so no
        more than ``depth`` buckets' collectives are in flight, whether they send a pooled buffer or a
        gradient of their own (see [Note: a bucket of one adopts its gradient]). Returns the turn's key,
        or None where its holder is still filling its buffer (it cannot be collected yet)."""
        turn = self._turn.get(dtype, 0)
        self._turn[dtype] = (turn + 1) % self.depth
        key = (dtype, turn)
        previous = self._owners.get(key)
        if previous is not None and previous is not owner and previous.filling:
            return None
        if previous is not None and previous is not owner:
            previous.collect()
        self._owners[key] = owner
        return key

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        """Free the buffers (after every bucket collected: nothing is in flight any more). They live
        only while one backward's reduction runs, so they are not part of the next forward's and
        backward's peak (see [Note: gradients live in buckets])."""
        self._owners.clear()
        self._buffers.clear()
        self._turn.clear()


class GradBucket:
    """The gradients of ``slots`` (one dtype), reduced by one collective per backward."""

    def __init__(self, index: int, slots: Sequence[ParamSlot], *, sharded: bool, collective: str,
                 wire_dtype: torch.dtype | None, rank: int, num_ranks: int, device: torch.device,
                 group: comm.Group | None = None, replica: comm.Group | None = None) -> None:
        dtypes = {s.dtype for s in slots}
        if len(dtypes) != 1:
            raise AssertionError(f"bucket {index} mixes dtypes {sorted(map(str, dtypes))}")
        if collective not in ("all_reduce", "reduce_scatter"):
            raise AssertionError(f"collective={collective!r}")
        self.index = index
        self.label = f"dspark.bucket{index}.{collective}"
        """This bucket's collective in traces and to comm observers (:mod:`dspark.engine.trace`)."""
        self.slots = list(slots)
        self.dtype = slots[0].dtype
        self.wire_dtype = wire_dtype or self.dtype
        self.sharded = sharded
        self.collective = collective
        self.rank = rank
        self.num_ranks = num_ranks
        """The ranks sharing each parameter's rows (the shard group's), ``rank`` this one's place."""
        self.device = device
        self.group = group
        """The shard group's collectives (None: the world's)."""
        self.replica = replica
        """Hybrid: the group each reduced shard is all-reduced across (see [Note: two-level reduction])."""
        self._across = False  # the collective in flight is the all-reduce across the replica group
        self.pending = len(self.slots)
        """Slots whose gradient for this backward is not complete yet."""
        self.launched = False
        self._handle: comm.Handle | None = None
        self._wire: torch.Tensor | None = None  # the pooled buffer the collective writes, if any
        self._collected = True
        self._gathering = False  # the collective in flight is the all-gather of updated rows
        self._send: torch.Tensor | None = None  # sharded: the (N, seg) send buffer being filled or in flight
        self._packed: set[int] = set()  # sharded: slots whose gradient is in _send already
        self._adopted = False  # sharded: _send is the gradient itself, no pooled buffer
        # This window's storage (see [Note: gradients live in buckets]): allocated when the first
        # gradient arrives (whole) or the bucket launches (shards), freed after the optimizer step.
        self.shard_buffer: torch.Tensor | None = None  # sharded: the reduced shards
        self.grad_buffer: torch.Tensor | None = None  # replicate/zero1: the whole gradients
        self.shard_offsets = _offsets([s.shard_numel for s in self.slots])
        """Where each slot's padded shard starts in a row of ``(N, seg)`` (see [Note: send layout])."""
        self.seg = sum(s.shard_numel for s in self.slots)
        self.offsets = self.shard_offsets if sharded else _offsets([s.numel for s in self.slots])

    @property
    def filling(self) -> bool:
        """Sharded: gradients are being packed into this bucket's pooled send buffer (it has not
        launched). A bucket that sends its own gradient holds no pooled buffer: the turn's buffer is free."""
        return self._send is not None and not self.launched and not self._adopted

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def _shards(self) -> torch.Tensor:
        """zero2/zero3: this window's flat shard buffer (allocated when the bucket launches)."""
        if self.shard_buffer is None:
            self.shard_buffer = torch.empty(self.seg, dtype=self.dtype, device=self.device)
        return self.shard_buffer

    def _whole(self) -> torch.Tensor:
        """replicate/zero1: this window's flat gradient buffer, each slot's ``grad_view`` a view into
        it (allocated when the first gradient arrives; every slot is written before it is read: by
        its first gradient, or zeroed at launch when this rank has none)."""
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            for slot, offset in zip(self.slots, self.offsets, strict=True):
                slot.grad_view = slot.view_full(self.grad_buffer[offset: offset + slot.numel])
        return self.grad_buffer

    def _adopt(self, slot: ParamSlot) -> bool:
        """[Note: a bucket of one adopts its gradient] A parameter larger than a bucket (an embedding,
        a vocabulary head) is alone in its bucket. Copying its fresh gradient into a new flat buffer
        would hold two copies of it at once, at the end of backward where a large embedding's
        gradient arrives: a one-process step holds one. Where the gradient autograd made fills its
        own storage in the parameter's memory order, that storage *is* the flat buffer: no copy, no
        second buffer. Elsewhere (several parameters, or another layout) it is copied in."""
        grad = slot.param.grad
        if (len(self.slots) != 1 or self.grad_buffer is not None or grad is None
                or grad.dtype != self.dtype or grad.device != self.device or grad.storage_offset() != 0
                or tuple(grad.stride()) != slot.strides
                or grad.untyped_storage().nbytes() != slot.numel * grad.element_size()):
            return False
        self.grad_buffer = memory_order_flat(slot, grad)
        slot.grad_view = grad
        return True

    def free_window(self) -> None:
        """After the optimizer step: free this window's gradients. A rank keeps no gradient between
        steps (as ``zero_grad(set_to_none=True)`` in one process), so they are not part of the next
        forward's activation peak."""
        self.shard_buffer = None
        self.grad_buffer = None
        if not self.sharded:
            for slot in self.slots:
                slot.grad_view = None

    # -- during backward -------------------------------------------------------------------------
    def absorb(self, slot: ParamSlot) -> None:
        """replicate/zero1: make ``slot``'s gradient live in this bucket. A gradient autograd created
        afresh (the parameter had ``grad=None``) is copied in once, or, in a bucket of one parameter,
        becomes the bucket's buffer itself (see [Note: a bucket of one adopts its gradient]); later
        accumulations then land in the bucket in place."""
        slot.assert_in(SlotState.WHOLE, SlotState.WHOLE_ROWS, doing="reducing its whole gradient in a bucket")
        if slot.grad_view is None and not self._adopt(slot):
            self._whole()
        grad, view = slot.param.grad, slot.grad_view
        if grad is None or view is None or grad.data_ptr() == view.data_ptr():
            return
        view.copy_(grad)
        slot.param.grad = view

    def launch(self, send_pool: BufferPool, out_pool: BufferPool, pre_scale: float) -> None:
        """Start the reduction (async). ``pre_scale`` multiplies the gradients on the way in (``1/N`` on
        a low-precision wire, so that the sum cannot overflow)."""
        if self.launched:
            raise AssertionError(f"bucket {self.index} launched twice")
        self.launched = True
        self._collected = False
        if self.sharded:
            self._launch_sharded(send_pool, out_pool, pre_scale)
            return
        grads = self._whole()
        for slot in self.slots:
            if not slot.used and slot.grad_view is not None:
                slot.grad_view.zero_()  # stale values of an earlier step: this rank adds nothing
        if self.wire_dtype == self.dtype:
            wire = grads
            if pre_scale != 1.0:
                wire.mul_(pre_scale)
        else:  # a low-precision wire: converted on the way in, back in collect()
            wire = send_pool.take(self, self.wire_dtype, grads.numel(), self.device)
            wire.copy_(grads)
            if pre_scale != 1.0:
                wire.mul_(pre_scale)
        self._wire = wire
        self._handle = comm.all_reduce(wire, async_op=True, label=self.label)

    def pack(self, slot: ParamSlot, send_pool: BufferPool) -> None:
        """zero2/zero3: ``slot``'s gradient is complete for this window: copy it into this bucket's
        send buffer now and free it (see [Note: packed as they arrive])."""
        grad = slot.param.grad
        if grad is None or id(slot) in self._packed:
            return
        if self._send is None and self._adopt_as_send(slot, grad, send_pool):
            return
        send = self._send_buffer(send_pool)
        offset = self.offsets[self.slots.index(slot)]
        _fill_chunks(send[:, offset: offset + slot.shard_numel], memory_order_flat(slot, grad))
        slot.param.grad = None  # zero2/zero3 keep no whole gradient
        self._packed.add(id(slot))

    def _adopt_as_send(self, slot: ParamSlot, grad: torch.Tensor, send_pool: BufferPool) -> bool:
        """A bucket of one parameter whose rows split evenly: its gradient, in memory order, already is
        the ``(N, seg)`` send layout (chunk ``r`` in row ``r``, no padding), so it is sent as it is."""
        n = self.num_ranks
        if (len(self.slots) != 1 or slot.rows % n or grad.dtype != self.wire_dtype
                or grad.device != self.device or grad.storage_offset() != 0
                or tuple(grad.stride()) != slot.strides
                or grad.untyped_storage().nbytes() != slot.numel * grad.element_size()):
            return False
        send_pool.wait_turn(self, self.wire_dtype)  # in flight with the pooled buffers, not beside them
        self._send = memory_order_flat(slot, grad).view(n, self.seg)
        self._adopted = True
        slot.param.grad = None
        self._packed.add(id(slot))
        return True

    def _send_buffer(self, send_pool: BufferPool) -> torch.Tensor:
        if self._send is None:
            n = self.num_ranks
            self._send = send_pool.take(self, self.wire_dtype, n * self.seg, self.device).view(n, self.seg)
        return self._send

    def _launch_sharded(self, send_pool: BufferPool, out_pool: BufferPool, pre_scale: float) -> None:
        send = self._send_buffer(send_pool)
        for slot, offset in zip(self.slots, self.offsets, strict=True):
            if id(slot) in self._packed:
                continue
            dst = send[:, offset: offset + slot.shard_numel]  # (N, shard): chunk r of the slot in row r
            grad = slot.param.grad
            if grad is None or not slot.used:
                dst.zero_()
                continue
            _fill_chunks(dst, memory_order_flat(slot, grad))
            slot.param.grad = None  # zero2/zero3 keep no whole gradient
        self._packed.clear()
        if pre_scale != 1.0:
            send.mul_(pre_scale)
        if self.collective == "reduce_scatter":
            out = (self._shards() if self.wire_dtype == self.dtype else
                   out_pool.take(self, self.wire_dtype, self.seg, self.device))
            self._wire = out
            self._handle = comm.reduce_scatter_tensor(out, send, async_op=True, group=self.group,
                                                      label=self.label)
        else:
            self._wire = send
            self._handle = comm.all_reduce(send, async_op=True, group=self.group, label=self.label)

    def reduce_across(self) -> None:
        """Hybrid, sharded: once this bucket's shard is reduced inside its shard group, start its
        all-reduce across the replica group (see [Note: two-level reduction]); else nothing."""
        if self.replica is None or not self.sharded or self._collected or self._gathering or self._across:
            return
        if self._handle is None or self._wire is None:
            raise AssertionError(f"bucket {self.index} reduced across before it was launched")
        self._handle.wait()
        wire = self._wire
        part = wire if self.collective == "reduce_scatter" else wire.view(self.num_ranks, self.seg)[self.rank]
        self._wire = part
        self._across = True
        self._handle = comm.all_reduce(part, async_op=True, group=self.replica,
                                       label=f"dspark.bucket{self.index}.all_reduce_across")

    # -- after the optimizer step (zero1, zero2) ----------------------------------------------------
    def launch_gather(self, send_pool: BufferPool, out_pool: BufferPool) -> None:
        """Start the all-gather of this rank's updated rows of every parameter (async): straight into
        the parameters where it can (see [Note: rows gathered in place] in
        :mod:`dspark.engine.row_gather`), else packed as the reduction's shards are (see [Note: send
        layout]) and landed in the full parameters by :meth:`collect`."""
        n, seg = self.num_ranks, self.seg
        self._gathering = True
        self._collected = False
        direct = in_place_parts(self.slots, self.rank, n) if lands_in_place(self.group, self.device) else None
        if direct is not None:  # see [Note: rows gathered in place]
            self._handle = comm.all_gather_parts(*direct, async_op=True, group=self.group,
                                                 label=f"dspark.bucket{self.index}.all_gather")
            return
        send = send_pool.take(self, self.dtype, seg, self.device)
        out = out_pool.take(self, self.dtype, n * seg, self.device).view(n, seg)
        for slot, offset in zip(self.slots, self.shard_offsets, strict=True):
            rows = slot.rows_view(slot.param.detach())[slot.start:slot.stop]
            slot.view_rows(send[offset:], slot.local_rows).copy_(rows)  # padding: never read
        self._wire = out
        self._handle = comm.all_gather_into_tensor(out, send, async_op=True, group=self.group,
                                                   label=f"dspark.bucket{self.index}.all_gather")

    # -- after the collective ----------------------------------------------------------------------
    def collect(self) -> None:
        """Wait for the collective and move its result into the bucket's persistent storage (unscaled),
        or, for the gather of updated rows, into the full parameters."""
        if self._collected:
            return
        self.reduce_across()
        if self._handle is None:
            raise AssertionError(f"bucket {self.index} collected before it was launched")
        self._handle.wait()
        wire = self._wire
        if self._gathering:
            if wire is not None:  # packed: land the other ranks' rows (in place: landed already)
                land_packed_rows(self.slots, self.shard_offsets, self.rank, wire)
            self._gathering = False
        elif wire is None:
            raise AssertionError(f"bucket {self.index}: a reduction without its buffer")
        elif self.sharded:
            shards = self._shards()
            if self.collective == "all_reduce" and not self._across:
                shards.copy_(wire.view(self.num_ranks, self.seg)[self.rank])
            elif wire is not shards:
                shards.copy_(wire)
        elif self.grad_buffer is not None and wire is not self.grad_buffer:
            self.grad_buffer.copy_(wire)
        self._handle = None
        self._wire = None
        self._send = None
        self._adopted = False
        self._collected = True

    def finish(self, post_scale: float, used_anywhere: Sequence[bool], found_inf: torch.Tensor | None = None) -> None:
        """Scale the reduced gradients and hand them to the parameters (or their shards): a parameter
        no rank produced a gradient for keeps ``grad=None``, as in single-process PyTorch. With
        ``found_inf`` the same pass flags a value that is not finite (see [Note: non-finite gradients
        found in the reduction] in :mod:`dspark.engine.finite_check`)."""
        self.collect()
        if self.sharded:
            shards = self._shards()
            scale_and_check([shards], post_scale, found_inf)
            for slot, offset, used in zip(self.slots, self.offsets, used_anywhere, strict=True):
                slot.shard_grad = shards[offset: offset + slot.shard_numel] if used else None
        else:
            if self.grad_buffer is not None:
                scale_and_check([self.grad_buffer], post_scale, found_inf)
            for slot, used in zip(self.slots, used_anywhere, strict=True):
                slot.param.grad = slot.grad_view if used else None
        self.reset()

    def add_to_shards(self, post_scale: float, found_inf: torch.Tensor | None = None) -> None:
        """A bucket of gradients that arrived late (after their first bucket left): add its reduced
        shards, scaled (and checked, with ``found_inf``, as :meth:`finish` does), into the slots'
        shard gradients."""
        self.collect()
        shards = self._shards()
        scale_and_check([shards], post_scale, found_inf)
        for slot, offset in zip(self.slots, self.offsets, strict=True):
            late = shards[offset: offset + slot.shard_numel]
            if slot.shard_grad is None:
                slot.shard_grad = late.clone()  # its own storage, as before: the late bucket goes
            else:
                slot.shard_grad.add_(late)
        self.reset()

    def abandon(self) -> None:
        """After a failed backward: let a collective already launched land before its buffer is
        reused (peers launched it too: it completes), then reset. Its result is discarded."""
        handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.wait()
            except Exception:  # the window failed already: that error is the one to report
                log.debug("bucket %d: the abandoned collective failed too", self.index, exc_info=True)
        self.reset()

    def reset(self) -> None:
        """Back to the state before a backward (also after a failed one: nothing stays in flight here)."""
        self.launched = False
        self._gathering = False
        self._across = False
        self.pending = len(self.slots)
        self._handle = None
        self._wire = None
        self._send = None
        self._adopted = False
        self._packed.clear()
        self._collected = True


def _offsets(sizes: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def memory_order_flat(slot: ParamSlot, grad: torch.Tensor) -> torch.Tensor:
    """``grad``'s elements in the parameter's memory order, as a 1-D tensor (a view when its strides
    are the parameter's, else a copy)."""
    if tuple(grad.stride()) == slot.strides:
        return grad.as_strided((slot.numel,), (1,))
    flat = torch.empty(slot.numel, dtype=grad.dtype, device=grad.device)
    slot.copy_to_flat(flat, grad)
    return flat


def _fill_chunks(dst: torch.Tensor, flat: torch.Tensor) -> None:
    """Write ``flat`` (one parameter, memory order) into ``dst`` (``(N, shard)``: chunk ``r`` in row
    ``r``), zero-padding the end."""
    n, shard = dst.shape
    whole = min(flat.numel() // shard, n) if shard else n
    if whole:
        dst[:whole].copy_(flat[: whole * shard].view(whole, shard))
    if whole < n:
        rest = flat.numel() - whole * shard
        dst[whole, :rest].copy_(flat[whole * shard:])
        dst[whole, rest:].zero_()
        dst[whole + 1:].zero_()


def make_buckets(order: Sequence[ParamSlot], *, bucket_mb: float, sharded: bool, collective: str,
                 wire_dtype: torch.dtype | None, rank: int, num_ranks: int, device: torch.device,
                 group: comm.Group | None = None, replica: comm.Group | None = None) -> list[GradBucket]:
    """Group ``order`` (the order backward produces gradients) into single-dtype buckets of about
    ``bucket_mb`` megabytes (at least one parameter each; MB = 2**20 bytes), listed in the order they
    are expected to become ready (by their first slot)."""
    limit = bucket_mb * 2**20
    open_groups: dict[torch.dtype, tuple[list[ParamSlot], float]] = {}
    groups: list[tuple[int, list[ParamSlot]]] = []
    first_index: dict[int, int] = {}
    for position, slot in enumerate(order):
        current, size = open_groups.get(slot.dtype, ([], 0.0))
        nbytes = slot.numel * slot.param.element_size()
        if current and size + nbytes > limit:
            groups.append((first_index[id(current)], current))
            current, size = [], 0.0
        if not current:
            first_index[id(current)] = position
        current.append(slot)
        open_groups[slot.dtype] = (current, size + nbytes)
    for current, _size in open_groups.values():
        if current:
            groups.append((first_index[id(current)], current))
    groups.sort(key=lambda item: item[0])
    return [GradBucket(i, g, sharded=sharded, collective=collective, wire_dtype=wire_dtype, rank=rank,
                       num_ranks=num_ranks, device=device, group=group, replica=replica)
            for i, (_, g) in enumerate(groups)]
