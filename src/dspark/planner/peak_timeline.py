"""A rank's tensor peak, found by walking one step's backward as the engine runs it.

[Note: the step's timeline] A step's peak is not the sum of its parts: activations are at their
highest when backward starts, gradients when it ends, communication buffers come and go per
bucket. The probe measures one device's step in intervals, one per gradient accumulation (see
``Probe.interval_bytes``): in each, the bytes beyond the parameters, the optimizer state and the
gradients one process holds by then (activations, scratch, the gradient being made). A rank of
any strategy holds the same in that interval (its share of the batch), plus what its strategy
holds at that point, which this module replays accumulation by accumulation, with the engine's
own rules:

* replicate and zero1 keep whole gradients in their buckets: a bucket's flat buffer is allocated
  when its first gradient arrives (while that gradient is still alive: the moment counts both),
  except a bucket of one parameter, which adopts the gradient autograd made ([Note: a bucket of one
  adopts its gradient] in :mod:`dspark.engine.grad_bucket`);
* zero2 and zero3 pack each complete gradient into its bucket's send buffer and free it ([Note:
  packed as they arrive]); send buffers come from a pool of two per dtype, which grows to the
  largest bucket that used it and stays until the reduction ends; a bucket of one parameter whose
  rows split evenly sends its gradient as it is, but takes its turn in the pool all the same (the
  turn's holder is collected and its gradient freed: two buckets in flight); a bucket's shard buffer
  is allocated when it launches (buckets launch in order) and kept through the optimizer step; a
  parameter accumulated twice (a tied head) holds its whole gradient between the two;
* zero3 holds its root unit gathered until the root's gradients are complete, the unit computing
  and the units gathered ahead of it ([Note: prefetch depth] in :mod:`dspark.engine.zero3_units`);
  through forward, the root and the largest unit with those ahead of it;
* after the step zero1 and zero2 gather the updated rows through two buckets in flight, but through
  shared memory a bucket whose parameters all split into equal rows, which lands in place and
  holds nothing (see [Note: rows gathered in place] in :mod:`dspark.engine.row_gather`);
* collectives that go through a process group rather than shared memory (``transport`` "gloo" or
  "nccl": a GPU, a world over several nodes, a hybrid shard group) hold more: a zero3 gather packs
  every rank's shards in one buffer of the unit's size (and its own shards in one more) until it is
  waited on, so each unit gathered ahead is held twice (the root's too, from where the gradient
  reaches the model's output, beside what the loss's backward leaves), on gloo three times (its
  all-gather allocates an output of its own while it runs); on gloo a reduce-scatter runs as an
  all-to-all into a scratch of its bucket's size, held until the bucket's pool turn is taken or the
  reduction ends ([Note: reduce-scatter on gloo] in :mod:`dspark.comm.collectives`).

Each moment is the sum of what is held then; the peak is the highest. On one rank every strategy
is one process's step: the probe's own peak. A probe that did not measure intervals (from a lab
result, a fake trace, or an older plan's JSON) gives its whole step beyond model state to every
interval with every gradient held, so the largest moment is the one-device peak with the
strategy's model state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.planner.probe_record import Line, Probe
from dspark.policy.strategies import all_strategies
from dspark.policy.units import SECOND_PREFETCH_MAX_BYTES
from dspark.tensor.shard_math import chunk_size

__all__ = ["TRANSPORTS", "PeakParts", "bucket_groups", "step_peak"]

TRANSPORTS = ("shm", "gloo", "nccl")
"""How a row's collectives travel (the names of ``dspark.comm.transport()``): shared memory lands
them in place; a process group packs zero3's gathers, and gloo reduce-scatters through a scratch."""

ParamSpec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True, kw_only=True, slots=True)
class PeakParts:
    """A rank's predicted tensor peak and what it holds then beyond model state."""

    peak_bytes: int
    activation_bytes: int
    """The per-sample part of the probe's interval at the peak."""
    runtime_bytes: int
    """The fixed part of that interval (scratch that does not shrink with the batch)."""
    comm_buffer_bytes: int
    """Communication buffers and zero3's gathered parameters held at the peak."""


def _whole(spec: ParamSpec) -> int:
    return math.prod(spec[0]) * spec[1].itemsize


def _rows(spec: ParamSpec) -> tuple[int, int]:
    shape = spec[0]
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def _padded(spec: ParamSpec, n: int) -> int:
    rows, row_numel = _rows(spec)
    return chunk_size(rows, n) * n * row_numel * spec[1].itemsize


def bucket_groups(trainable: Sequence[ParamSpec], order: Sequence[int], bucket_mb: float) -> list[list[int]]:
    """Parameter indices per gradient bucket, as :func:`dspark.engine.grad_bucket.make_buckets`
    groups ``order`` (by dtype, about ``bucket_mb`` MiB each), in launch order."""
    limit = bucket_mb * 2**20
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    done: list[tuple[int, list[int]]] = []
    first: dict[int, int] = {}
    for position, i in enumerate(order):
        dtype = trainable[i][1]
        group, size = open_.get(dtype, ([], 0))
        if group and size + _whole(trainable[i]) > limit:
            done.append((first[id(group)], group))
            group, size = [], 0
        if not group:
            first[id(group)] = position
        group.append(i)
        open_[dtype] = (group, size + _whole(trainable[i]))
    done.extend((first[id(g)], g) for g, _ in open_.values() if g)
    return [g for _, g in sorted(done, key=lambda item: item[0])]


def _events_and_lines(probe: Probe, count: int) -> tuple[list[int], list[Line], list[Line]]:
    """The accumulations, the bytes of each interval and at each mark (see ``Probe.interval_bytes``
    and ``Probe.accumulation_bytes``)."""
    events = list(probe.grad_events)
    if (events and len(probe.interval_bytes) == len(events) + 4
            and len(probe.accumulation_bytes) == len(events) + 3):
        return events, list(probe.interval_bytes), list(probe.accumulation_bytes)
    events = list(reversed(range(count)))
    # not measured: the whole step beyond model state everywhere, every gradient held
    whole = Line(fixed=probe.step_bytes.fixed, per_sample=probe.step_bytes.per_sample)
    return events, [whole] * (len(events) + 4), [whole] * (len(events) + 3)


class _Replay:
    """The engine's holdings, accumulation by accumulation (see [Note: the step's timeline])."""

    def __init__(self, shape_trainable: Sequence[ParamSpec], units: Sequence[Sequence[int]],
                 unit_bytes: Sequence[int], strategy: str, n: int, events: Sequence[int],
                 bucket_mb: float, one_process: bool, transport: str = "shm",
                 backward_unit_bytes: Sequence[int] | None = None) -> None:
        self.specs, self.n, self.events, self.one_process = shape_trainable, n, events, one_process
        self.packs_gathers = transport != "shm"  # a gather in flight: its packed copy beside it
        self.scratch_scatters = transport == "gloo"  # a reduce-scatter in flight: its all-to-all's output
        self.gather_copy = transport == "gloo"  # gloo's all-gather lands in an output of its own first
        self.policy = all_strategies()[strategy]
        self.shard_grads = self.policy.shard_grads
        self.shard_params = self.policy.splits_params_on(n)
        self.shard_optimizer = self.policy.splits_optimizer_on(n)
        first = list(dict.fromkeys(events))
        order = first + [i for i in reversed(range(len(self.specs))) if i not in set(first)]
        self.groups = bucket_groups(self.specs, order, bucket_mb)
        self.bucket_of = {i: b for b, g in enumerate(self.groups) for i in g}
        self.count = {i: events.count(i) for i in set(events)}
        self.unit_of = {i: u for u, members in enumerate(units) for i in members}
        self.unit_bytes = list(unit_bytes)
        # what backward regathers: no frozen parameter it never reads (see [Note: frozen parameters
        # in backward] in dspark.engine.zero3_units)
        self.backward_bytes = self.unit_bytes if backward_unit_bytes is None else list(backward_unit_bytes)
        self.last_block_event = max((k for k, i in enumerate(events) if self.unit_of.get(i, 0)), default=-1)
        self.moments: list[tuple[float, int, int]] = []
        """``(bytes beyond what is resident, interval, buffers held)`` per moment; interval -1: no
        activations (after the step)."""

    def seg_bytes(self, b: int) -> int:
        return sum(_padded(self.specs[i], self.n) for i in self.groups[b]) // self.n

    def whole_bytes(self, b: int) -> int:
        return sum(_whole(self.specs[i]) for i in self.groups[b])

    def adopts(self, b: int) -> bool:
        group = self.groups[b]
        if len(group) != 1:
            return False
        return not self.shard_grads or _rows(self.specs[group[0]])[0] % self.n == 0

    def ahead_bytes(self, units: Sequence[int], backward: bool = False) -> int:
        """What the units gathered ahead (launched, not yet waited on) hold: their storage, and on a
        process group the packed buffer and the shards sent (``unit * (1 + 1/N)``) as well, and on
        gloo the output its all-gather allocates for itself (one more unit); ``backward``: as
        backward regathers them."""
        held = sum((self.backward_bytes if backward else self.unit_bytes)[u] for u in units)
        return held + (held + held // self.n if self.packs_gathers else 0) + (held if self.gather_copy else 0)

    def gathered_forward(self) -> int:
        if not self.shard_params or not self.unit_bytes:
            return 0
        root, blocks = self.unit_bytes[0], self.unit_bytes[1:]
        best = 0
        for k, size in enumerate(blocks):
            ahead = range(k + 2, k + 4) if (len(blocks) > k + 2 and blocks[k + 2] <= SECOND_PREFETCH_MAX_BYTES) \
                else range(k + 2, min(k + 3, len(blocks) + 1))
            best = max(best, size + self.ahead_bytes(ahead))
        return root + best

    def gathered_backward(self, k: int, root_live: int) -> int:
        """zero3's gathered bytes at accumulation ``k``: the root, the unit computing, those ahead."""
        if not self.shard_params or not self.unit_bytes:
            return 0
        unit = self.unit_of.get(self.events[k], 0) if k < len(self.events) else 0
        blocks = list(range(len(self.unit_bytes) - 1, 0, -1))  # backward runs the blocks reversed
        if unit == 0 and k > self.last_block_event:
            return root_live  # the root's last gradients (an embedding): every block is done
        at = blocks.index(unit) + 1 if unit in blocks else 0
        ahead = blocks[at: at + 2] if (len(blocks) > at + 1 and self.unit_bytes[blocks[at + 1]]
                                       <= SECOND_PREFETCH_MAX_BYTES) else blocks[at: at + 1]
        return root_live + (self.backward_bytes[unit] if unit else 0) + self.ahead_bytes(ahead, backward=True)

    def rows_in_place(self, b: int) -> bool:
        """zero1/zero2's row gather lands bucket ``b``'s rows straight in its parameters: through
        shared memory, every parameter in equal rows (see [Note: rows gathered in place] in
        :mod:`dspark.engine.row_gather`)."""
        return not self.packs_gathers and all(_rows(self.specs[i])[0] % self.n == 0 for i in self.groups[b])

    def row_gather_bytes(self) -> int:
        pool: dict[tuple[torch.dtype, int], int] = {}
        turn: dict[torch.dtype, int] = {}
        for b, group in enumerate(self.groups):
            if self.rows_in_place(b):  # no buffer, no turn in the pool
                continue
            dtype = self.specs[group[0]][1]
            t = turn.get(dtype, 0)
            turn[dtype] = (t + 1) % 2
            seg = self.seg_bytes(b)
            pool[(dtype, t)] = max(pool.get((dtype, t), 0), seg + self.n * seg)
        return sum(pool.values())


    def moment(self, value: float, k: int, buffers: int) -> None:
        self.moments.append((value, k, buffers))

    def run(self, at: Sequence[float], instants: Sequence[float], grads_after: int,
            loss_backward: float | None = None) -> None:
        """Every moment of the step on this rank (see [Note: the step's timeline]). ``at``: the
        interval bytes (the model's forward, the loss, backward to the first accumulation, one per
        accumulation, the optimizer step); ``instants``: at the end of the model's forward and of the
        loss, at each accumulation, at the end of backward; ``loss_backward``: the loss's own
        backward where it was measured apart (every strategy holds nothing of its own then: zero3
        gathers the root when the gradient reaches the model's output)."""
        last = len(at) - 1
        if loss_backward is not None:
            self.moment(loss_backward, LOSS_BACKWARD, 0)
            if self.packs_gathers and self.shard_params and self.unit_bytes and not self.one_process:
                # the root's gather for backward starts where the gradient reaches the model's output,
                # beside what the loss's backward leaves: its storage, packed buffer and shards sent
                regather = self.ahead_bytes([0], backward=True)
                self.moment(loss_backward + regather, LOSS_BACKWARD, regather)
        if self.one_process:  # one process's step, every strategy: nothing to reduce
            held, seen = 0, set()
            for k, value in enumerate(at):
                self.moment(held + value, k, 0)
                event = self.events[k - 2] if 2 <= k < len(self.events) + 2 else -1
                if event >= 0 and event not in seen:
                    seen.add(event)
                    held += _whole(self.specs[event])
            return
        self.moment(at[0] + self.gathered_forward(), 0, self.gathered_forward())
        self.moment(at[1], 1, 0)  # the loss, after the model's forward (its units are freed)
        self._backward(at, instants)
        # the optimizer step, the reduction ended (the pool is gone); a rank of a strategy that
        # shards optimizer state steps 1/N of every parameter's rows, with 1/N of the scratch
        share = 1 / self.n if self.shard_optimizer else 1.0
        self.moment(grads_after + at[last] * share, last, 0)
        if self.shard_optimizer and not self.policy.shard_params:
            self.moment(grads_after + self.row_gather_bytes(), -1, self.row_gather_bytes())

    def _backward(self, at: Sequence[float], instants: Sequence[float]) -> None:
        """Backward, accumulation by accumulation: interval ``k + 2`` runs up to accumulation ``k``
        (instant ``k + 2``), interval ``k + 3`` after it."""
        sharded = self.shard_grads
        grads = 0  # whole gradients in buckets (replicate, zero1), held between uses, shards
        pool: dict[tuple[torch.dtype, int], int] = {}
        turn: dict[torch.dtype, int] = {}
        adopted = 0  # send buffers that are a gradient autograd made (zero2, zero3), in flight
        owner: dict[tuple[torch.dtype, int], int] = {}  # each turn's holder: its adopted bytes
        turn_of: dict[int, tuple[torch.dtype, int]] = {}
        scratch: dict[tuple[torch.dtype, int], int] = {}  # each turn's holder: its all-to-all's output
        started: set[int] = set()
        arrivals: dict[int, int] = {}
        pending = [len(g) for g in self.groups]
        launched = 0
        root = {i for i, u in self.unit_of.items() if u == 0}
        root_live = self.backward_bytes[0] if self.unit_bytes else 0  # frozen ones stay to the end
        gathered = self.gathered_backward(0, root_live)
        self.moment(at[2] + gathered, 2, gathered)
        for k, param in enumerate(self.events):
            gathered = self.gathered_backward(k, root_live)
            arrivals[param] = arrivals.get(param, 0) + 1
            complete = arrivals[param] == self.count[param]
            b = self.bucket_of[param]
            # what this accumulation allocates counts beside the new gradient (in the instant's
            # bytes) unless it is that gradient (adopted, or kept as .grad): the same storage
            same = 0
            launch = 0
            sent: list[int] = []
            if not sharded:
                if b not in started:
                    started.add(b)
                    same = self.whole_bytes(b) if self.adopts(b) else 0
                    grads += self.whole_bytes(b)
            elif not complete:
                if arrivals[param] == 1:
                    same = _whole(self.specs[param])
                    grads += same  # held until its last use
            else:
                if self.count[param] > 1:
                    grads -= _whole(self.specs[param])
                if b not in started:
                    started.add(b)
                    need = self.n * self.seg_bytes(b)
                    dtype = self.specs[param][1]
                    t = turn.get(dtype, 0)
                    turn[dtype] = (t + 1) % 2
                    # taking the turn collects its holder: a gradient it sent as it is is freed
                    adopted -= owner.pop((dtype, t), 0)
                    scratch.pop((dtype, t), None)
                    turn_of[b] = (dtype, t)
                    if self.adopts(b):
                        adopted += need
                        owner[(dtype, t)] = need
                        same = need
                    else:
                        pool[(dtype, t)] = max(pool.get((dtype, t), 0), need)
                pending[b] -= 1
                while launched < len(pending) and pending[launched] == 0:
                    launch += self.seg_bytes(launched)  # its shard buffer, kept through the step
                    if self.scratch_scatters and launched in turn_of:
                        sent.append(launched)
                    launched += 1
            buffers = sum(pool.values()) + adopted + sum(scratch.values())
            self.moment(grads + buffers + gathered - same + instants[k + 2], k + 2, buffers + gathered)
            for done in sent:  # launched: each reduce-scatter's scratch, until its turn is taken
                scratch[turn_of[done]] = self.n * self.seg_bytes(done)
            buffers = sum(pool.values()) + adopted + sum(scratch.values())
            if launch:  # after packing: the new gradient is freed (or is the send buffer)
                grads += launch
                fresh = _whole(self.specs[param])
                self.moment(grads + buffers + gathered - max(same, fresh) + instants[k + 2], k + 2,
                            buffers + gathered)
            if complete and param in root:
                root_live -= _padded(self.specs[param], self.n)
            following = self.gathered_backward(k + 1, root_live) if k + 1 < len(self.events) else 0
            self.moment(grads + buffers + following + at[k + 3], k + 3, buffers + following)


LOSS_BACKWARD = -2
"""The interval index of the moment in the loss's own backward (``Probe.loss_backward_bytes``)."""


def step_peak(*, trainable: Sequence[ParamSpec], units: Sequence[Sequence[int]], unit_bytes: Sequence[int],
              probe: Probe, strategy: str, num_ranks: int, micro_batch: int, bucket_mb: float,
              resident_bytes: int, grads_bytes: int, split: int | None = None,
              transport: str = "shm", backward_unit_bytes: Sequence[int] | None = None) -> PeakParts:
    """The highest moment of one step on a rank (see [Note: the step's timeline]).
    ``resident_bytes``: what the rank holds throughout (its parameters and optimizer state);
    ``grads_bytes``: its gradients after backward (the strategy's model state); ``split``: the
    ranks that split the rows (a hybrid strategy's shard group; default ``num_ranks``);
    ``transport``: how the collectives travel (one of :data:`TRANSPORTS`); ``backward_unit_bytes``:
    each unit as backward regathers it, where that is less than ``unit_bytes`` (frozen parameters
    backward does not read).

    Example::

        step_peak(trainable=shape.trainable, units=shape.units, unit_bytes=shape.unit_bytes(2),
                  probe=probe, strategy="zero2",
                  num_ranks=2, micro_batch=8, bucket_mb=25.0, resident_bytes=40_000_000,
                  grads_bytes=10_000_000)
    """
    events, lines, instants = _events_and_lines(probe, len(trainable))
    replay = _Replay(trainable, units, unit_bytes, strategy, num_ranks if split is None else split, events,
                     bucket_mb, one_process=num_ranks == 1, transport=transport,
                     backward_unit_bytes=backward_unit_bytes)
    loss_line = probe.loss_backward_bytes if probe.interval_bytes else None
    replay.run([line.at(micro_batch) for line in lines], [line.at(micro_batch) for line in instants],
               grads_bytes, loss_line.at(micro_batch) if loss_line is not None else None)
    top, k, buffers = max(replay.moments)
    line = loss_line if k == LOSS_BACKWARD and loss_line is not None else lines[k] if k >= 0 else None
    beyond = max(0.0, line.at(micro_batch)) if line is not None else 0.0
    fixed = max(0.0, line.fixed) if line is not None else 0.0
    return PeakParts(peak_bytes=max(0, round(resident_bytes + top)),
                     activation_bytes=max(0, round(beyond - fixed)),
                     runtime_bytes=round(min(fixed, beyond)), comm_buffer_bytes=max(0, buffers))
