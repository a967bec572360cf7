"""Every collective DSpark runs goes through this module: the one place that calls
``torch.distributed`` ops, counts bytes, turns backend failures into errors that name the
collective, the rank and the timeout, and stands in with no-ops when the world has one process.

Each collective takes ``async_op`` and returns a :class:`Handle`; with ``async_op=True`` the
collective is in flight until ``handle.wait()`` (which raises the same errors), otherwise the handle
is already complete."""

from __future__ import annotations

import datetime as _dt
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dspark.comm import stats as _stats
from dspark.comm.failures import describe, group_failed_error, timeout_error
from dspark.comm.observer import current_observer
from dspark.comm.shm_setup import stop_shm_transport, through_shm
from dspark.comm.world_state import get_world
from dspark.errors import CollectiveError, CollectiveTimeoutError

__all__ = [
    "Group",
    "Handle",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_parts",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "default_group",
    "destroy_group",
    "device_mesh",
    "new_group",
    "reduce_scatter_tensor",
    "release_groups",
]

# PyTorch renamed the flat collectives (``*_into_tensor`` / ``*_tensor`` -> ``*_single``); this is
# the one place that knows. Both are called on flat views, the layout every backend accepts.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_VALID_OPS = ("sum", "avg", "max", "min")


@dataclass(frozen=True, slots=True)
class Group:
    """A set of ranks that run collectives together. ``pg is None`` means the default group, or
    the no-op stand-in when ``size == 1`` and no process group exists."""

    pg: Any
    rank: int
    size: int
    timeout_s: float
    device: torch.device | None = None
    """Where this group's tensors live; None: the world's device. A gloo side group of an NCCL job
    (e.g. for a checkpoint written in the background) runs on the CPU."""
    name: str = "world"
    """What the byte counters file this group's collectives under (:func:`dspark.comm.stats`)."""


_subgroups: list[Group] = []


def default_group() -> Group:
    world = get_world()
    return Group(pg=None, rank=world.rank, size=world.world_size, timeout_s=world.timeout_s)


def new_group(ranks: Sequence[int] | None = None, *, timeout: float | None = None,
              backend: str | None = None, name: str = "world") -> Group:
    """A new group over ``ranks`` (all ranks by default) with its own timeout in seconds and, with
    ``backend="gloo"``, its own backend (its tensors then live on the CPU); ``name`` files its
    collectives' bytes (:func:`dspark.comm.stats`). Every rank of the world must call it, in the
    same order; a rank outside ``ranks`` gets a group with ``rank == -1`` that it must not use."""
    world = get_world()
    timeout_s = world.timeout_s if timeout is None else float(timeout)
    _stats.name_group(name)
    if not world.is_distributed:
        return Group(pg=None, rank=0, size=1, timeout_s=timeout_s, name=name)
    if backend not in (None, "gloo", world.backend):
        raise ValueError(f"new_group(backend={backend!r}): a group runs on the world's backend "
                         f"{world.backend!r} or on 'gloo'")
    members = list(range(world.world_size)) if ranks is None else sorted(set(ranks))
    pg = dist.new_group(members, timeout=_dt.timedelta(seconds=timeout_s), backend=backend)
    rank = members.index(world.rank) if world.rank in members else -1
    device = torch.device("cpu") if backend == "gloo" else None
    group = Group(pg=pg, rank=rank, size=len(members), timeout_s=timeout_s, device=device, name=name)
    if rank >= 0:  # a non-member holds no process group to destroy
        _subgroups.append(group)
    return group


def destroy_group(group: Group) -> None:
    if group.pg is not None and group in _subgroups:
        _subgroups.remove(group)
        _failed.pop(id(group.pg), None)
        dist.destroy_process_group(group.pg)


def release_groups() -> None:
    """Drop the device mesh, the shared-memory transport and every side group (called by
    ``shutdown`` before the default group goes)."""
    global _mesh
    _mesh = None
    stop_shm_transport()
    for group in list(_subgroups):
        destroy_group(group)
    _failed.clear()


def _is_noop(group: Group) -> bool:
    return group.size == 1 and not get_world().is_distributed


_failed: dict[int, CollectiveTimeoutError] = {}
"""The first timeout of each group that had one, by ``id(group.pg)``: see [Note: a timed-out group
stays failed] in :mod:`dspark.comm.failures`."""


def _refuse_if_failed(kind: str, group: Group, nbytes: int, label: str | None) -> None:
    first = _failed.get(id(group.pg))
    if first is not None:
        raise group_failed_error(rank=get_world().rank, what=describe(kind, nbytes, label), first=first)


def _raise_from(exc: BaseException, kind: str, group: Group, nbytes: int, label: str | None) -> None:
    rank = get_world().rank
    text = str(exc)
    if isinstance(exc, CollectiveTimeoutError):  # DSpark's own transport, which knows who is missing
        error = exc
    elif isinstance(exc, CollectiveError):  # DSpark's own transport: the message is already ours
        raise exc
    elif "timed out" in text.lower() or "timeout" in text.lower():
        error = timeout_error(rank=rank, what=describe(kind, nbytes, label), timeout_s=group.timeout_s,
                              missing=None, others=[r for r in range(group.size) if r != group.rank],
                              detail=f" (backend said: {text[:300]})")
    else:
        raise CollectiveError(f"rank {rank}: {describe(kind, nbytes, label)} failed: {text[:500]}") from exc
    _failed.setdefault(id(group.pg), error)
    if error is exc:
        raise exc
    raise error from exc


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and is safe to call twice."""

    __slots__ = ("_after", "_done", "_group", "_kind", "_label", "_nbytes", "_work")

    def __init__(self, work: Any, kind: str, group: Group, nbytes: int,
                 after: Callable[[], object] | None = None, label: str | None = None) -> None:
        self._work = work
        self._kind = kind
        self._label = label
        self._group = group
        self._nbytes = nbytes
        self._after = after
        self._done = work is None
        if self._done and after is not None:
            after()

    def wait(self) -> None:
        if self._done:
            return
        _refuse_if_failed(self._kind, self._group, self._nbytes, self._label)
        observer = current_observer()  # see [Note: why the hook lives in comm]
        try:
            if observer is None:
                self._work.wait()
            else:
                observer.wait(self._kind, self._label, self._work.wait)
        except Exception as exc:  # the backend's error, re-raised with our context
            _raise_from(exc, self._kind, self._group, self._nbytes, self._label)
        self._done = True
        if self._after is not None:
            self._after()

    def is_completed(self) -> bool:
        return self._done or bool(self._work.is_completed())


def _run(kind: str, group: Group, nbytes: int, launch: Callable[[], Any], async_op: bool,
         after: Callable[[], object] | None = None, label: str | None = None) -> Handle:
    _refuse_if_failed(kind, group, nbytes, label)
    _stats.record(kind, nbytes, group.size, group.name)
    observer = current_observer()
    try:
        work = launch() if observer is None else observer.launch(kind, label, launch)
    except Exception as exc:
        _raise_from(exc, kind, group, nbytes, label)
    handle = Handle(work, kind, group, nbytes, after, label)
    if not async_op:
        handle.wait()
    return handle


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src.reshape(dst.shape))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False,
               group: Group | None = None, label: str | None = None) -> Handle:
    """Reduce ``tensor`` in place across ranks (``op``: sum, avg, max, min). ``label`` names this
    collective for an observer (:mod:`dspark.comm.observer`), e.g. in profiler traces."""
    if op not in _VALID_OPS:
        raise ValueError(f"op={op!r} is not one of {_VALID_OPS}")
    g = group or default_group()
    if _is_noop(g):
        return _run("all_reduce", g, _nbytes(tensor), lambda: None, async_op, label=label)
    # gloo has no AVG: sum, then divide once the sum has landed.
    after = (lambda: tensor.div_(g.size)) if op == "avg" else None
    shm = through_shm(g.pg, tensor)
    if shm is not None:
        return _run("all_reduce", g, _nbytes(tensor),
                    lambda: shm.all_reduce(tensor, "sum" if op == "avg" else op, label=label),
                    async_op, after, label)
    reduce_op = _REDUCE_OPS["sum" if op == "avg" else op]
    return _run("all_reduce", g, _nbytes(tensor),
                lambda: dist.all_reduce(tensor, op=reduce_op, group=g.pg, async_op=True),
                async_op, after, label)


def all_gather_into_tensor(output: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False,
                           group: Group | None = None, label: str | None = None) -> Handle:
    """Concatenate every rank's ``shard`` (equal sizes) along dim 0 into ``output``."""
    return _all_gather("all_gather", output, shard, async_op, group, label)


def _all_gather(kind: str, output: torch.Tensor, shard: torch.Tensor, async_op: bool,
                group: Group | None, label: str | None = None) -> Handle:
    g = group or default_group()
    if output.numel() != shard.numel() * g.size:
        raise ValueError(f"{kind}: output has {output.numel()} elements, expected "
                         f"{g.size} ranks x {shard.numel()} = {g.size * shard.numel()}")
    if _is_noop(g):
        return _run(kind, g, _nbytes(shard), lambda: _copy(output, shard), async_op, label=label)
    shm = through_shm(g.pg, output, shard)
    if shm is not None and output.dtype == shard.dtype:
        return _run(kind, g, _nbytes(shard), lambda: shm.all_gather(output, shard, label=label), async_op,
                    label=label)
    return _run(kind, g, _nbytes(shard),
                lambda: _ALL_GATHER(output.view(-1), shard.reshape(-1), group=g.pg, async_op=True),
                async_op, label=label)


def all_gather_parts(parts: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], *,
                     async_op: bool = False, group: Group | None = None,
                     label: str | None = None) -> Handle:
    """One all-gather of several tensors of one dtype: ``outputs[i]`` (``N * parts[i].numel()``
    elements, contiguous) gets every rank's ``parts[i]`` in rank order. Through shared memory the
    parts are read and the outputs written in place; on a process group they travel packed in one
    buffer and are copied out when the handle is waited on."""
    g = group or default_group()
    if not parts or len(parts) != len(outputs):
        raise ValueError(f"all_gather_parts: {len(parts)} parts for {len(outputs)} outputs")
    for i, (part, out) in enumerate(zip(parts, outputs, strict=True)):
        if out.numel() != part.numel() * g.size or out.dtype != parts[0].dtype or part.dtype != parts[0].dtype:
            raise ValueError(f"all_gather_parts: output {i} has {out.numel()} x {out.dtype}, "
                             f"expected {g.size} ranks x {part.numel()} x {parts[0].dtype}")
        if not out.is_contiguous():
            raise ValueError(f"all_gather_parts: output {i} is not contiguous")
    nbytes = sum(_nbytes(p) for p in parts)
    if _is_noop(g):
        def copy_all() -> None:
            for part, out in zip(parts, outputs, strict=True):
                _copy(out, part)

        return _run("all_gather", g, nbytes, copy_all, async_op, label=label)
    shm = through_shm(g.pg, *outputs, *(p.reshape(-1) for p in parts))
    if shm is not None:
        return _run("all_gather", g, nbytes,
                    lambda: shm.all_gather_parts(list(parts), list(outputs), label=label), async_op, label=label)
    send = torch.cat([p.reshape(-1) for p in parts])
    packed = send.new_empty((g.size, send.numel()))

    def unpack() -> None:
        at = 0
        for part, out in zip(parts, outputs, strict=True):
            out.view(g.size, part.numel()).copy_(packed[:, at:at + part.numel()])
            at += part.numel()
        if packed.device.type == "cpu":  # see [Note: packed buffers are freed at the wait]
            packed.untyped_storage().resize_(0)
            send.untyped_storage().resize_(0)

    return _run("all_gather", g, nbytes,
                lambda: _ALL_GATHER(packed.view(-1), send, group=g.pg, async_op=True),
                async_op, unpack, label)


# [Note: packed buffers are freed at the wait] A gather through a process group packs every part
# into ``send`` and lands every rank's in ``packed`` (a whole unit under zero3, N times this rank's
# share); both are dead once unpacked. But gloo's work object holds them too, and gloo's worker
# thread drops its reference only after it has marked the work done: when that thread is not
# scheduled at once (more ranks than cores), the buffers outlived the wait while this rank gathered
# and computed the next unit, and one rank in a run held a whole extra root unit at its peak (an
# embedding-tied zero3 model on 4 gloo ranks: its embedding plus its shard). Their storage is freed
# at the wait, whoever still holds the tensors: gloo has finished with them when the wait returns.
# On an accelerator freeing is left to the caching allocator's stream bookkeeping.


def all_gather(shard: torch.Tensor, *, group: Group | None = None,
               _kind: str = "all_gather", label: str | None = None) -> list[torch.Tensor]:
    """Every rank's ``shard`` (equal shapes), as a list indexed by rank."""
    g = group or default_group()
    flat = torch.empty((g.size, *shard.shape), dtype=shard.dtype, device=shard.device)
    _all_gather(_kind, flat, shard.contiguous(), False, g, label)
    return list(flat.unbind(0))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str = "sum", *,
                          async_op: bool = False, group: Group | None = None,
                          label: str | None = None) -> Handle:
    """Reduce ``input`` (``N`` equal chunks along dim 0) across ranks; rank ``r`` gets chunk ``r``
    in ``output``. On gloo it runs as an all-to-all into a buffer of ``input``'s size, summed into
    ``output`` when the handle is waited on (see [Note: reduce-scatter on gloo])."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter op={op!r} is not one of ('sum', 'avg')")
    g = group or default_group()
    if input.numel() != output.numel() * g.size:
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                         f"{g.size} ranks x {output.numel()} = {g.size * output.numel()}")
    if _is_noop(g):
        return _run("reduce_scatter", g, _nbytes(input), lambda: _copy(output, input), async_op,
                    label=label)
    shm = through_shm(g.pg, output, input)
    if shm is not None and output.dtype == input.dtype:
        after = (lambda: output.div_(g.size)) if op == "avg" else None
        return _run("reduce_scatter", g, _nbytes(input), lambda: shm.reduce_scatter(output, input, label=label),
                    async_op, after, label)
    if _reduce_scatter_by_all_to_all(g, input):
        return _reduce_scatter_gloo(output, input, op, g, async_op, label)
    after = (lambda: output.div_(g.size)) if op == "avg" else None
    return _run("reduce_scatter", g, _nbytes(input),
                lambda: _REDUCE_SCATTER(output.view(-1), input.reshape(-1), op=dist.ReduceOp.SUM,
                                        group=g.pg, async_op=True),
                async_op, after, label)


# [Note: reduce-scatter on gloo] gloo builds its reduce-scatter from point-to-point messages and
# is slower than an all-reduce of the whole input, which itself moves twice the bytes a
# reduce-scatter needs. An all-to-all moves exactly those bytes (rank r receives chunk r of every
# rank, (N - 1) / N of the input), and this rank then sums its N chunks. The three on 2 gloo
# ranks over loopback, bucket by bucket: ``dspark run --nproc 2 benchmarks/reduce_scatter.py``,
# kept at docs/figures.md#reduce-scatter.
def _reduce_scatter_by_all_to_all(group: Group, input: torch.Tensor) -> bool:
    return input.device.type == "cpu" and dist.get_backend(group.pg) == "gloo"


def _reduce_scatter_gloo(output: torch.Tensor, input: torch.Tensor, op: str, group: Group,
                         async_op: bool, label: str | None) -> Handle:
    # lives from the launch to the sum: the caller's buffers are never written behind its back
    scratch = torch.empty(input.numel(), dtype=input.dtype, device=input.device)
    received = scratch.view(group.size, output.numel())

    def after() -> None:
        torch.sum(received, dim=0, out=output.view(-1))
        if op == "avg":
            output.div_(group.size)

    return _run("reduce_scatter", group, _nbytes(input),
                lambda: dist.all_to_all_single(scratch.view(-1), input.reshape(-1), group=group.pg,
                                               async_op=True),
                async_op, after, label)


def broadcast(tensor: torch.Tensor, src: int = 0, *, async_op: bool = False,
              group: Group | None = None, label: str | None = None) -> Handle:
    """Copy ``tensor`` from rank ``src`` to every rank, in place."""
    g = group or default_group()
    if not 0 <= src < g.size:
        raise ValueError(f"broadcast src={src} is outside [0, {g.size})")
    if _is_noop(g):
        return _run("broadcast", g, _nbytes(tensor), lambda: None, async_op, label=label)
    shm = through_shm(g.pg, tensor)
    if shm is not None:
        return _run("broadcast", g, _nbytes(tensor), lambda: shm.broadcast(tensor, src, label=label),
                    async_op, label=label)
    global_src = src if g.pg is None else dist.get_global_rank(g.pg, src)
    return _run("broadcast", g, _nbytes(tensor),
                lambda: dist.broadcast(tensor, src=global_src, group=g.pg, async_op=True),
                async_op, label=label)


def device_mesh() -> Any:
    """PyTorch's 1-D ``DeviceMesh`` over the whole world (for DTensor interop), built once."""
    global _mesh
    world = get_world()
    if not world.is_distributed:
        raise CollectiveError(
            "rank 0: PyTorch DTensor needs a process group, and this is the single-process "
            "stand-in; start with `dspark run` or call dspark.init(backend='gloo')"
        )
    if _mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        _mesh = init_device_mesh(world.device.type, (world.world_size,))
    return _mesh


_mesh: Any = None


def barrier(*, group: Group | None = None) -> None:
    """Block until every rank of the group arrives (a tiny all-reduce, so the timeout applies)."""
    g = group or default_group()
    if _is_noop(g):
        return
    flag = torch.zeros(1, device=g.device or get_world().device)
    _run("barrier", g, 0, lambda: dist.all_reduce(flag, group=g.pg, async_op=True), False)


def all_gather_object(obj: Any, *, group: Group | None = None, label: str | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, as a list indexed by rank (``label`` names both gathers)."""
    g = group or default_group()
    if _is_noop(g):
        _stats.record("all_gather_object", 0, 1)
        return [obj]
    device = g.device or get_world().device
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = all_gather(size, group=g, _kind="all_gather_object", label=label)
    longest = int(max(int(s.item()) for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = all_gather(padded, group=g, _kind="all_gather_object", label=label)
    return [pickle.loads(bytes(t[: int(s.item())].cpu().numpy()))
            for t, s in zip(gathered, sizes, strict=True)]


def broadcast_object(obj: Any, src: int = 0, *, group: Group | None = None, label: str | None = None) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank."""
    return all_gather_object(obj if (group or default_group()).rank == src else None, group=group,
                             label=label)[src]
