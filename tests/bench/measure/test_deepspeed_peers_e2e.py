"""DeepSpeed's ZeRO stages on two real gloo ranks, where DeepSpeed is installed (`make peers`):
each reaches the parameters DSpark's same stage reaches from the same model, batches and AdamW, and
the worker measures a DeepSpeed peer, recording its configuration and optimizer kernel.

The ranks are a pool of their own, closed after this module: DeepSpeed's import and set-up stay out
of the session's shared pool."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import dspark
from dspark.bench.measure.deepspeed_peer import DEEPSPEED_PEERS, DeepSpeedPeer
from dspark.policy.optimizer_kernel import kernel_name

pytestmark = [
    pytest.mark.slow,
    # Not importorskip: importing DeepSpeed here would set it up in the test process. An install
    # that is present but broken fails below instead of being skipped.
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="DeepSpeed is not installed (make peers)"),
]

_GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def ds_pool() -> Iterator[Any]:
    from tests.rank_pool import RankPool

    pool = RankPool()
    yield pool
    pool.close()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # the first weight (120k elements) is above ZeRO-3's persistence threshold, so it is sharded
    return torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Tanh(), torch.nn.Linear(400, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    whole = (torch.randn(_GLOBAL_BATCH, 300, generator=g),
             torch.randint(0, 3, (_GLOBAL_BATCH,), generator=g))
    x, y = dspark.distribute_batch(whole, shard_dim=0)
    return x, y


def _train_both(name: str, passes: int = 1, scale_sensitive: bool = False) -> dict[str, Any]:
    """DSpark's stage and DeepSpeed's on the same batches, each rank's share in ``passes``
    micro-batches (the lab's accumulation: DeepSpeed's step() after every one). AdamW; with
    ``scale_sensitive`` its eps is 1.0, far above sqrt(v) for these gradients, so that its update
    is about lr * m, as SGD's, and a wrong factor on the gradient shows (DeepSpeed's ZeRO refuses
    a client SGD unless told to allow untested optimizers)."""
    import deepspeed

    world = dspark.get_world()
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1.0 if scale_sensitive else 1e-8)
    ours = dspark.Engine(_model(), optimizer=factory, strategy=DEEPSPEED_PEERS[name],
                         grad_accum_steps=passes)
    peer = DeepSpeedPeer(name, _model(), world, lr=1e-2, precision="fp32",
                         global_batch=_GLOBAL_BATCH, optimizer=factory, grad_accum_steps=passes)
    for step in range(3):
        x, y = _batch(step)
        for engine in (ours, peer):
            for xs, ys in zip(x.chunk(passes), y.chunk(passes), strict=True):
                engine.backward(torch.nn.functional.cross_entropy(engine(xs), ys))
            engine.step()
    mine = ours.full_state_dict()
    params = list(peer.module.parameters())
    sharded = [p for p in params if getattr(p, "ds_tensor", None) is not None
               and p.numel() == 0]
    with deepspeed.zero.GatheredParameters(params, enabled=bool(sharded)):
        theirs = {k: v.detach().clone() for k, v in peer.module.state_dict().items()}
    out = {"dspark": mine, "deepspeed": theirs, "sharded": len(sharded),
           "kernel": kernel_name(peer.optimizer), "options": peer.options,
           "estimate": peer.estimated_traffic_per_step()}
    ours.close()
    peer.close()
    return out


@pytest.mark.parametrize("name", sorted(DEEPSPEED_PEERS))
def test_deepspeed_reaches_the_parameters_dspark_reaches(ds_pool, name: str) -> None:
    initial = _model().state_dict()
    for rank in ds_pool.run(_train_both, name):
        assert rank["dspark"].keys() == rank["deepspeed"].keys() == initial.keys()
        for key, ours in rank["dspark"].items():
            torch.testing.assert_close(rank["deepspeed"][key], ours, rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(rank["dspark"]["0.weight"], initial["0.weight"])  # training moved it
        assert rank["sharded"] == (1 if name == "deepspeed-zero3" else 0)
        assert rank["kernel"] == "fused"  # the rule DSpark's engine applies to its own AdamW
        assert rank["options"]["deepspeed_config"]["zero_optimization"]["stage"] == int(name[-1])
        payload, wire = rank["estimate"]
        assert payload > 0 and wire > 0


@pytest.mark.parametrize("name", ["deepspeed-zero1", "deepspeed-zero2"])
def test_deepspeed_accumulating_micro_batches_reaches_what_dspark_reaches(ds_pool,
                                                                          name: str) -> None:
    for rank in ds_pool.run(_train_both, name, 2, True):
        assert rank["options"]["deepspeed_config"]["gradient_accumulation_steps"] == 2
        assert rank["options"]["deepspeed_config"]["train_micro_batch_size_per_gpu"] == 2
        for key, ours in rank["dspark"].items():
            torch.testing.assert_close(rank["deepspeed"][key], ours, rtol=1e-5, atol=1e-6, msg=key)


def _measure() -> dict[str, Any]:
    from dspark.bench.measure.worker import run_config
    from dspark.bench.result import BenchConfig

    config = BenchConfig(workload="gpt2-cpu", num_devices=2, strategy="deepspeed-zero2",
                         precision="bf16", global_batch=2, warmup_steps=0, measure_steps=1)
    return run_config(config, probe=True).to_dict()


def test_the_worker_measures_a_deepspeed_peer_and_records_how(ds_pool) -> None:
    first, _ = ds_pool.run(_measure)
    assert len(first["step_ms_by_rank"]) == 2 and all(len(s) == 1 for s in first["step_ms_by_rank"])
    assert first["optimizer_kernel"] == "fused"
    config = first["engine_options"]["deepspeed_config"]
    assert config["zero_optimization"]["stage"] == 2
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert config["train_micro_batch_size_per_gpu"] == 1
    assert first["engine_options"]["deepspeed_version"]
    # DeepSpeed's collectives bypass DSpark's counters: estimated, never "measured"
    assert first["comm_bytes_per_step"] is None and first["estimated_comm_bytes_per_step"] > 0
    assert first["buffer_sync"].startswith("none (DeepSpeed")
    assert first["batch"]["samples_by_rank"] == [1, 1]
    held = first["state_held_by_rank"][0]
    assert held["optimizer"] > 0 and held["params"] > 0
