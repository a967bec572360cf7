"""Hybrid rows of the plan ([Note: what each strategy sends] for hybrid-zero1/2/3): a rank holds its
shard group's share, the stage's collectives run on the link inside a node and only the gradient
shards' all-reduce crosses, checked on made-up links and probes (no process, no model run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import dspark
from dspark.planner import Interconnect, get_interconnect, model_shape
from dspark.planner.auto_choice import auto_plan, choose
from dspark.planner.cost import row_cost
from dspark.planner.hybrid_rows import hybrid_group
from tests.messages import assert_names
from tests.planner.test_auto import ADAMW
from tests.planner.test_cost import _model, _probe
from tests.planner.test_planner import _mlp

ACROSS = Interconnect(name="across", bytes_per_s=1e9, latency_s=0.0, overlaps_compute=False, source="by hand")
TWO_LEVEL = Interconnect(name="inside", bytes_per_s=1e15, latency_s=0.0, overlaps_compute=False, ranks_per_node=2,
                         inter_node=ACROSS, source="by hand: a link inside nodes of 2 that costs nothing")
GRAD_BYTES = 4 * (4 * 512 * 512 + 4 * 512)


def _cost(strategy: str, n: int, group: int | None, link: Interconnect = TWO_LEVEL):
    return row_cost(shape=model_shape(_model(), (2, True)), probe=_probe(), strategy=strategy, num_ranks=n,
                    micro_batch=8, passes=1, bucket_mb=25.0, link=link, shard_group_size=group)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_a_hybrid_row_holds_its_shard_groups_share(stage: str) -> None:
    hybrid, flat_in_group, flat = _cost(f"hybrid-{stage}", 8, 2), _cost(stage, 2, None), _cost(stage, 8, None)
    parts = ("params_bytes", "grads_bytes", "optimizer_bytes", "optimizer_ms")
    assert [getattr(hybrid, p) for p in parts] == [getattr(flat_in_group, p) for p in parts]
    assert hybrid.optimizer_bytes > flat.optimizer_bytes  # a 1/2 share, not 1/8
    assert _cost(f"hybrid-{stage}", 8, 8) == flat  # one group of every rank: the plain stage


def test_only_the_gradient_shards_cross_the_nodes() -> None:
    across_ms = 1e3 * GRAD_BYTES / 1e9  # moving every gradient byte once over the slow link
    # 4 ranks in 2 nodes of 2; inside costs nothing. Flat strategies' rings cross the nodes:
    assert _cost("replicate", 4, None).comm_exposed_ms == pytest.approx(1.5 * across_ms, rel=1e-2)
    assert _cost("zero2", 4, None).comm_exposed_ms == pytest.approx(1.5 * across_ms, rel=1e-2)  # rs + rows
    assert _cost("zero3", 4, None).comm_exposed_ms == pytest.approx(2.25 * across_ms, rel=1e-2)  # rs + 2 gathers
    # hybrid: the reduce-scatter, gathers and row gathers stay inside; each rank's half of the
    # gradients is all-reduced between the 2 nodes: 2 (2-1)/2 * G/2
    for stage in ("zero2", "zero3"):
        assert _cost(f"hybrid-{stage}", 4, 2).comm_exposed_ms == pytest.approx(0.5 * across_ms, rel=1e-2)
    assert _cost("hybrid-zero1", 4, 2).comm_exposed_ms == pytest.approx(1.5 * across_ms, rel=1e-2)  # as zero1's


def test_the_plan_adds_hybrid_rows_where_nodes_split_the_ranks() -> None:
    probe = _probe()
    table = dspark.plan(_model(), torch.zeros(32, 512), probe=probe, devices=[1, 8, 16],
                        interconnect="nvlink")
    hybrid = {(r.label, r.devices) for r in table.rows if r.shard_group_size is not None}
    assert hybrid == {(f"hybrid-{s} (2x8)", 16) for s in ("zero1", "zero2", "zero3")}
    assert "hybrid-zero3 (2x8)" in str(table)
    stated = dspark.plan(_model(), torch.zeros(32, 512), probe=probe, devices=[8, 16],
                         interconnect="nvlink", strategies=["hybrid-zero3"], shard_group_size=4)
    assert [(r.label, r.devices) for r in stated.rows] == [("hybrid-zero3 (2x4)", 8), ("hybrid-zero3 (4x4)", 16)]
    with pytest.raises(ValueError) as info:
        dspark.plan(_model(), torch.zeros(12, 512), probe=probe, devices=[6], interconnect="nvlink",
                    strategies=["hybrid-zero2"], shard_group_size=4)
    assert_names(str(info.value), "world_size(6) % shard_group_size(4) != 0")
    with pytest.raises(ValueError) as info:
        hybrid_group(get_interconnect("roce-200g"), 2, None)
    assert_names(str(info.value), "'roce-200g'", "shard_group_size=")
    assert hybrid_group(get_interconnect("roce-200g"), 2, None, required=False) is None


@pytest.mark.parametrize("size", [0, -2, 2.0, "2", True])
def test_a_shard_group_size_that_is_not_a_count_is_refused_by_name(size: object) -> None:
    # 0 stopped dspark plan --shard-group-size 0 with ZeroDivisionError from inside the table
    with pytest.raises(ValueError) as info:
        dspark.plan(_model(), torch.zeros(32, 512), probe=_probe(), devices=[8], interconnect="nvlink",
                    shard_group_size=size)  # type: ignore[arg-type]
    assert_names(str(info.value), f"shard_group_size={size!r}", "int >= 1")


def test_a_stated_shard_group_larger_than_the_world_is_refused_as_the_engine_refuses_it() -> None:
    # it was cut down to the world in silence: hybrid-zero3 (1x8) planned for a size the engine refuses
    with pytest.raises(ValueError) as info:
        dspark.plan(_model(), torch.zeros(32, 512), probe=_probe(), devices=[8], interconnect="nvlink",
                    strategies=["hybrid-zero3"], shard_group_size=16)
    assert_names(str(info.value), "world_size(8) % shard_group_size(16) != 0", "1, 2, 4, 8")


def test_two_profiles_make_a_two_level_fabric() -> None:
    boxes = get_interconnect("nvlink+roce-200g")
    assert boxes.link_for(8).bytes_per_s == get_interconnect("nvlink").bytes_per_s
    assert boxes.link_for(16) is get_interconnect("roce-200g")
    with pytest.raises(ValueError) as info:
        get_interconnect("pcie+roce-200g")
    assert_names(str(info.value), "'pcie'", "nvlink")
    for three in ("nvlink+roce-200g+pcie", "nvlink+nvlink+roce-200g"):  # the second was taken as a 3-level fabric
        with pytest.raises(ValueError) as info:
            get_interconnect(three)
        assert_names(str(info.value), repr(three), "3 profiles", "INSIDE+ACROSS")


def test_auto_chooses_hybrid_where_the_link_between_nodes_is_the_bottleneck() -> None:
    slow = dataclasses.replace(TWO_LEVEL, overlaps_compute=True,
                               inter_node=dataclasses.replace(ACROSS, bytes_per_s=1e7))  # well past a tie
    rows = auto_plan(_mlp(), optimizer=ADAMW, precision="fp32", bucket_mb=25.0, num_ranks=4, bus_bytes_per_s=1e9,
                     backend="nccl", memory_budget=1 << 40, link=slow, shard_group_size=2)
    assert {r.strategy for r in rows.rows} >= {"hybrid-zero1", "hybrid-zero2", "hybrid-zero3"}
    assert choose(rows).strategy.startswith("hybrid-")
    flat = auto_plan(_mlp(), optimizer=ADAMW, precision="fp32", bucket_mb=25.0, num_ranks=4, bus_bytes_per_s=1e9,
                     backend="nccl", memory_budget=1 << 40, link=slow)
    assert not any(r.strategy.startswith("hybrid-") for r in flat.rows)  # one node: no hybrid rows


@pytest.mark.parametrize(("devices", "size", "names"), [
    ([8], 3, ("shard_group_size=3", "devices=8", "8 % 3 = 2", "1, 2, 4, 8")),  # the rows were left out silently
    ([1, 2, 8], 16, ("shard_group_size=16", "devices=[1, 2, 8]", "2, 4")),  # no count has several groups
    ([1, 2], 2, ("shard_group_size=2", "devices=[1, 2]", "(e.g. 4)")),
])
def test_a_shard_group_size_that_leaves_the_hybrid_rows_out_is_refused_by_name(devices, size, names) -> None:
    with pytest.raises(ValueError) as info:
        dspark.plan(_model(), torch.zeros(48, 512), probe=_probe(), devices=devices, interconnect="nvlink",
                    shard_group_size=size)
    assert_names(str(info.value), *names)
    assert_names(_refusal([8], 4, ["zero3"]), "shard_group_size=4", "['zero3']", "hybrid-zero3")  # it was ignored
    kept = dspark.plan(_model(), torch.zeros(48, 512), probe=_probe(), devices=[1, 2, 8], interconnect="nvlink",
                       shard_group_size=4)  # 1 and 2 devices are fewer than two groups: no hybrid row, no error
    assert {r.devices for r in kept.rows if r.shard_group_size is not None} == {8}


def _refusal(devices: list[int], size: int, strategies: list[str]) -> str:
    with pytest.raises(ValueError) as info:
        dspark.plan(_model(), torch.zeros(48, 512), probe=_probe(), devices=devices, interconnect="nvlink",
                    shard_group_size=size, strategies=strategies)
    return str(info.value)
