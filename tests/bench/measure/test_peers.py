"""PyTorch's DDP and FSDP2 under the worker's surface: parity with DSpark, buffer policy, traffic
marked as estimated."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import dspark
from dspark.bench.measure.peers import (
    DEEPSPEED_PEERS,
    PEERS,
    PeerEngine,
    buffer_sync,
    buffers_broadcast,
    dspark_engine_options,
)
from dspark.bench.measure.suites import Machine, build_suite
from tests.engine import tiny_models as tm
from tests.messages import assert_names


def _plain_mlp() -> torch.nn.Module:
    # DDP needs find_unused_parameters for a parameter without gradient and FSDP2 refuses 0-d
    # parameters; DSpark's engine handles both, the peers get a model without either.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _replicate_vs_ddp(optimizer: str) -> dict[str, Any]:
    world = dspark.get_world()
    factory = (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9) if optimizer == "sgd"
               else functools.partial(torch.optim.AdamW, lr=1e-2))
    ours = dspark.Engine(_plain_mlp(), optimizer=factory, strategy="replicate")
    ddp = PeerEngine("torch-ddp", _plain_mlp(), world, lr=1e-2, precision="fp32")
    ddp.optimizer = factory(ddp.module.parameters())
    for step in range(3):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        for engine in (ours, ddp):
            engine.backward(tm.loss_fn("mlp", engine(x), y))
            engine.step()
    mine = [p.detach().clone() for p in ours.module.parameters()]
    theirs = [p.detach().clone() for p in ddp.module.module.parameters()]
    ours.close()
    ddp.close()
    return {"dspark": mine, "ddp": theirs}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_dspark_replicate_reaches_the_parameters_ddp_reaches(pool, optimizer: str) -> None:
    for rank in pool.run(_replicate_vs_ddp, optimizer):
        assert len(rank["dspark"]) == len(rank["ddp"]) == 4
        for ours, theirs in zip(rank["dspark"], rank["ddp"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        # not trivially equal: training moved the weights away from their initial values
        assert not torch.equal(rank["dspark"][0], next(_plain_mlp().parameters()).detach())


def _ddp_bytes_counted_by_a_comm_hook() -> dict[str, int]:
    world = dspark.get_world()
    engine = PeerEngine("torch-ddp", _plain_mlp(), world, lr=1e-2, precision="fp32")
    counted = {"bytes": 0}

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # Unannotated on purpose: DDP checks the hook's annotations against the real classes, and
    # this module's annotations are strings.
    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        counted["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return allreduce_hook(state, bucket)

    engine.module.register_comm_hook(None, counting_allreduce)  # type: ignore[operator]
    steps = 3
    for step in range(steps):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    payload, _ = engine.estimated_traffic_per_step()
    engine.close()
    return {"counted_per_step": counted["bytes"] // steps, "estimated": payload}


def test_the_ddp_estimate_matches_what_ddp_all_reduced(pool) -> None:
    for rank in pool.run(_ddp_bytes_counted_by_a_comm_hook):
        assert rank["estimated"] == rank["counted_per_step"] > 0


class _EngineWithOptions:
    def __init__(self, model: object, *, batch_check_every: int | None = 1,
                 broadcast_buffers: bool = False) -> None: ...


class _EngineWithout:
    def __init__(self, model: object, *, strategy: str = "replicate") -> None: ...


def test_engine_options_are_passed_only_when_the_engine_takes_them() -> None:
    assert dspark_engine_options(batch_placement="replicate", engine_cls=_EngineWithOptions) == {
        "batch_check_every": None, "broadcast_buffers": True}
    assert dspark_engine_options(batch_placement="shard", engine_cls=_EngineWithOptions) == {
        "broadcast_buffers": True}
    assert dspark_engine_options(batch_placement="replicate", engine_cls=_EngineWithout) == {}


def test_ddp_and_dspark_share_one_buffer_policy() -> None:
    assert buffers_broadcast(_EngineWithOptions) and not buffers_broadcast(_EngineWithout)
    for engine_cls in (_EngineWithOptions, _EngineWithout):
        assert buffer_sync("torch-ddp", engine_cls) == buffer_sync("replicate", engine_cls)
    assert buffer_sync("torch-ddp", _EngineWithOptions).startswith("broadcast from rank 0")
    assert buffer_sync("torch-fsdp2").startswith("none (FSDP2")


def _ddp_buffer_flag() -> bool:
    world = dspark.get_world()
    engine = PeerEngine("torch-ddp", torch.nn.BatchNorm1d(3), world, lr=0.1, precision="fp32")
    flag = engine.module.broadcast_buffers  # type: ignore[union-attr]
    engine.close()
    return bool(flag)


def test_the_ddp_peer_is_built_with_dspark_buffer_policy(pool) -> None:
    assert pool.run(_ddp_buffer_flag) == [buffers_broadcast()] * 2


def test_peers_suite_pairs_each_strategy_with_its_pytorch_tool(monkeypatch) -> None:
    from dspark.bench.measure import deepspeed_peer

    monkeypatch.setattr(deepspeed_peer, "deepspeed_missing", lambda: "DeepSpeed is not installed")
    configs = build_suite("peers", machine=Machine(num_gpus=0, num_cpu_cores=2))
    assert {c.strategy for c in configs} == {"replicate", "torch-ddp", "zero3", "torch-fsdp2"}
    assert {c.num_devices for c in configs} == {1, 2}
    assert set(PEERS) == {"torch-ddp", "torch-fsdp2", *DEEPSPEED_PEERS}


def test_fp16_fsdp2_is_refused_with_the_reason(single_process) -> None:
    with pytest.raises(ValueError) as caught:
        PeerEngine("torch-fsdp2", torch.nn.Linear(2, 2), single_process, lr=0.1, precision="fp16")
    assert_names(str(caught.value), "GradScaler", "FSDP2")


def _replicate_vs_ddp_in_fp16(poison_step: int | None) -> dict[str, Any]:
    """DSpark's fp16 (its LossScaler) beside DDP's (PyTorch's GradScaler, as the lab builds the
    peer), SGD without momentum; at ``poison_step`` rank 1's loss is inf: both skip that step."""
    world = dspark.get_world()
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    ours = dspark.Engine(_plain_mlp(), optimizer=sgd, strategy="replicate", precision="fp16")
    ddp = PeerEngine("torch-ddp", _plain_mlp(), world, lr=0.1, precision="fp16")
    ddp.optimizer = sgd(ddp.module.parameters())
    applied: dict[str, list[bool]] = {"dspark": [], "ddp": []}
    for step in range(4):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        for name, engine in (("dspark", ours), ("ddp", ddp)):
            loss = tm.loss_fn("mlp", engine(x), y)
            if step == poison_step and world.rank == 1:
                loss = loss * float("inf")
            engine.backward(loss)
            applied[name].append(engine.step())
    mine = [p.detach().clone() for p in ours.module.parameters()]
    theirs = [p.detach().clone() for p in ddp.module.module.parameters()]
    scales = (ours.loss_scale, ddp._scaler.get_scale() if ddp._scaler is not None else None)
    ours.close()
    ddp.close()
    return {"dspark": mine, "ddp": theirs, "applied": applied, "scales": scales}


@pytest.mark.parametrize("poison_step", [None, 1])
def test_ddp_in_fp16_runs_pytorchs_amp_recipe_beside_dspark(pool, poison_step: int | None) -> None:
    for rank in pool.run(_replicate_vs_ddp_in_fp16, poison_step):
        for ours, theirs in zip(rank["dspark"], rank["ddp"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=1e-4)
        assert rank["applied"]["dspark"] == [step != poison_step for step in range(4)]
        # DDP's skip shows in its parameters (equal to DSpark's above, not NaN) and its scale,
        # backed off alike; its step() reads nothing back, as a DDP user's loop does not
        assert rank["scales"][0] == rank["scales"][1]
        assert rank["scales"][1] == 2.0**16 / (2 if poison_step is not None else 1)
