from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import dspark
from dspark import comm
from tests.messages import assert_line_names, assert_names


def _sum_and_counters() -> dict:
    world = dspark.get_world()
    comm.reset_stats()
    t = torch.full((4,), float(world.rank + 1))
    comm.all_reduce(t)
    avg = torch.full((2,), float(world.rank))
    comm.all_reduce(avg, op="avg")
    out = torch.empty(world.world_size * 3)
    comm.all_gather_into_tensor(out, torch.full((3,), float(world.rank)))
    rs = torch.empty(2)
    handle = comm.reduce_scatter_tensor(rs, torch.arange(4.0), async_op=True)
    assert handle is not None
    handle.wait()
    handle.wait()  # idempotent
    rs_avg = torch.empty(3)  # on gloo an all-to-all and a local sum, then the average
    comm.reduce_scatter_tensor(rs_avg, torch.arange(6.0) * (world.rank + 1), op="avg")
    objs = comm.all_gather_object({"rank": world.rank})
    return {"sum": t.tolist(), "avg": avg.tolist(), "gathered": out.tolist(), "rs": rs.tolist(),
            "rs_avg": rs_avg.tolist(),
            "objs": objs, "stats": {k: (v.calls, v.bytes, v.wire_bytes) for k, v in comm.stats().items()}}


def test_collectives_and_byte_counters(pool) -> None:
    r0, r1 = pool.run(_sum_and_counters)
    assert r0["sum"] == r1["sum"] == [3.0] * 4
    assert r0["avg"] == [0.5, 0.5]
    assert r0["gathered"] == [0, 0, 0, 1, 1, 1]
    assert r0["rs"] == [0.0, 2.0] and r1["rs"] == [4.0, 6.0]
    assert r0["rs_avg"] == [0.0, 1.5, 3.0] and r1["rs_avg"] == [4.5, 6.0, 7.5]  # (1 + 2) / 2 * x
    assert r0["objs"] == [{"rank": 0}, {"rank": 1}]
    stats = r0["stats"]
    assert stats["all_reduce"] == (2, 16 + 8, 16 + 8)  # 2*(N-1)/N * bytes with N=2
    assert stats["all_gather"][:2] == (1, 12)
    assert stats["reduce_scatter"] == (2, 16 + 24, 8 + 12)  # (N-1)/N * bytes


def _skip_collective_on_rank_1() -> dict[str, Any]:
    world = dspark.get_world()
    group = comm.new_group(timeout=2.0)
    try:
        if world.rank == 1:
            return {}
        launched = comm.all_reduce(torch.ones(4), group=group, async_op=True, label="dspark.first")
        started = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8), group=group, label="dspark.test.all_reduce")
        except dspark.CollectiveTimeoutError as exc:
            got: dict[str, Any] = {"message": str(exc), "after_s": time.monotonic() - started}
        # the group stopped at that timeout: a launched collective and a new one fail at once
        started = time.monotonic()
        for attempt in (launched.wait, lambda: comm.broadcast(torch.ones(2), group=group)):
            try:
                attempt()
            except dspark.CollectiveTimeoutError as exc:
                got.setdefault("later", []).append(str(exc))
        got["later_s"] = time.monotonic() - started
        return got
    finally:
        comm.barrier()  # rank 1 waits here on the default group until rank 0 has timed out
        comm.destroy_group(group)


@pytest.mark.serial
def test_timeout_fires_once_at_the_stated_time_and_names_the_collective(pool) -> None:
    got, skipped = pool.run(_skip_collective_on_rank_1)
    assert skipped == {}
    message = got["message"]
    assert_line_names(message, "rank 0:", "all_reduce", "32 bytes", "(dspark.test.all_reduce)")
    assert_line_names(message, "timed out", "2 s", "rank(s) 1 never joined")
    assert 2.0 <= got["after_s"] < 3.5, got
    assert len(got["later"]) == 2 and got["later_s"] < 0.5, got
    for later in got["later"]:
        assert_names(later, "not run", "dspark.test.all_reduce")


def test_world_size_one_stand_in_is_noop(single_process) -> None:
    comm.reset_stats()
    t = torch.arange(3.0)
    comm.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0]
    out = torch.empty(3)
    comm.all_gather_into_tensor(out, t)
    assert out.tolist() == t.tolist()
    parts = [torch.empty(1), torch.empty(2)]
    comm.all_gather_parts([t[:1], t[1:]], parts)
    assert [p.tolist() for p in parts] == [[0.0], [1.0, 2.0]]
    with pytest.raises(ValueError) as caught:
        comm.all_gather_parts([t[:1], t[1:]], [torch.empty(1), torch.empty(3)])
    assert_names(str(caught.value), "output 1", "3 x torch.float32", "1 ranks x 2")
    assert comm.all_gather_object("x") == ["x"]
    assert comm.stats()["all_reduce"].bytes == 0
    comm.barrier()


def test_stats_of_a_group_name_no_group_has_is_refused(single_process) -> None:
    # stats(group="replicas") gave {}, as if nothing had crossed the nodes
    comm.reset_stats()
    assert comm.stats(group="replica") == {} and comm.stats(group="world") == {}  # known, nothing counted
    with pytest.raises(ValueError) as caught:
        comm.stats(group="replicas")
    assert_names(str(caught.value), "group='replicas'", "'replica'", "'shard'", "'world'")
    comm.new_group(name="pipeline")   # a group's own name is known before its first collective
    assert comm.stats(group="pipeline") == {}


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="'auto', 'gloo', 'nccl', 'mpi'"):
        dspark.init(backend="tcp")


def test_unavailable_backend_names_available(monkeypatch) -> None:
    dspark.shutdown()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    if "mpi" in comm.available_backends():
        pytest.skip("this PyTorch has MPI")
    with pytest.raises(ValueError, match="available: gloo"):
        dspark.init(backend="mpi")


def test_calls_before_init_say_how_to_fix() -> None:
    dspark.shutdown()
    with pytest.raises(dspark.NotInitializedError, match=r"dspark.init\(\)"):
        comm.all_reduce(torch.ones(1))


def test_init_twice_returns_the_world_or_refuses_another_backend(single_process) -> None:
    assert dspark.init() is single_process
    with pytest.raises(ValueError) as caught:
        dspark.init(backend="gloo")
    assert_names(str(caught.value), "backend='gloo'", "'none'")


def _partition_and_counters() -> dict[str, Any]:
    world = dspark.get_world()
    comm.reset_stats()
    alone = comm.partition_groups([(0,), (1,)], name="shard")  # each rank its own group
    both = comm.partition_groups([(0, 1)], name="replica")
    again = comm.partition_groups([(0,), (1,)], name="shard")  # made once, reused
    t = torch.full((4,), float(world.rank + 1))
    comm.all_reduce(t, group=alone)
    comm.all_reduce(t, group=both)
    comm.all_reduce(torch.ones(2))
    return {"same": again is alone, "sizes": (alone.size, both.size), "ranks": (alone.rank, both.rank),
            "sum": t.tolist(), **{name: {k: (v.calls, v.wire_bytes) for k, v in comm.stats(group=name).items()}
                                  for name in ("shard", "replica", "world")},
            "all": {k: v.calls for k, v in comm.stats().items()}}


def test_partition_groups_count_their_bytes_apart(pool) -> None:
    r0, r1 = pool.run(_partition_and_counters)
    assert r0["same"] and r0["sizes"] == (1, 2) and r0["ranks"] == (0, 0) and r1["ranks"] == (0, 1)
    assert r0["sum"] == r1["sum"] == [3.0] * 4  # alone: unchanged; both: 1 + 2
    assert r0["shard"] == {"all_reduce": (1, 0)}  # one rank: nothing sent
    assert r0["replica"] == {"all_reduce": (1, 16)}
    assert r0["world"] == {"all_reduce": (1, 8)} and r0["all"] == {"all_reduce": 3}
    with pytest.raises(AssertionError) as info:  # the pool reports each rank's ValueError
        pool.run(comm.partition_groups, [(0,)], name="shard")
    assert_names(str(info.value), "ValueError: partition_groups: [(0,)]", "world_size(2)")


def _gloo_gather_holding_its_buffers() -> dict[str, Any]:
    """A gather of parts through gloo while something else (as gloo's worker thread does until it
    next runs) still holds the buffers the collective was given."""
    from dspark.comm import collectives

    rank = dspark.get_world().rank
    gloo = comm.new_group()   # a side group always runs on gloo
    held: list[torch.Tensor] = []
    real = collectives._ALL_GATHER

    def keeping(output: torch.Tensor, send: torch.Tensor, **kwargs: Any) -> Any:
        held.extend([output, send])
        return real(output, send, **kwargs)

    try:
        outputs = [torch.empty(6), torch.empty(4)]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(collectives, "_ALL_GATHER", keeping)
            handle = comm.all_gather_parts([torch.arange(3.0) + 10 * rank, torch.full((2,), float(rank))],
                                           outputs, async_op=True, group=gloo)
            handle.wait()
        return {"held_bytes": [t.untyped_storage().nbytes() for t in held],
                "outputs": [o.tolist() for o in outputs]}
    finally:
        comm.destroy_group(gloo)


def test_a_gather_through_gloo_frees_its_packed_buffers_at_the_wait(pool) -> None:
    # one rank of an embedding-tied zero3 run on 4 gloo ranks held a whole extra root unit at its
    # peak: gloo's worker thread still held the packed buffers when the rank gathered the next unit
    for got in pool.run(_gloo_gather_holding_its_buffers):
        assert got["outputs"] == [[0.0, 1.0, 2.0, 10.0, 11.0, 12.0], [0.0, 0.0, 1.0, 1.0]]
        assert got["held_bytes"] == [0, 0], got
