"""The gradient reducer: counts gradients as autograd accumulates them, launches each bucket's collective
as soon as its gradients are complete, and at the end of backward averages them across ranks with the
right weights.

[Note: the first step observes] The first buckets follow the reverse of registration order (the order
backward usually produces gradients). During the first window that communicates, the reducer records
the order in which gradients really arrive and how many times each parameter's gradient is accumulated
(a parameter used inside a reentrant activation checkpoint and outside it gets two). After that step
the ranks agree on rank 0's order and the largest counts, and the buckets are rebuilt in that order, so
the first bucket holds the first gradients ready. While observing, whole-gradient buckets (replicate,
zero1) launch only when backward ends, since a second accumulation into a bucket in flight would race
the collective; sharded buckets launch early (their gradients must not pile up) and a contribution that
arrives after its bucket left travels in one extra bucket at the end. From then on a bucket launches
the moment its last gradient is complete, and a gradient that arrives after its bucket left is an error
(the count changed between steps), never a silently lost contribution.

[Note: step extras] Besides the buckets, each window that communicates all-reduces one small float64
vector: ``[sum of weights, ranks that gave a weight, per rank its local batch size + 1 (0: unknown),
per rank its position, per rank a fingerprint of its optimizer's hyper-parameters, per parameter (in
bucket order) 1 if a gradient arrived on this rank]`` (a per-rank entry is written by its rank alone,
zeros elsewhere). A position is the window's index,
its training forwards and its backward() calls packed in one integer, with bit 0 set when a loss of
the window was not finite (:meth:`StepTag.encode`; see [Note: ranks in step] in
:mod:`dspark.engine.window`). It tells whether a parameter got a gradient on any rank (else it keeps
``grad=None``, as in one process), the weights for ``engine.backward(loss, weight=n)``, whether
unweighted ranks had unequal batches, whether the ranks ran the same micro-batches of the same window
(errors: the average would not be the mean over the samples, or would mix windows), and whether any
rank's loss was not finite (the step is then skipped: [Note: non-finite steps]). The fingerprints
are compared by the caller ([Note: hyper-parameters in step] in :mod:`dspark.engine.hyperparams`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dspark import comm
from dspark.engine.finite_check import new_flag, scale_and_check
from dspark.engine.grad_bucket import BufferPool, GradBucket, make_buckets, memory_order_flat
from dspark.engine.param_slot import ParamSlot
from dspark.engine.window import StepTag, StepWeights, average_factor, check_in_step

__all__ = ["GradReducer", "LocalReducer", "UnequalBatchesError"]


class UnequalBatchesError(ValueError):
    """Ranks averaged with equal weights saw different numbers of samples."""


class GradReducer:
    """Reduce the gradients of ``slots`` across ranks (see the module notes)."""

    def __init__(self, slots: Sequence[ParamSlot], *, sharded: bool, collective: str, bucket_mb: float,
                 wire_dtype: torch.dtype | None, rank: int, num_ranks: int, device: torch.device,
                 check_finite: bool = True, shard: comm.Group | None = None,
                 replica: comm.Group | None = None) -> None:
        self.slots = list(slots)
        self.check_finite = check_finite
        self.found_inf: torch.Tensor | None = None
        """After a reduction with ``check_finite``: 1 where this rank's reduced gradients (its shards,
        zero2/zero3) hold a value that is not finite (see [Note: non-finite gradients found in the
        reduction])."""
        self.sharded = sharded
        self.collective = collective
        self.bucket_mb = bucket_mb
        self.wire_dtype = wire_dtype
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.shard = shard
        """The group that splits each gradient's rows (None: the world); see [Note: two-level
        reduction] in :mod:`dspark.engine.grad_bucket` for ``replica``."""
        self.replica = replica
        self.observing = True
        self.sync = False
        self.nonfinite_loss = False
        """Whether some rank's loss in the last reduced window was not finite."""
        self.hyperparameter_fingerprints: list[int] = []
        """Each rank's optimizer fingerprint in the last reduced window (index = rank)."""
        self._first_arrivals: list[ParamSlot] = []
        self._late: list[ParamSlot] = []  # observing: gradients that arrived after their bucket left
        self._late_bucket: GradBucket | None = None
        self._send_pool = BufferPool()
        self._out_pool = BufferPool()
        self._next = 0
        self._synced_once = False  # observing: this window communicated
        self._set_buckets(list(reversed(self.slots)))

    def _set_buckets(self, order: list[ParamSlot]) -> None:
        self.buckets: list[GradBucket] = []  # dropped first: the old buffers go before new ones come
        self._bucket_of: dict[int, GradBucket] = {}
        self._flag_order: list[ParamSlot] = []
        self._late_bucket = None
        self.buckets = make_buckets(order, bucket_mb=self.bucket_mb, sharded=self.sharded,
                                    collective=self.collective, wire_dtype=self.wire_dtype,
                                    **self._bucket_ranks())
        self._bucket_of = {id(s): b for b in self.buckets for s in b.slots}
        self._flag_order = [s for b in self.buckets for s in b.slots]

    def _bucket_ranks(self) -> dict[str, Any]:
        """A bucket's ranks: its shard group's (the world's for a flat strategy)."""
        shard = self.shard
        return {"rank": self.rank if shard is None else shard.rank,
                "num_ranks": self.num_ranks if shard is None else shard.size,
                "device": self.device, "group": shard, "replica": self.replica}

    @property
    def low_precision_wire(self) -> bool:
        return self.wire_dtype in (torch.bfloat16, torch.float16)

    # -- one backward ------------------------------------------------------------------------------
    def begin_backward(self, *, sync: bool) -> None:
        self.sync = sync
        for slot in self.slots:
            slot.arrivals = 0

    def on_grad(self, slot: ParamSlot) -> None:
        """Autograd accumulated a gradient into ``slot``'s parameter."""
        slot.arrivals += 1
        if not slot.used:
            slot.used = True
            if self.observing:
                self._first_arrivals.append(slot)
        bucket = self._bucket_of[id(slot)]
        if bucket.launched:
            if self.observing and bucket.sharded:
                if slot not in self._late:
                    self._late.append(slot)  # param.grad holds the late part; sent at the end
                return
            raise RuntimeError(
                f"rank {self.rank}: a gradient of {slot.name} arrived after its bucket was sent "
                f"(arrival {slot.arrivals} in this backward; {slot.expected_arrivals} expected, as "
                "observed on the first step): the number of times autograd accumulates this parameter's "
                "gradient changed between steps. This happens with reentrant activation checkpointing "
                "(torch.utils.checkpoint(..., use_reentrant=True)) when a checkpointed block is also used "
                "outside the checkpoint only on some steps. Use use_reentrant=False, or keep the graph the "
                "same on every step")
        if not bucket.sharded:
            bucket.absorb(slot)
            if self.observing:
                return  # see [Note: the first step observes]
        if self.sync and slot.arrivals == slot.expected_arrivals:
            if bucket.sharded and not self.observing:
                bucket.pack(slot, self._send_pool)  # see [Note: packed as they arrive]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self.buckets[self._next].launch(self._send_pool, self._out_pool, self._pre_scale())
            if self._next > 0:  # hybrid: see [Note: two-level reduction]
                self.buckets[self._next - 1].reduce_across()
            self._next += 1

    def _pre_scale(self) -> float:
        return 1.0 / self.num_ranks if self.low_precision_wire else 1.0

    def end_backward(self, weights: StepWeights, tag: StepTag, nonfinite_loss: torch.Tensor | None = None,
                     hyperparameters: int = 0) -> bool:
        """Reduce what is left and average: afterwards each parameter (replicate, zero1) or its shard
        (zero2, zero3) holds the averaged gradient. Returns False when every rank gave ``weight=0``:
        there is nothing to average and the step should be skipped. ``tag`` says where this rank is:
        ranks whose tags differ raise (see [Note: ranks in step]). ``nonfinite_loss`` (a bool tensor:
        a loss of the window was not finite) is or-ed over ranks into :attr:`nonfinite_loss`;
        ``hyperparameters`` (this rank's optimizer fingerprint) lands in
        :attr:`hyperparameter_fingerprints` beside every other rank's."""
        for bucket in self.buckets[self._next:]:
            bucket.launch(self._send_pool, self._out_pool, self._pre_scale())
        self._next = len(self.buckets)
        self._synced_once = True
        if self.observing and self.sharded:
            self._launch_late()
        for bucket in (*self.buckets, *([self._late_bucket] if self._late_bucket else [])):
            bucket.reduce_across()  # hybrid: see [Note: two-level reduction]
        n = self.num_ranks
        # [weight sum, weighted ranks, batch size + 1 per rank, position per rank, hyper-parameter
        # fingerprint per rank, used flags]
        extras = torch.zeros(2 + 3 * n + len(self.slots), dtype=torch.float64, device=self.device)
        if weights.weight_sum is not None:
            extras[0] = weights.weight_sum
            extras[1] = 1.0
        if weights.batch_size is not None:
            extras[2 + self.rank] = weights.batch_size + 1
        # the window's position and, in bit 0, a non-finite loss: summed on the device, no host sync
        extras[2 + n + self.rank] = float(tag.encode())
        if nonfinite_loss is not None:
            extras[2 + n + self.rank] += nonfinite_loss.to(torch.float64).reshape(())
        extras[2 + 2 * n + self.rank] = float(hyperparameters)
        extras[2 + 3 * n:] = torch.tensor([float(s.used) for s in self._flag_order], dtype=torch.float64)
        comm.all_reduce(extras, label="dspark.step_extras.all_reduce")
        for bucket in self.buckets:  # every rank launched every bucket: waiting cannot hang
            bucket.collect()
        if self._late_bucket is not None:
            self._late_bucket.collect()
        values = extras.tolist()  # the step's one host synchronisation
        total_weight, weighted_ranks = values[0], int(values[1])
        sizes = [int(v) - 1 for v in values[2: 2 + n]]
        positions = [int(v) for v in values[2 + n: 2 + 2 * n]]
        tags = [StepTag.decode(p) for p in positions]
        micro_steps = [t.micro_step for t in tags]
        self.nonfinite_loss = any(p & 1 for p in positions)
        self.hyperparameter_fingerprints = [int(v) for v in values[2 + 2 * n: 2 + 3 * n]]
        used_anywhere = [v > 0 for v in values[2 + 3 * n:]]
        if len(set(micro_steps)) > 1:
            raise ValueError(
                f"rank {self.rank}: the ranks called engine.backward() a different number of times in "
                f"this step ({_per_rank(micro_steps)}); every rank must run the same micro-batches "
                f"(grad_accum_steps={weights.accum_steps}) before engine.step(), or the average mixes "
                "windows. Give every rank the same number of batches, e.g. with dspark.DataLoader")
        check_in_step(tags, rank=self.rank, what="the gradient reduction")
        if 0 < weighted_ranks < n:
            raise ValueError(f"rank {self.rank}: engine.backward(loss, weight=...) was given on "
                             f"{weighted_ranks} of {n} ranks; give it on every rank or on none")
        if weighted_ranks == 0 and min(sizes) >= 0 and len(set(sizes)) > 1:
            raise UnequalBatchesError(
                f"rank {self.rank}: the ranks' local batches differ in size ({_per_rank(sizes)} "
                "samples along dim 0 of the first input) while every rank's loss counts with the same "
                "weight, so the update is not the mean over all samples. Pass "
                "engine.backward(loss, weight=n), n being the samples (or tokens) this rank's loss "
                "averages over (with a dspark.DataLoader: weight=loader.batch_info.local_size), or give "
                "every rank the same number of samples: a global batch that divides by the world size, "
                "and drop_last=True (the default; drop_last=False serves the epoch's last, partial "
                "global batch, whose split may be uneven although the global batch size divides). To "
                "weight ranks equally anyway, pass weight=1.0 on every rank")
        post = average_factor(weights, total_weight=total_weight if weighted_ranks == n else None,
                              num_ranks=n, pre_divided=self.low_precision_wire)
        if post is None:
            return False
        found_inf = self.found_inf = new_flag(self.device) if self.check_finite else None
        offset = 0
        for bucket in self.buckets:
            bucket.finish(post, used_anywhere[offset: offset + len(bucket.slots)], found_inf)
            offset += len(bucket.slots)
        if self._late_bucket is not None:
            self._late_bucket.add_to_shards(post, found_inf)
            self._late_bucket = None
        self._send_pool.release()
        self._out_pool.release()
        return True

    def _launch_late(self) -> None:
        """Observing, sharded: reduce the contributions that arrived after their bucket left, in one
        extra bucket (every rank sends the union of late slots; zeros where it has none)."""
        index_of = {id(s): i for i, s in enumerate(self.slots)}
        late_ids = sorted(set().union(*comm.all_gather_object([index_of[id(s)] for s in self._late],
                                                                  label="dspark.late_grads.all_gather")))
        self._late = []
        if not late_ids:
            return
        late = [self.slots[i] for i in late_ids]
        by_dtype: dict[torch.dtype, list[ParamSlot]] = {}
        for slot in late:
            by_dtype.setdefault(slot.dtype, []).append(slot)
        if len(by_dtype) > 1:
            raise RuntimeError(f"rank {self.rank}: gradients of several dtypes arrived after their "
                               "buckets were sent on the first step; use use_reentrant=False activation "
                               "checkpointing")
        self._late_bucket = GradBucket(len(self.buckets), late, sharded=True, collective=self.collective,
                                       wire_dtype=self.wire_dtype, **self._bucket_ranks())
        self._late_bucket.launch(self._send_pool, self._out_pool, self._pre_scale())

    def after_step(self) -> None:
        """Call on every rank once the window's update is done. After the first communicating window,
        agree on the observed order and counts and rebuild the buckets (see [Note: the first step
        observes])."""
        if not self.observing or not self._synced_once:
            return
        index_of = {id(s): i for i, s in enumerate(self.slots)}
        order_ids = comm.broadcast_object([index_of[id(s)] for s in self._first_arrivals],
                                          label="dspark.bucket_order.broadcast")
        counts = comm.all_gather_object([s.arrivals for s in self.slots], label="dspark.grad_counts.all_gather")
        for i, slot in enumerate(self.slots):
            slot.expected_arrivals = max(1, *(c[i] for c in counts))
        seen = set(order_ids)
        order = [self.slots[i] for i in order_ids]
        order += [s for i, s in reversed(list(enumerate(self.slots))) if i not in seen]
        for slot in self.slots:  # the update is done: nothing may keep the old buffers alive
            slot.grad_view = None
            slot.shard_grad = None
            slot.param.grad = None
            if slot.opt_param is not None:
                slot.opt_param.grad = None
        self._set_buckets(order)
        self.observing = False
        self._first_arrivals = []

    def end_window(self) -> None:
        """After the optimizer step (or a failure): forget this window's gradients and any bucket state."""
        for bucket in (*self.buckets, *([self._late_bucket] if self._late_bucket else [])):
            bucket.abandon()  # a no-op wait after a completed window; after a failed one, it matters
            bucket.free_window()
        self._send_pool.release()
        self._out_pool.release()
        self._next = 0
        self._late = []
        self._late_bucket = None
        for slot in self.slots:
            slot.used = False
        if self.observing:  # a failed window observes nothing: the next one starts afresh
            self._first_arrivals = []
            self._synced_once = False

    def gather_updated_rows(self) -> None:
        """zero1/zero2, after the optimizer updated this rank's rows: all-gather them into every
        rank's full parameters, one collective per bucket. The buffers come from the reducer's pools
        (so ``comm_buffer_bytes`` counts them): a buffer goes to the next bucket only after its bucket
        landed, so at most ``depth`` buckets are in flight and the gather costs about two buckets of
        memory, not a second copy of the model; the pools go when it ends (see [Note: gradients live
        in buckets])."""
        for bucket in self.buckets:
            bucket.launch_gather(self._send_pool, self._out_pool)
        for bucket in self.buckets:
            bucket.collect()
        self._send_pool.release()
        self._out_pool.release()

    def comm_buffer_bytes(self) -> int:
        return self._send_pool.nbytes() + self._out_pool.nbytes()


class LocalReducer:
    """One rank: :class:`GradReducer`'s interface with nothing to reduce, so no bucket copies; the
    shard is the whole gradient, and the average is the same rule with a world size of 1 (see
    [Note: the averaging rule])."""

    def __init__(self, slots: Sequence[ParamSlot], *, sharded: bool, check_finite: bool = True) -> None:
        self.slots = list(slots)
        self.sharded = sharded
        self.check_finite = check_finite
        self.found_inf: torch.Tensor | None = None
        self.buckets: list[GradBucket] = []
        self.nonfinite_loss = False
        self.hyperparameter_fingerprints: list[int] = []

    def begin_backward(self, *, sync: bool) -> None:
        for slot in self.slots:
            slot.arrivals = 0

    def on_grad(self, slot: ParamSlot) -> None:
        slot.arrivals += 1

    def end_backward(self, weights: StepWeights, tag: StepTag, nonfinite_loss: torch.Tensor | None = None,
                     hyperparameters: int = 0) -> bool:
        self.hyperparameter_fingerprints = [hyperparameters]
        self.nonfinite_loss = bool(nonfinite_loss) if nonfinite_loss is not None else False
        post = average_factor(weights, total_weight=weights.weight_sum, num_ranks=1, pre_divided=False)
        if post is None:
            return False
        # one multi-tensor kernel per dtype instead of one launch per parameter: on a GPU, fp16's
        # unscale of ResNet-50's 161 gradients was 160 extra launches a step; the same pass finds a
        # non-finite gradient (see [Note: non-finite gradients found in the reduction])
        grads = [slot.param.grad for slot in self.slots if slot.param.grad is not None]
        self.found_inf = new_flag(grads[0].device) if self.check_finite and grads else None
        scale_and_check(grads, post, self.found_inf)
        if self.sharded:
            for slot in self.slots:
                grad = slot.param.grad
                slot.shard_grad = None if grad is None else memory_order_flat(slot, grad)
                slot.param.grad = None
        return True

    def gather_updated_rows(self) -> None:
        """Nothing to gather: this rank updated every row."""

    def after_step(self) -> None:
        """Nothing observed: there are no buckets to order."""

    def end_window(self) -> None:
        """Nothing in flight."""

    def comm_buffer_bytes(self) -> int:
        return 0


def _per_rank(sizes: Sequence[int]) -> str:
    return ", ".join(f"rank {r}: {s}" for r, s in enumerate(sizes))
