"""Hybrid sharding on the 2-rank pool: each rank its own shard group (2 replicas of a 1-rank ZeRO), and
one group of both ranks (hybrid is then the flat stage). Both train as one process on the whole batch,
with SGD (scale-sensitive) and AdamW, clip included; groups of 2 x 2 and 3 x 2 run in
tests/engine/test_hybrid_launch.py."""

from __future__ import annotations

import pytest

import dspark
from dspark import comm
from dspark.engine.engine import engine_parts
from tests.engine.cases import get_case
from tests.engine.harness import assert_close, train_engine, train_reference
from tests.messages import assert_names

HYBRID = ("hybrid-zero1", "hybrid-zero2", "hybrid-zero3")


def _train(strategy: str, group_size: int, optimizer: str, clip: float | None) -> dict:
    out = train_engine("mlp", strategy, 3, optimizer=optimizer, clip=clip, shard_group_size=group_size)
    by_group = {name: {k: v.calls for k, v in comm.stats(group=name).items()} for name in ("shard", "replica")}
    return {**out, "by_group": by_group}


@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", HYBRID)
def test_hybrid_on_two_ranks_trains_as_one_process(pool, strategy: str, group_size: int, optimizer: str) -> None:
    want = train_reference("mlp", 3, optimizer=optimizer, clip=0.05)
    for rank, got in enumerate(pool.run(_train, strategy, group_size, optimizer, 0.05)):
        assert_close(got["state"], want["state"], f"{strategy}, groups of {group_size}, {optimizer}, rank {rank}")
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)  # the norm counts each shard once
        memory = got["memory"]
        assert memory["shard_group_size"] == group_size
        for part in ("params", "grads", "optimizer"):  # the shard group's share, nothing replicated beyond it
            assert memory[f"{part}_bytes"] <= memory[f"{part}_bytes_expected"], (part, memory)
        across = got["by_group"]["replica"]
        if group_size == 1 and strategy != "hybrid-zero1":
            assert across.get("all_reduce", 0) >= 3  # each step's shards, across the groups
        if group_size == 2:
            assert not across  # one group of the whole world: nothing crosses groups


def _memory(strategy: str, group_size: int | None) -> dict:
    kwargs = {} if group_size is None else {"shard_group_size": group_size}
    return train_engine("mlp", strategy, 1, optimizer="adamw", **kwargs)["memory"]


def test_a_rank_holds_its_shard_groups_share(pool) -> None:
    whole = pool.run(_memory, "replicate", None)[0]
    halves = pool.run(_memory, "zero3", None)[0]
    alone = pool.run(_memory, "hybrid-zero3", 1)[0]  # a shard group of one rank holds everything
    paired = pool.run(_memory, "hybrid-zero3", 2)[0]
    for part in ("params", "optimizer"):
        assert alone[f"{part}_bytes_expected"] == whole[f"{part}_bytes_expected"]
        assert paired[f"{part}_bytes_expected"] == halves[f"{part}_bytes_expected"]
        assert alone[f"{part}_bytes"] == alone[f"{part}_bytes_expected"]


def _refused(strategy: str, **options: object) -> str:
    from tests.engine.harness import build_engine

    with pytest.raises(ValueError) as info:
        build_engine("mlp", strategy, **options)
    return str(info.value)


def test_a_shard_group_size_that_does_not_divide_the_world_is_refused_on_every_rank(pool) -> None:
    for message in pool.run(_refused, "hybrid-zero2", shard_group_size=3):
        assert_names(message, "world_size(2) % shard_group_size(3) != 0", "1, 2")


def test_shard_group_size_needs_a_hybrid_strategy() -> None:
    with pytest.raises(ValueError) as info:
        dspark.EngineConfig().replace(strategy="zero3", shard_group_size=2)
    assert_names(str(info.value), "shard_group_size=2", "'zero3'", "hybrid-zero3")
    dspark.EngineConfig().replace(strategy="hybrid-zero3", shard_group_size=2)
    dspark.EngineConfig().replace(strategy="auto", shard_group_size=2)


def _parts_groups(strategy: str, group_size: int) -> tuple[int, int, int | None]:
    from tests.engine.harness import build_engine

    engine = build_engine("mlp", strategy, shard_group_size=group_size)
    groups = engine_parts(engine).rank_groups
    engine.close()
    return groups.shard.rank, groups.shard.size, None if groups.replica is None else groups.replica.size


def test_groups_follow_the_layout(pool) -> None:
    assert pool.run(_parts_groups, "hybrid-zero2", 1) == [(0, 1, 2), (0, 1, 2)]
    assert pool.run(_parts_groups, "hybrid-zero2", 2) == [(0, 2, None), (1, 2, None)]


def test_the_replicated_batch_check_and_the_drift_check_hold_across_shard_groups(pool) -> None:
    """Each rank its own shard group: the ranks that must see different batches and equal
    hyper-parameters are in different groups, and both checks still compare every rank."""
    from tests.engine.test_batch_check import _train as train_on
    from tests.engine.test_ddp_habits import _one_rank_changes

    for rank, result in enumerate(pool.run(train_on, "REPLICATE", strategy="hybrid-zero2", shard_group_size=1)):
        assert result["steps"] == 0 and result["error"].startswith(f"rank {rank}: "), result
        assert_names(result["error"], "ranks 0 and 1", "identical input")
    for result in pool.run(train_on, "split", strategy="hybrid-zero2", shard_group_size=1):
        assert result["error"] is None and result["steps"] == 4
    for rank, result in enumerate(pool.run(_one_rank_changes, "hybrid-zero3", 0, "lr", 1.0, shard_group_size=1)):
        assert_names(str(result["message"]), f"rank {rank}: ", "param group 0 'lr'", "1.0 on rank 1")
        assert result["unchanged"] and result["step_count"] == 1, result


def _audit(strategy: str, group_size: int) -> list[dict]:
    from dspark.engine.audit import above_share
    from tests.engine.harness import build_engine, train_steps

    engine = build_engine("mlp", strategy, shard_group_size=group_size)
    train_steps(engine, "mlp", range(1))
    x, y = dspark.distribute_batch(get_case("mlp").batch(1), shard_dim=0)
    engine.backward(get_case("mlp").loss(engine, (x, y)))  # gradients held, as the audit reads them
    over = above_share(engine.audit())
    engine.step()
    engine.close()
    return over


@pytest.mark.parametrize("strategy", ["hybrid-zero2", "hybrid-zero3"])
def test_the_audit_expects_the_shard_groups_share(pool, strategy: str) -> None:
    assert pool.run(_audit, strategy, 1) == [[], []]  # a group of one holds every row, as it should
