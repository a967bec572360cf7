"""What each strategy sends, and that gradient reduction starts while backward still runs."""

from __future__ import annotations

import functools

import pytest
import torch

import dspark
from dspark import comm
from tests.engine import tiny_models as tm

# sharded gradients travel as a reduce-scatter of the bucket's (N, segment) buffer (on gloo an
# all-to-all and a local sum); the all-reduce left is the step's small extras vector
EXPECTED_KINDS = {
    "replicate": {"all_reduce"},
    "zero1": {"all_reduce", "all_gather"},
    "zero2": {"all_reduce", "reduce_scatter", "all_gather"},
    "zero3": {"all_reduce", "reduce_scatter", "all_gather"},
}


def _second_step_stats(strategy: str) -> dict:
    """What one step sends once the first step (which observes the gradients' order) is done."""
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy)
    for step in range(2):
        if step == 1:
            comm.reset_stats()
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    stats = {k: (v.calls, v.bytes) for k, v in comm.stats().items()}
    engine.close()
    return stats


@pytest.mark.parametrize("strategy", sorted(EXPECTED_KINDS))
def test_byte_counters_match_the_strategy(pool, strategy: str) -> None:
    stats = pool.run(_second_step_stats, strategy)[0]
    assert set(stats) == EXPECTED_KINDS[strategy]
    params = list(tm.make("mlp").parameters())
    grad_bytes = 4 * sum(p.numel() for p in params)
    # the step's extras: weights, one batch size, one position and one hyper-parameter fingerprint per
    # rank, one used-flag per parameter (float64)
    extras_bytes = 8 * (2 + 3 * 2 + len(params))
    if strategy in ("replicate", "zero1"):
        assert stats["all_reduce"] == (2, grad_bytes + extras_bytes)  # one bucket + the extras
    # each rank's rows, padded to equal chunks
    rows = sum(-(-(p.shape[0] if p.dim() else 1) // 2) * (p.numel() // (p.shape[0] if p.dim() else 1))
               for p in params)
    if strategy == "zero1":
        assert stats["all_gather"][1] == 4 * rows
    if strategy in ("zero2", "zero3"):  # one bucket: every rank's padded rows, the extras apart
        assert stats["reduce_scatter"] == (1, 2 * 4 * rows)
        # the extras, and the one-element flag of a non-finite gradient in this rank's shards (see
        # [Note: non-finite gradients found in the reduction])
        assert stats["all_reduce"] == (2, extras_bytes + 4)


def _launched_before_backward_ends() -> int:
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           bucket_mb=1e-4)
    first_layer = engine.module.layers[0].weight  # its gradient comes last in backward
    seen: list[int] = []
    first_layer.register_post_accumulate_grad_hook(
        lambda p: seen.append(comm.stats().get("all_reduce", comm.CollectiveStats()).calls))
    for step in range(2):  # the first step observes the order; the second overlaps
        comm.reset_stats()
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    engine.close()
    return seen[-1]


def test_buckets_launch_during_backward(pool) -> None:
    launched = pool.run(_launched_before_backward_ends)
    # tiny buckets, one per parameter (7): most have left before the first layer's gradient is in
    assert all(n >= 5 for n in launched), launched


def _zero3_frees_full_parameters() -> dict:
    engine = dspark.Engine(tm.make("tied"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy="zero3")
    most_gathered = [0]

    def count(*_: object) -> None:
        most_gathered[0] = max(most_gathered[0], sum(s.gathered for s in engine.slots))

    for module in engine.module.modules():
        module.register_forward_hook(count)
    x, y = dspark.distribute_batch(tm.batch("tied", 8, 0), shard_dim=0)
    engine.backward(tm.loss_fn("tied", engine(x), y))
    engine.step()
    sizes = [p.numel() for p in engine.module.parameters()]
    engine.close()
    return {"sizes": sizes, "most_gathered": most_gathered[0], "slots": len(engine.slots)}


def test_zero3_keeps_only_shards_between_steps(pool) -> None:
    for result in pool.run(_zero3_frees_full_parameters):
        assert all(size == 0 for size in result["sizes"])
        assert result["most_gathered"] < result["slots"]


def _placements_and_shards(strategy: str) -> dict:
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy)
    out: dict = {"placements": engine.placements()}
    if strategy != "replicate":
        shards = engine.sharded_parameters()
        out["full"] = {name: d.full() for name, d in shards.items()}
        out["local_rows"] = {name: d.local.shape[0] for name, d in shards.items()}
    out["state"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.mark.parametrize("strategy,sharded", [
    ("replicate", (False, False, False)), ("zero1", (False, False, True)),
    ("zero2", (False, True, True)), ("zero3", (True, True, True))])
def test_placements_say_what_each_strategy_shards(pool, strategy: str, sharded: tuple) -> None:
    r0, r1 = pool.run(_placements_and_shards, strategy)
    for part, is_sharded in zip(("params", "grads", "optimizer_state"), sharded, strict=True):
        want = dspark.Shard(0) if is_sharded else dspark.Replicate()
        assert set(r0["placements"][part].values()) == {want}, (part, r0["placements"][part])
    if strategy != "replicate":
        # the shards are real: rows split 4 + 3 for the 7-row layers, and gathering them back
        # gives the whole parameter
        assert r0["local_rows"]["layers.0.weight"] == 4 and r1["local_rows"]["layers.0.weight"] == 3
        for name, full in r0["full"].items():
            assert torch.equal(full.reshape(r0["state"][name].shape), r0["state"][name]), name
