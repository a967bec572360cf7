"""One plan row's numbers: a rank's peak memory and step time for a strategy on N devices.

[Note: predicted memory] A rank's peak is the sum of

* model state (parameters, gradients, optimizer state): exact, from the engine's own formula
  (:func:`dspark.policy.state_bytes.expected_state_bytes`, the same arithmetic ``memory_report()``
  checks the engine against);
* activations: the probe's line at the micro-batch (see [Note: the probe]);
* runtime: the probe's fixed part (scratch that does not shrink with the batch);
* communication buffers alive at the backward peak: zero2/zero3 copy whole gradients into a pool
  of two bucket-sized send buffers (:mod:`dspark.engine.grad_bucket`) and keep only their shards.
  The probe's peak was measured with every whole gradient held (one device keeps them), so the
  send buffers count only where they exceed the whole gradients a sharded rank no longer keeps;
  zero3 also holds the root
  unit whole, the unit running and the units gathered ahead of it (one, or two when the next is
  small: :data:`dspark.policy.units.SECOND_PREFETCH_MAX_BYTES`). After the optimizer step
  zero1/zero2 gather the updated rows through two buckets in flight (a send shard and a receive
  buffer each); activations are gone by then, so that gather sets the peak only when it is larger
  than the activations and runtime scratch it replaces. Replicate and zero1 reduce in place (gradients live in their
  buckets): no buffer. Where the collectives go through a process group rather than shared memory
  (:func:`row_transport`), zero3's gathers in flight and gloo's reduce-scatters hold a copy more
  (see [Note: the step's timeline] in :mod:`dspark.planner.peak_timeline`).

[Note: predicted step] ``compute`` is the probe's forward + backward at the micro-batch, times the
passes per step; ``optimizer`` is the probe's step where optimizer state is whole, and where it is
sharded its fixed part (per tensor, measured from a step over a quarter of each parameter) plus
``1/N`` of the rest, and before it the engine's one pass over the rank's reduced gradients (whole,
or its shards under zero2/zero3; on one rank too) that scales them and flags a value that is not
finite, at the probe's measured rate of that kernel (:func:`gradient_check_ms`). ``exposed
communication`` is every collective of [Note: what each strategy sends] that compute does not hide,
plus the engine's own copies around them (packing a send buffer, copying a fresh gradient into its
bucket, landing gathered rows: work on the computing device, at the probe's measured copy
bandwidth, never hidden). On a link that overlaps compute, the gradient buckets are reduced one after another on one
channel, each starting when its last gradient is complete (the probe's ready times) or when the one
before it lands, and what runs past the end of backward is exposed; zero3 gathers each unit while
the unit before it computes, so a gather longer than that compute stalls by the difference and the
root's gathers (start of forward, start of backward) stall whole. On a link that does not overlap
compute (gloo on one CPU core per rank: the core that computes also moves and sums the bytes)
every collective is exposed, whole. With more than one rank on a CPU node, compute and optimizer,
and the engine's copies and zero3's first touches of its gathered storages, are those the node's
ranks pay running at once, over a link that measured it (see [Note: co-run slowdown] in
:mod:`dspark.planner.co_run`).

[Note: what each strategy sends] Per optimizer step on ``N > 1`` ranks, ``S`` a bucket's whole
gradient bytes, ``U`` a zero3 unit's padded parameter bytes:

* replicate: one all-reduce of ``S`` per bucket, in place, once each fresh gradient is copied into
  its bucket (``S`` of copies; none for a bucket of one parameter, whose gradient becomes the buffer);
* zero1: the same, then one all-gather of ``S`` per bucket for the updated rows (its own rows
  copied into the send buffer, the others' ``(N-1)/N`` copied out: ``S`` of copies; none through
  shared memory where every parameter of the bucket splits into equal rows, gathered straight into
  the parameters: [Note: rows gathered in place] in :mod:`dspark.engine.row_gather`);
* zero2: one reduce-scatter of ``S`` per bucket, after copying the whole gradients into the send
  buffer (``S``), then zero1's row gather;
* zero3: one reduce-scatter of ``S`` per bucket (with its copy), and two all-gathers of ``U`` (+ an
  8-byte tag) per unit per pass: before its forward and again before its backward;
* zero2 and zero3: one all-reduce of the non-finite flag (one element) before the step;
* every strategy: one all-reduce of a small vector per step (the loss weights, the window's
  position, which parameters had gradients).

* hybrid-zero1/2/3 (``S`` ranks per shard group, ``R = N / S`` groups; see [Note: hybrid sharding]):
  the stage's collectives over the shard group's ``S`` ranks on the link inside a node (zero3's
  gathers of ``U`` padded to ``S`` chunks, the bucket's reduce-scatter, the row gather), and for
  zero2/zero3 one all-reduce per bucket of each rank's shard (the bucket's bytes over ``S``) among
  ``R`` ranks on the link across nodes, each starting once its bucket's reduce-scatter landed, on a
  channel of its own; hybrid-zero1 all-reduces whole gradients over all ``N`` ranks. A rank holds
  the shard group's share of what the stage shards ([Note: predicted memory] with ``S`` for ``N``).

Each collective costs [Note: collective time] with its own measured terms where the link has them
(:mod:`dspark.planner.link_probe`): its latency term makes the count of collectives matter, not only
their bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark.comm.shm_setup import shm_wanted
from dspark.cpu_malloc import mmap_threshold_bytes
from dspark.planner.co_run import CoRun, CoRunParts, co_run_parts
from dspark.planner.interconnect import Interconnect, all_gather_s, all_reduce_s, reduce_scatter_s
from dspark.planner.peak_timeline import bucket_groups, step_peak
from dspark.planner.probe_record import Probe
from dspark.planner.process_memory import process_peak_bytes, ratchet_step_bytes
from dspark.policy.state_bytes import expected_state_bytes
from dspark.policy.strategies import ShardingPolicy, all_strategies
from dspark.policy.units import TAG_BYTES  # see [Note: gather tags]
from dspark.tensor.shard_math import chunk_size

__all__ = ["ModelShape", "RowCost", "gradient_check_ms", "row_cost", "row_transport"]

ParamSpec = tuple[tuple[int, ...], torch.dtype]

FLAG_BYTES = 4
"""The non-finite flag zero2/zero3 all-reduce before each step (one float32)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the cost model needs to know about a model, read once before anything runs."""

    trainable: tuple[ParamSpec, ...]
    """``(shape, dtype)`` per trainable parameter, tied ones once, in ``model.parameters()`` order."""
    frozen: tuple[ParamSpec, ...]
    """The same for frozen parameters (parameters only: no gradient, no optimizer state)."""
    units: tuple[tuple[int, ...], ...]
    """zero3 units (root first): indices into ``trainable`` of the parameters each gathers."""
    optimizer_state: tuple[int, bool]
    """:func:`dspark.policy.state_bytes.optimizer_state_elements` of the optimizer."""
    frozen_units: tuple[tuple[int, ...], ...] = ()
    """The same as ``units`` for the frozen parameters (indices into ``frozen``): zero3 gathers them
    with their unit."""

    def unit_bytes(self, num_ranks: int) -> list[int]:
        """Each zero3 unit's padded parameter bytes on ``num_ranks`` ranks (what one gather moves),
        frozen parameters included."""
        return [sum(unit) for unit in self.unit_param_bytes(num_ranks)]

    def unit_param_bytes(self, num_ranks: int, without_frozen: Sequence[int] = ()) -> list[list[int]]:
        """Each zero3 unit's gathered storages on ``num_ranks`` ranks: every parameter's padded bytes
        (a gather lands each parameter in a storage of its own), frozen ones included but those in
        ``without_frozen`` (indices into ``frozen``: the ones backward does not regather)."""
        frozen = list(self.frozen_units) + [()] * (len(self.units) - len(self.frozen_units))
        skip = set(without_frozen)
        return [[_padded_bytes(self.trainable[i], num_ranks) for i in unit]
                + [_padded_bytes(self.frozen[i], num_ranks) for i in still if i not in skip]
                for unit, still in zip(self.units, frozen, strict=True)]


@dataclass(frozen=True, kw_only=True, slots=True)
class RowCost:
    """A rank's predicted peak by part (bytes) and step by part (ms)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """Activations at the peak (the per-sample part of what the step holds then)."""
    comm_buffer_bytes: int
    """Communication buffers (and zero3's gathered parameters) held at the peak."""
    runtime_bytes: int
    """Scratch at the peak that does not shrink with the batch."""
    peak_bytes: int
    """The step's highest moment (see [Note: the step's timeline]): not the sum of the parts, since
    a rank may hold fewer gradients at its peak than after backward."""
    process_peak_bytes: int | None
    """What the rank's process takes at that peak, libraries and allocator included (see [Note:
    process memory]); None: the probe did not measure the process's baseline."""
    compute_ms: float
    comm_exposed_ms: float
    optimizer_ms: float
    step_ms_low: float | None = None
    """The lowest step the probe's rounds predict for this row (see [Note: steady steps] in
    :mod:`dspark.planner.probe_timing`); None: the probe kept no rounds."""
    step_ms_high: float | None = None
    """The highest."""
    co_run_compute_factor: float = 1.0
    """How much ``compute_ms`` grew for the node's other ranks running theirs at once (see [Note: co-run
    slowdown] in :mod:`dspark.planner.co_run`); 1.0: not slowed (one rank per node, or not measured)."""
    co_run_optimizer_factor: float = 1.0
    """The same for ``optimizer_ms`` (the optimizer step and the scale-and-check pass)."""


def _padded_bytes(spec: ParamSpec, num_ranks: int) -> int:
    shape, dtype = spec
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    return chunk_size(rows, num_ranks) * num_ranks * row_numel * dtype.itemsize


def _whole_bytes(spec: ParamSpec) -> int:
    return math.prod(spec[0]) * spec[1].itemsize


def mapped_state_bytes(shape: ModelShape, policy: ShardingPolicy, num_ranks: int, bucket_mb: float) -> int:
    """The bytes of a rank's model state held in allocations of at least
    :func:`dspark.cpu_malloc.mmap_threshold_bytes` each (on a CPU the C library maps those apart
    from its heap: see [Note: process memory]): parameters (or zero3's shards), the gradients' flat
    buffers (one per bucket: whole, or its shards under zero2/zero3, a bucket of one its own
    gradient), the optimizer's state per parameter (its rows only where sharded)."""
    limit = mmap_threshold_bytes()
    n = num_ranks

    def mine(spec: ParamSpec, sharded: bool) -> int:
        return _padded_bytes(spec, n) // n if sharded and n > 1 else _whole_bytes(spec)

    pieces = [mine(spec, policy.splits_params_on(n)) for spec in (*shape.trainable, *shape.frozen)]
    order = list(reversed(range(len(shape.trainable))))
    for group in bucket_groups(shape.trainable, order, bucket_mb):
        pieces.append(sum(mine(shape.trainable[i], policy.shard_grads) for i in group))
    moments, _ = shape.optimizer_state
    pieces += [mine(spec, policy.splits_optimizer_on(n)) for spec in shape.trainable for _ in range(moments)]
    return sum(p for p in pieces if p >= limit)


def collective_heap_bytes(shape: ModelShape, bucket_mb: float) -> int:
    """The two largest gradient buckets (whole bytes) below :func:`dspark.cpu_malloc.mmap_threshold_bytes`:
    what gloo's threads copy into heaps of their own (see [Note: process memory])."""
    limit = mmap_threshold_bytes()
    order = list(reversed(range(len(shape.trainable))))
    sizes = sorted((sum(_whole_bytes(shape.trainable[i]) for i in group)
                    for group in bucket_groups(shape.trainable, order, bucket_mb)), reverse=True)
    return sum(size for size in sizes[:2] if size < limit)


def state_bytes(shape: ModelShape, strategy: str, num_ranks: int) -> dict[str, int]:
    """Rank 0's ``{"params", "grads", "optimizer"}`` bytes (rank 0 owns the most rows); ``num_ranks``:
    the ranks that split the rows (a hybrid strategy's shard group)."""
    policy = all_strategies()[strategy]

    def expect(specs: Sequence[ParamSpec]) -> dict[str, int]:
        metas = (torch.empty(s, dtype=d, device="meta") for s, d in specs)
        return expected_state_bytes(metas, policy, rank=0, num_ranks=num_ranks,
                                    optimizer_state=shape.optimizer_state)
    out = expect(shape.trainable)
    out["params"] += expect(shape.frozen)["params"]
    return out


def buckets(shape: ModelShape, ready: Sequence[float], bucket_mb: float) -> list[tuple[float, int]]:
    """``(ready fraction of backward, whole bytes)`` per gradient bucket, grouped as the engine does
    (:func:`dspark.engine.grad_bucket.make_buckets`: by dtype, in the order gradients become ready,
    about ``bucket_mb`` MiB each)."""
    return [(ready_at, nbytes) for ready_at, nbytes, _, _ in _bucket_rows(shape, ready, bucket_mb)]


def _bucket_rows(shape: ModelShape, ready: Sequence[float], bucket_mb: float,
                 split: int = 1) -> list[tuple[float, int, int, bool]]:
    """:func:`buckets` with each bucket's count of parameters, and whether each of them splits into
    equal rows over ``split`` ranks."""
    limit = bucket_mb * 2**20
    order = sorted(range(len(shape.trainable)), key=lambda i: ready[i])
    open_: dict[torch.dtype, list[int]] = {}
    done: list[list[int]] = []
    for i in order:
        dtype = shape.trainable[i][1]
        group = open_.setdefault(dtype, [])
        if group and sum(_whole_bytes(shape.trainable[j]) for j in group) + _whole_bytes(
                shape.trainable[i]) > limit:
            done.append(group)
            group = open_[dtype] = []
        group.append(i)
    done.extend(g for g in open_.values() if g)
    out = [(max(ready[j] for j in g), sum(_whole_bytes(shape.trainable[j]) for j in g), len(g),
            all((shape.trainable[j][0] or (1,))[0] % split == 0 for j in g)) for g in done]
    return sorted(out)


def _serial_exposed(items: Sequence[tuple[float, float, float]], window_ms: float) -> float:
    """Items ``(ready_ms, duration_ms, then_ms)`` on one channel in ready order, each followed by
    ``then_ms`` on a second channel once it is done (hybrid's all-reduce across nodes): how far the
    last one ends past ``window_ms``."""
    end = then_end = 0.0
    for ready_ms, duration_ms, then_ms in sorted(items):
        end = max(end, ready_ms) + duration_ms
        then_end = max(then_end, end) + then_ms
    return max(0.0, end - window_ms, then_end - window_ms)


def _gather_stalls(unit_ms: Sequence[float], gather_ms: Sequence[float]) -> float:
    """Units computing in order, each gathered while the one before computes: the stalls."""
    stall = gather_ms[0] if gather_ms else 0.0
    for k in range(1, len(gather_ms)):
        stall += max(0.0, gather_ms[k] - unit_ms[k - 1])
    return stall


def _copy_ms(probe: Probe, nbytes: float, copies: int) -> float:
    """``copies`` of the engine's copies of ``nbytes`` in all (see [Note: per-copy cost])."""
    return 1e3 * (copies * probe.per_copy_s + (nbytes / probe.copy_bytes_per_s if probe.copy_bytes_per_s > 0 else 0))


def gradient_check_ms(probe: Probe, grad_bytes: int, sharded: bool, split: int) -> float:
    """Milliseconds of the engine's one pass over a rank's reduced gradients before the optimizer
    step, which scales them and flags a value that is not finite (see [Note: predicted step]): every
    gradient byte (``grad_bytes``, whole) on one rank and under replicate/zero1, its ``1/split``
    shard where the gradients are reduced in shards (``sharded``), at the probe's measured rate; 0.0
    where the probe measured none.

    Example::

        gradient_check_ms(probe, 64 << 20, sharded=True, split=2)   # a pass over half of them
    """
    if probe.check_bytes_per_s <= 0:
        return 0.0
    return 1e3 * (grad_bytes / split if sharded else grad_bytes) / probe.check_bytes_per_s


def fresh_map_ms(probe: Probe, storage_bytes: Sequence[int], mmap_threshold: int) -> float:
    """Milliseconds of the page faults of the storages among ``storage_bytes`` that the C library
    maps afresh each time (at least ``mmap_threshold``), at the probe's measured first-touch rate
    (see [Note: predicted step]); 0.0 where the probe measured none (a GPU).

    Example::

        fresh_map_ms(probe, [100 << 20, 1 << 20], 32 << 20)   # the first storage's faults only
    """
    if probe.fault_bytes_per_s <= 0:
        return 0.0
    return 1e3 * sum(b for b in storage_bytes if b >= mmap_threshold) / probe.fault_bytes_per_s


def _exposed_comm_ms(shape: ModelShape, probe: Probe, policy: ShardingPolicy, n: int,
                     grouped: Sequence[tuple[float, int]], bucket_counts: Sequence[int], passes: int,
                     forward_ms: float, backward_ms: float, link: Interconnect, split: int,
                     rows_in_place: Sequence[bool] = ()) -> float:
    """The step's communication that compute does not hide, on ``n > 1`` ranks whose rows are split
    over ``split`` (``n``, or a hybrid shard group's size; see [Note: predicted step] and
    [Note: what each strategy sends]); ``rows_in_place``: per bucket, whether zero1/zero2's row
    gather lands it straight in the parameters (no copies of the engine's)."""
    hidden = link.link_for(n).overlaps_compute
    across = link.link_for(n)  # a replica group's ring crosses the nodes

    def reduce_ms(nbytes: int) -> tuple[float, float]:
        if not policy.shard_grads:  # whole gradients: one all-reduce over every rank
            return 1e3 * all_reduce_s(nbytes, n, link), 0.0
        return (1e3 * reduce_scatter_s(nbytes, split, link),
                1e3 * all_reduce_s(nbytes // split, n // split, across))

    # gradient buckets, in backward: (ready ms, wire ms, then across ms); zero2/zero3 first copy the
    # whole gradients into the send buffer (compute-side work: never hidden)
    items = [(ready * backward_ms, *reduce_ms(nbytes)) for ready, nbytes in grouped]
    # zero2/zero3 pack every gradient into its bucket's send buffer; replicate/zero1 copy each fresh
    # gradient into its bucket's flat buffer, but for a bucket of one, whose gradient becomes the buffer
    copied = [(nbytes, count) for (_, nbytes), count in zip(grouped, bucket_counts, strict=True)
              if policy.shard_grads or count > 1]
    co_run = _node_co_run(probe, link, n)

    def shared(ms: float, working_set_bytes: float) -> float:  # the engine's copy or first touch, ranks at once
        return ms * co_run.pass_factor(working_set_bytes) if co_run is not None and ms > 0 else ms

    local_ms = sum(shared(_copy_ms(probe, nbytes, count), 2 * nbytes) for nbytes, count in copied)
    extras_bytes = 8 * (2 + 3 * n + len(shape.trainable))
    after_ms = 1e3 * all_reduce_s(extras_bytes, n, link)  # the step's one small vector
    if policy.shard_grads:  # shards reduced: the non-finite flag is all-reduced before the step
        after_ms += 1e3 * all_reduce_s(FLAG_BYTES, n, link)
    if policy.splits_optimizer_on(split) and not policy.shard_params:  # the updated rows, after the step
        in_place = list(rows_in_place) or [False] * len(grouped)  # else each parameter's rows packed, N-1 landed
        after_ms += sum(1e3 * all_gather_s(nbytes, split, link)
                        + (0.0 if landed else shared(_copy_ms(probe, nbytes, count * split), 2 * nbytes))
                        for (_, nbytes), count, landed in zip(grouped, bucket_counts, in_place, strict=True))
    if not policy.splits_params_on(split):
        wire = _serial_exposed(items, backward_ms) if hidden else sum(d + t for _, d, t in items)
        return wire + local_ms + after_ms
    threshold = mmap_threshold_bytes()

    def gathers_ms(units: list[list[int]]) -> list[float]:
        return [1e3 * all_gather_s(sum(unit) + TAG_BYTES, split, link)
                + shared(fresh_map_ms(probe, unit, threshold), sum(b for b in unit if b >= threshold))
                for unit in units]

    gathers = gathers_ms(shape.unit_param_bytes(split))  # forward's
    regathers = gathers_ms(shape.unit_param_bytes(split, probe.frozen_unread))  # backward's
    if not hidden:
        return sum(d + t for _, d, t in items) + passes * (sum(gathers) + sum(regathers)) + local_ms + after_ms
    shares = list(probe.unit_forward_share) or [1.0]
    fwd_units = [s * forward_ms for s in shares]
    bwd_units = [s * backward_ms for s in shares]
    # forward: root first, then the blocks in order; backward: root, then blocks reversed
    stalls = passes * (_gather_stalls(fwd_units, gathers)
                       + _gather_stalls([bwd_units[0], *bwd_units[:0:-1]], [regathers[0], *regathers[:0:-1]]))
    return max(stalls, _serial_exposed(items + [(0.0, g, 0.0) for g in regathers], backward_ms)) + local_ms + after_ms


def _step_interval(probe: Probe, micro_batch: int, passes: int, exposed_ms: float,
                   optimizer_ms: float, compute_factor: float = 1.0) -> dict[str, float]:
    """The row's step by each of the probe's rounds: their lowest and highest (see [Note: steady
    steps]); none without rounds. ``compute_factor`` scales each round's compute (see [Note: co-run
    slowdown] in :mod:`dspark.planner.co_run`)."""
    rounds = list(zip(probe.forward_ms_rounds, probe.backward_ms_rounds, probe.optimizer_ms_rounds, strict=False))
    if not rounds:
        return {}
    share = optimizer_ms / probe.optimizer_ms if probe.optimizer_ms > 0 else 0.0
    # a noisy round's line may fall with the batch; no round predicts a compute time below zero
    steps = [compute_factor * passes * (max(f.at(micro_batch), 0.0) + max(b.at(micro_batch), 0.0))
             + exposed_ms + o * share
             for f, b, o in rounds]
    return {"step_ms_low": min(steps), "step_ms_high": max(steps)}


def row_transport(device: str, link: Interconnect, num_ranks: int, split: int) -> str:
    """How a row's sharded collectives travel (see :data:`dspark.planner.peak_timeline.TRANSPORTS`):
    ``"nccl"`` on a GPU; on a CPU ``"shm"`` where they run in the default group of one machine's
    ranks and ``dspark.comm`` would give that group its shared-memory transport (its own rule,
    :func:`dspark.comm.shm_setup.shm_wanted`: ``DSPARK_SHM``, the machine), else ``"gloo"``: a
    world over several nodes (more ranks than ``link.ranks_per_node``), a hybrid shard group smaller
    than the world (a subgroup), or shared memory turned off.

    Example::

        row_transport("cpu", get_interconnect("loopback-gloo"), 4, 4)   # "shm"
        row_transport("cpu", get_interconnect("loopback-gloo"), 4, 2)   # "gloo": hybrid shard groups of 2
    """
    if "cuda" in device:
        return "nccl"
    if num_ranks == 1:
        return "shm"  # nothing travels: no process group's copies either
    per_node = num_ranks if link.ranks_per_node is None else min(num_ranks, link.ranks_per_node)
    one_group = split == num_ranks and shm_wanted(num_ranks, per_node, "gloo", "cpu")
    return "shm" if one_group else "gloo"


def row_cost(*, shape: ModelShape, probe: Probe, strategy: str, num_ranks: int, micro_batch: int,
             passes: int, bucket_mb: float, link: Interconnect, shard_group_size: int | None = None) -> RowCost:
    """One rank's predicted memory and step for ``strategy`` on ``num_ranks`` ranks running
    ``passes`` micro-batches of ``micro_batch`` samples per step (see [Note: predicted memory] and
    [Note: predicted step]); a hybrid strategy in shard groups of ``shard_group_size`` ranks (None:
    one group of all).

    Example::

        row_cost(shape=shape, probe=probe, strategy="zero2", num_ranks=2, micro_batch=16, passes=1,
                 bucket_mb=25.0, link=get_interconnect("loopback-gloo"))
        row_cost(..., strategy="hybrid-zero3", num_ranks=64, shard_group_size=8, link=get_interconnect("nvlink"))
    """
    policy = all_strategies()[strategy]
    n = num_ranks
    split = shard_group_size if policy.hybrid and shard_group_size is not None else n
    if n % split:
        raise ValueError(f"shard_group_size={split} does not divide the world: world_size({n}) % "
                         f"shard_group_size({split}) != 0")
    state = state_bytes(shape, strategy, split)
    transport = row_transport(probe.device, link, n, split)
    peak = step_peak(trainable=shape.trainable, units=shape.units, unit_bytes=shape.unit_bytes(split),
                     probe=probe, strategy=strategy, num_ranks=n, split=split, micro_batch=micro_batch,
                     bucket_mb=bucket_mb, resident_bytes=state["params"] + state["optimizer"],
                     grads_bytes=state["grads"], transport=transport,
                     backward_unit_bytes=[sum(u) for u in shape.unit_param_bytes(split, probe.frozen_unread)])
    rows = _bucket_rows(shape, probe.grad_ready, bucket_mb, split)
    grouped = [(ready_at, nbytes) for ready_at, nbytes, _, _ in rows]

    forward_ms = probe.forward_ms.at(micro_batch)
    backward_ms = probe.backward_ms.at(micro_batch)
    compute_ms = passes * (forward_ms + backward_ms)
    optimizer_ms = probe.optimizer_ms
    if policy.splits_optimizer_on(split):  # each rank steps 1/N of every parameter's rows
        optimizer_ms = probe.optimizer_fixed_ms + (probe.optimizer_ms - probe.optimizer_fixed_ms) / split
    exposed = 0.0
    state_total = state["params"] + state["grads"] + state["optimizer"]
    heap_transient = None  # see [Note: process memory]: the probe's heap high-water, and the strategy's own
    if probe.heap_step_bytes is not None:
        heap_transient = round(probe.heap_step_bytes.at(micro_batch)
                               + max(0.0, peak.peak_bytes - state_total - probe.step_bytes.at(micro_batch)))
    if n > 1:
        exposed = _exposed_comm_ms(shape, probe, policy, n, grouped, [count for _, _, count, _ in rows], passes,
                                   forward_ms, backward_ms, link, split,
                                   [transport == "shm" and even for *_, even in rows])
    grad_bytes = sum(nbytes for _, nbytes in grouped)
    check_sharded = policy.shard_grads and n > 1
    check_ms = gradient_check_ms(probe, grad_bytes, check_sharded, split)
    shared = _co_run_row(shape, probe, policy, link, n, split, micro_batch, passes, state["optimizer"],
                         compute_ms=compute_ms, optimizer_ms=optimizer_ms, check_ms=check_ms,
                         check_bytes=grad_bytes // split if check_sharded else grad_bytes)
    return RowCost(params_bytes=state["params"], grads_bytes=state["grads"],
                   optimizer_bytes=state["optimizer"], activation_bytes=peak.activation_bytes,
                   comm_buffer_bytes=peak.comm_buffer_bytes, runtime_bytes=peak.runtime_bytes,
                   peak_bytes=peak.peak_bytes,
                   process_peak_bytes=process_peak_bytes(
                       peak.peak_bytes, device_type="cuda" if "cuda" in probe.device else "cpu",
                       num_ranks=1 if probe.baseline_in_rank else n,
                       baseline_bytes=probe.process_baseline_bytes, allocator_share=probe.allocator_share,
                       mapped_bytes=mapped_state_bytes(shape, policy, split, bucket_mb),
                       collective_heap_bytes=collective_heap_bytes(shape, bucket_mb),
                       state_bytes=state_total, heap_transient_bytes=heap_transient,
                       ratchet_bytes=ratchet_step_bytes(b for unit in shape.unit_param_bytes(split) for b in unit)
                       if policy.splits_params_on(split) else 0),
                   compute_ms=shared.compute_ms, comm_exposed_ms=exposed,
                   optimizer_ms=shared.optimizer_ms + shared.check_ms,
                   co_run_compute_factor=shared.compute_factor, co_run_optimizer_factor=shared.optimizer_factor,
                   **_step_interval(probe, micro_batch, passes, exposed + shared.check_ms, shared.optimizer_ms,
                                    shared.compute_factor))


def _node_co_run(probe: Probe, link: Interconnect, n: int) -> CoRun | None:
    """The link's co-run slowdown where a row's ranks share a node (more than one per node, on a
    CPU), else None."""
    per_node = n if link.ranks_per_node is None else min(n, link.ranks_per_node)
    return link.co_run if per_node > 1 and "cuda" not in probe.device else None


def _co_run_row(shape: ModelShape, probe: Probe, policy: ShardingPolicy, link: Interconnect, n: int, split: int,
                micro_batch: int, passes: int, optimizer_bytes: int, *, compute_ms: float, optimizer_ms: float,
                check_ms: float, check_bytes: int) -> CoRunParts:
    """The row's compute, optimizer step and check pass beside the node's other ranks, each by its
    working set (see [Note: co-run slowdown] in :mod:`dspark.planner.co_run`): only with more than one
    rank per node, on a CPU, over a link that measured the slowdown."""
    co_run = _node_co_run(probe, link, n)
    params = sum(_whole_bytes(spec) for spec in (*shape.trainable, *shape.frozen))
    grads = sum(_whole_bytes(spec) for spec in shape.trainable)
    activations = probe.activation_bytes(micro_batch)
    stepped = grads // split if policy.splits_optimizer_on(split) else grads  # a rank's rows (and their gradients)
    return co_run_parts(co_run, compute_ms=compute_ms, optimizer_ms=optimizer_ms, check_ms=check_ms,
                        compute_working_set_bytes=params + activations,
                        compute_traffic_bytes=passes * (2 * params + grads + 2 * activations),
                        optimizer_working_set_bytes=optimizer_bytes + 2 * stepped,
                        check_working_set_bytes=check_bytes)
