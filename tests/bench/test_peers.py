"""PyTorch's DDP and FSDP2 run under the same worker surface and report comparable figures."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.bench.peers import PEERS, PeerEngine
from dspark.bench.suites import Machine, build_suite
from tests.engine import tiny_models as tm


def _plain_mlp() -> torch.nn.Module:
    # DDP needs find_unused_parameters for a parameter without gradient and FSDP2 refuses 0-d
    # parameters; DSpark's engine handles both, the peers get a model without either.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train_peer(name: str) -> dict:
    world = dspark.get_world()
    engine = PeerEngine(name, _plain_mlp(), world, lr=1e-2, precision="fp32")
    for step in range(2):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=0)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    report = engine.memory_report()
    traffic = engine.estimated_traffic_per_step()
    engine.close()
    return {"report": report, "traffic": traffic}


@pytest.mark.parametrize("name", sorted(PEERS))
def test_peer_reports_state_like_its_dspark_counterpart(pool, name: str) -> None:
    for result in pool.run(_train_peer, name):
        report = result["report"]
        assert report["params_bytes"] == report["params_bytes_expected"], report
        assert report["optimizer_bytes"] > 0
        params = sum(p.numel() for p in _plain_mlp().parameters()) * 4
        payload, wire = result["traffic"]
        assert payload >= params and wire > 0


def test_peers_suite_pairs_each_strategy_with_its_pytorch_tool() -> None:
    configs = build_suite("peers", machine=Machine(num_gpus=0, num_cpu_cores=2))
    assert {c.strategy for c in configs} == {"replicate", "torch-ddp", "zero3", "torch-fsdp2"}
    assert {c.num_devices for c in configs} == {1, 2}


def test_fp16_peer_is_refused_with_the_reason(single_process) -> None:
    with pytest.raises(ValueError, match="GradScaler"):
        PeerEngine("torch-ddp", torch.nn.Linear(2, 2), single_process, lr=0.1, precision="fp16")
