"""Hybrid sharding's groups as pure arithmetic: shard groups of consecutive ranks, replica groups of
the ranks holding the same rows, and the layouts refused with the numbers that do not fit."""

from __future__ import annotations

import pytest

from dspark.policy import (
    HYBRID_STRATEGIES,
    STRATEGIES,
    all_strategies,
    group_layout,
    sharding_policy,
)
from tests.messages import assert_names


def test_groups_of_consecutive_ranks_and_their_replicas() -> None:
    layout = group_layout(6, shard_group_size=2)
    assert layout.shard_groups() == [(0, 1), (2, 3), (4, 5)]
    assert layout.replica_groups() == [(0, 2, 4), (1, 3, 5)]
    assert [layout.shard_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [layout.replica_rank(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert layout.num_replicas == 3 and not layout.is_flat


def test_a_node_is_a_shard_group_by_default() -> None:
    layout = group_layout(16, local_world_size=8)
    assert layout.shard_groups() == [tuple(range(8)), tuple(range(8, 16))]
    assert layout.replica_groups()[0] == (0, 8)
    assert group_layout(4, local_world_size=4).is_flat  # one node: the plain stage
    assert group_layout(4, shard_group_size=2, local_world_size=4).shard_group_size == 2  # stated wins


def test_a_size_that_does_not_divide_the_world_is_refused_with_the_arithmetic() -> None:
    with pytest.raises(ValueError) as info:
        group_layout(6, shard_group_size=4)
    assert_names(str(info.value), "world_size(6) % shard_group_size(4) != 0", "1, 2, 3, 6")
    with pytest.raises(ValueError) as info:
        group_layout(6, local_world_size=4)
    assert_names(str(info.value), "world_size(6) % LOCAL_WORLD_SIZE(4) != 0", "shard_group_size=")
    with pytest.raises(ValueError) as info:
        group_layout(4, shard_group_size=0)
    assert_names(str(info.value), "shard_group_size=0")
    with pytest.raises(ValueError) as info:
        group_layout(4)
    assert_names(str(info.value), "shard_group_size=", "LOCAL_WORLD_SIZE")


def test_hybrid_strategies_are_the_stages_with_the_group_dimension() -> None:
    assert list(HYBRID_STRATEGIES) == ["hybrid-zero1", "hybrid-zero2", "hybrid-zero3"]
    for name, policy in HYBRID_STRATEGIES.items():
        flat = STRATEGIES[policy.stage]
        assert policy.hybrid and not flat.hybrid and name == f"hybrid-{flat.name}"
        assert (policy.shard_optimizer, policy.shard_grads, policy.shard_params) == (
            flat.shard_optimizer, flat.shard_grads, flat.shard_params)
    assert sharding_policy("hybrid-zero2") is HYBRID_STRATEGIES["hybrid-zero2"]
    assert list(all_strategies()) == [*STRATEGIES, *HYBRID_STRATEGIES]
    with pytest.raises(ValueError) as info:
        sharding_policy("hybrid-zero4")
    assert_names(str(info.value), "'hybrid-zero4'", "'hybrid-zero3'")
