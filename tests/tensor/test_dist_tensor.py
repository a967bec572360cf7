"""``distribute_tensor`` and ``DistTensor`` on the 2-rank gloo pool and on the world-size-1 stand-in.

Functions handed to ``pool.run`` are module-level (the ranks import them by name) and return plain
values, so that the asserts, and their diffs, happen in the test process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dspark
from dspark import comm
from dspark.tensor import REPLICATE, DistTensor, PlacementError, Replicate, Shard
from tests.messages import assert_line_names, assert_names

NUM_RANKS = 2  # tests/rank_pool.py
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8, torch.bool)


def _collective_calls() -> dict[str, int]:
    return {kind: entry.calls for kind, entry in comm.stats().items()}


def _chunk(t: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    """The reference split: torch.chunk, which leaves out trailing empty shards."""
    chunks = t.chunk(NUM_RANKS, dim)
    return chunks[rank] if rank < len(chunks) else t.narrow(dim, 0, 0)


def _sample(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same values on every rank, spread over the dtype's range."""
    g = torch.Generator().manual_seed(1234)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    values = torch.randint(0, 2**31 - 1, shape, generator=g, dtype=torch.int64)
    if dtype == torch.int64:  # beyond 2**53: any trip through float64 would change them
        return values + 2**62
    return (values % (torch.iinfo(dtype).max + 1)).to(dtype)


# -- tasks run on every rank -------------------------------------------------------------------
def _shard_every_dim() -> list[dict[str, Any]]:
    t = torch.arange(5 * 3 * 4).view(5, 3, 4)  # dims split 3+2, 2+1 and 2+2
    out = []
    for shard_dim in (0, 1, 2, -1, -2, -3, Shard(1), REPLICATE):
        comm.reset_stats()
        x = dspark.distribute_tensor(t, shard_dim=shard_dim)
        calls_to_split = _collective_calls()
        whole = x.full()
        out.append({"shard_dim": shard_dim, "placement": x.placement,
                    "global_shape": tuple(x.global_shape), "local": x.local.tolist(),
                    "local_shape": tuple(x.local.shape), "full_equal": torch.equal(whole, t),
                    "full_shape": tuple(whole.shape), "calls_to_split": calls_to_split,
                    "dtype": x.dtype, "device": str(x.device), "repr": repr(x)})
    return out


def _uneven_rows() -> dict[int, dict[str, Any]]:
    out = {}
    for rows in (7, 1, 0):
        t = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
        x = dspark.distribute_tensor(t, shard_dim=0)
        out[rows] = {"local": x.local.tolist(), "local_shape": tuple(x.local.shape),
                     "local_bytes": x.local_bytes, "full_equal": torch.equal(x.full(), t),
                     "global_shape": tuple(x.global_shape)}
    return out


def _full_round_trips_every_dtype() -> list[str]:
    failures = []
    for dtype in DTYPES:
        for shape in ((4, 6), (7, 3), (3, 5, 2), (1, 4)):
            t = _sample(shape, dtype)
            for shard_dim in [*range(len(shape)), -1, REPLICATE]:
                x = dspark.distribute_tensor(t, shard_dim=shard_dim)
                whole = x.full()
                if not (torch.equal(whole, t) and whole.dtype == dtype):
                    failures.append(f"{dtype} {shape} shard_dim={shard_dim!r}: got {whole!r}")
                if x.local_bytes != x.local.numel() * t.element_size():
                    failures.append(f"{dtype} {shape} shard_dim={shard_dim!r}: local_bytes "
                                    f"{x.local_bytes}")
    return failures


def _redistribute_round_trip() -> dict[str, Any]:
    t = torch.arange(7 * 5, dtype=torch.float64).view(7, 5)
    s0 = dspark.distribute_tensor(t, shard_dim=0)
    comm.reset_stats()
    replicated = s0.redistribute(REPLICATE)
    calls_to_gather = _collective_calls()
    comm.reset_stats()
    s1 = replicated.redistribute(1)
    calls_to_slice = _collective_calls()
    back = s1.redistribute(Shard(0))
    try:
        s0.redistribute(None)
        none_error = ""
    except PlacementError as exc:
        none_error = str(exc)
    return {"placements": [x.placement for x in (s0, replicated, s1, back)],
            "replicated_local_equal": torch.equal(replicated.local, t),
            "s1_local": s1.local.tolist(), "back_equal": torch.equal(back.local, s0.local),
            "full_equal": [torch.equal(x.full(), t) for x in (s0, replicated, s1, back)],
            "same_is_self": s1.redistribute(-1) is s1,
            "calls_to_gather": calls_to_gather, "calls_to_slice": calls_to_slice,
            "none_error": none_error}


def _constructor_checks_the_local_shape() -> dict[str, str]:
    rank = dspark.get_world().rank
    own = torch.zeros(4 - rank, 2)  # 7 rows on 2 ranks: 4 + 3
    DistTensor(own, Shard(0), (7, 2))  # the right piece is accepted
    DistTensor(torch.zeros(7, 2), Replicate(), torch.Size([7, 2]))
    errors = {}
    for name, local, placement, shape in [
        ("whole_as_shard", torch.zeros(7, 2), Shard(0), (7, 2)),
        ("other_ranks_piece", torch.zeros(3 + rank, 2), Shard(0), (7, 2)),
        ("shard_as_replicate", own, Replicate(), (7, 2)),
        ("dim_out_of_range", own, Shard(2), (7, 2)),
        ("not_a_placement", own, 0, (7, 2)),
    ]:
        try:
            DistTensor(local, placement, shape)  # type: ignore[arg-type]
            errors[name] = ""
        except PlacementError as exc:
            errors[name] = str(exc)
    return errors


def _shard_dim_none_everywhere() -> dict[str, Any]:
    comm.reset_stats()
    try:
        dspark.distribute_tensor(torch.ones(4, 3), shard_dim=None)
        message = ""
    except PlacementError as exc:
        message = str(exc)
    calls = _collective_calls()
    comm.barrier()  # both ranks still agree on the next collective: nothing was left half-done
    return {"message": message, "calls": calls}


def _replicate_broadcasts_rank_0() -> dict[str, Any]:
    rank = dspark.get_world().rank
    mine = torch.full((3, 2), float(rank + 1))
    comm.reset_stats()
    x = dspark.distribute_tensor(mine, shard_dim=REPLICATE)
    calls = _collective_calls()
    transposed = torch.arange(12.0).view(3, 4).T + 100 * rank  # non-contiguous input
    xt = dspark.distribute_tensor(transposed, shard_dim=REPLICATE)
    return {"local": x.local.tolist(), "full": x.full().tolist(), "mine_after": mine.tolist(),
            "placement": x.placement, "local_bytes": x.local_bytes, "calls": calls,
            "transposed": xt.local.tolist()}


# -- tests on the pool -------------------------------------------------------------------------
def test_shard_on_every_dim_keeps_torch_chunk_rows_and_full_restores(pool) -> None:
    t = torch.arange(5 * 3 * 4).view(5, 3, 4)
    per_rank = pool.run(_shard_every_dim)
    for rank, results in enumerate(per_rank):
        for got in results:
            shard_dim = got["shard_dim"]
            assert got["global_shape"] == (5, 3, 4) and got["full_shape"] == (5, 3, 4)
            assert got["full_equal"], got
            assert got["dtype"] == torch.int64 and got["device"] == "cpu"
            assert f"rank={rank}/2" in got["repr"] and repr(got["placement"]) in got["repr"]
            if shard_dim is REPLICATE or isinstance(shard_dim, Replicate):
                assert got["placement"] == Replicate()
                assert got["local"] == t.tolist()
                assert got["calls_to_split"] == {"broadcast": 1}
                continue
            dim = shard_dim.dim if isinstance(shard_dim, Shard) else shard_dim % 3
            assert got["placement"] == Shard(dim), got
            assert got["local"] == _chunk(t, dim, rank).tolist(), (rank, shard_dim)
            assert got["calls_to_split"] == {}, "sharding is local: no collective"


def test_uneven_rows_split_first_ranks_first(pool) -> None:
    r0, r1 = pool.run(_uneven_rows)
    assert (r0[7]["local_shape"], r1[7]["local_shape"]) == ((4, 2), (3, 2))
    assert r0[7]["local"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert r1[7]["local"] == [[8, 9], [10, 11], [12, 13]]
    assert (r0[7]["local_bytes"], r1[7]["local_bytes"]) == (4 * 2 * 4, 3 * 2 * 4)
    assert (r0[1]["local_shape"], r1[1]["local_shape"]) == ((1, 2), (0, 2))
    assert (r0[1]["local_bytes"], r1[1]["local_bytes"]) == (8, 0)
    assert (r0[0]["local_shape"], r1[0]["local_shape"]) == ((0, 2), (0, 2))
    for rows in (7, 1, 0):
        for r in (r0, r1):
            assert r[rows]["full_equal"] and r[rows]["global_shape"] == (rows, 2), (rows, r)


def test_full_returns_exactly_the_original_for_every_dtype_dim_and_split(pool) -> None:
    for rank, failures in enumerate(pool.run(_full_round_trips_every_dtype)):
        assert failures == [], f"rank {rank}: " + "\n".join(failures)


def test_redistribute_round_trips_shard_replicate_shard(pool) -> None:
    t = torch.arange(7 * 5, dtype=torch.float64).view(7, 5)
    for rank, got in enumerate(pool.run(_redistribute_round_trip)):
        assert got["placements"] == [Shard(0), Replicate(), Shard(1), Shard(0)]
        assert got["replicated_local_equal"] and got["back_equal"]
        assert got["s1_local"] == _chunk(t, 1, rank).tolist()
        assert got["full_equal"] == [True] * 4
        assert got["same_is_self"], "redistributing to the same placement is free"
        assert got["calls_to_gather"] == {"all_gather": 1}
        assert got["calls_to_slice"] == {}, "Replicate -> Shard slices locally"
        assert_line_names(got["none_error"], "DistTensor", "shape (7, 5)", "shard_dim=None")


def test_constructor_rejects_a_local_piece_of_the_wrong_shape(pool) -> None:
    for rank, errors in enumerate(pool.run(_constructor_checks_the_local_shape)):
        assert_line_names(errors["whole_as_shard"], f"rank {rank}:", "local piece", "(7, 2)")
        assert f"(expected ({4 - rank}, 2))" in errors["whole_as_shard"]
        assert f"expected ({4 - rank}, 2)" in errors["other_ranks_piece"]
        assert "Replicate()" in errors["shard_as_replicate"]
        assert "expected (7, 2)" in errors["shard_as_replicate"]
        assert_line_names(errors["dim_out_of_range"], "Shard(dim=2)", "out of range", "(7, 2)")
        assert_line_names(errors["not_a_placement"], "placement=0", "dspark.Shard(dim)",
                          "dspark.Replicate()")


def test_shard_dim_none_raises_on_every_rank_before_any_collective(pool) -> None:
    for got in pool.run(_shard_dim_none_everywhere):
        assert_line_names(got["message"], "shape (4, 3)", "shard_dim=None")
        assert "shard_dim=dspark.REPLICATE" in got["message"]
        assert got["calls"] == {}


def test_replicate_broadcasts_rank_0s_values(pool) -> None:
    rank0_values = [[1.0, 1.0]] * 3
    for rank, got in enumerate(pool.run(_replicate_broadcasts_rank_0)):
        assert got["local"] == got["full"] == rank0_values, rank
        assert got["mine_after"] == [[float(rank + 1)] * 2] * 3, "the caller's tensor is untouched"
        assert got["placement"] == Replicate() and got["local_bytes"] == 3 * 2 * 4
        assert got["calls"] == {"broadcast": 1}
        assert got["transposed"] == (torch.arange(12.0).view(3, 4).T).tolist()


# -- the world-size-1 stand-in -----------------------------------------------------------------
def test_single_process_stand_in_keeps_the_whole_tensor(single_process) -> None:
    assert single_process.world_size == 1 and not single_process.is_distributed
    t = torch.arange(21.0).view(7, 3)
    for shard_dim in (0, 1, -1, Shard(0), REPLICATE):
        x = dspark.distribute_tensor(t, shard_dim=shard_dim)
        assert torch.equal(x.local, t) and torch.equal(x.full(), t)
        assert x.local_bytes == 21 * 4
        assert x.local.data_ptr() != t.data_ptr(), "the caller may free or change its tensor"
    x = dspark.distribute_tensor(t, shard_dim=0)
    assert torch.equal(x.redistribute(1).redistribute(REPLICATE).full(), t)
    with pytest.raises(PlacementError, match="shard_dim=None"):
        dspark.distribute_tensor(t, shard_dim=None)
    with pytest.raises(TypeError) as caught:
        dspark.distribute_tensor([[1.0]], shard_dim=0)  # type: ignore[arg-type]
    assert_names(str(caught.value), "torch.Tensor", "list")
    scalar = dspark.distribute_tensor(torch.tensor(3.0), shard_dim=REPLICATE)
    assert scalar.full().item() == 3.0 and scalar.global_shape == torch.Size([])
    with pytest.raises(PlacementError, match="0-d"):
        dspark.distribute_tensor(torch.tensor(3.0), shard_dim=0)
