"""A rank's share of a step in micro-batches (a workload's ``max_micro_batch``: GPT-2 124M's 256
sequences of 1024 tokens do not fit one GPU in one pass): how many passes, that every engine the
lab measures accumulates them into the step one pass would make, and what a result records."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

import dspark
from dspark.bench.measure.deepspeed_peer import deepspeed_config
from dspark.bench.measure.peers import PeerEngine
from dspark.bench.measure.worker import run_config
from dspark.bench.present.formatting import batch_label
from dspark.bench.result import BenchConfig
from dspark.models import get_workload
from tests.bench.factory import make_result
from tests.engine import tiny_models as tm
from tests.messages import assert_names

GLOBAL_BATCH = 8
SGD_LR = 0.2


@pytest.mark.parametrize("local,limit,passes", [
    (256, 32, 8), (128, 32, 4), (32, 32, 1), (31, 32, 1), (48, 32, 2), (50, 32, 2), (33, 32, 3),
    (37, 32, 37), (8, 2, 4), (1, 1, 1), (7, None, 1)])
def test_passes_are_the_fewest_equal_micro_batches_within_the_limit(local: int, limit: int | None,
                                                                     passes: int) -> None:
    workload = dataclasses.replace(get_workload("gpt2-cpu"), max_micro_batch=limit)
    assert workload.passes(local) == passes
    assert local % passes == 0 and (limit is None or local // passes <= limit)


def test_gpt2_124m_runs_the_seeds_batch_in_micro_batches_of_32() -> None:
    workload = get_workload("gpt2-124m")
    assert workload.max_micro_batch == 32
    assert [workload.passes(256 // n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert get_workload("resnet50").passes(256) == 1  # fits an H200 in one pass (11.1 GiB)


@pytest.mark.parametrize("bad", [0, -3, True])
def test_a_bad_micro_batch_limit_or_local_batch_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_micro_batch"):
        dataclasses.replace(get_workload("gpt2-cpu"), max_micro_batch=bad)
    with pytest.raises(ValueError, match="local_batch"):
        get_workload("gpt2-124m").passes(bad)


def _plain_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _one_process_on_the_whole_batch(steps: int) -> list[torch.Tensor]:
    model = _plain_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for step in range(steps):
        x, y = tm.batch("mlp", GLOBAL_BATCH, step)
        tm.loss_fn("mlp", model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _accumulated(strategy: str, passes: int, steps: int) -> dict[str, Any]:
    """Train ``strategy`` (DSpark's or a PyTorch peer, as the lab builds it) with each rank's share
    in ``passes`` micro-batches, SGD without momentum: a wrong factor on the gradient shows."""
    from dspark.bench.measure.peers import make_engine

    world = dspark.get_world()
    sgd = functools.partial(torch.optim.SGD, lr=SGD_LR)
    engine = make_engine(strategy, _plain_mlp(), world, lr=SGD_LR, precision="fp32",
                         grad_accum_steps=passes)
    if isinstance(engine, PeerEngine):
        engine.optimizer = sgd(engine.module.parameters())
    else:
        engine.close()
        engine = dspark.Engine(_plain_mlp(), optimizer=sgd, strategy=strategy,
                               grad_accum_steps=passes)
    for step in range(steps):
        x, y = dspark.distribute_batch(tm.batch("mlp", GLOBAL_BATCH, step), shard_dim=0)
        for xs, ys in zip(x.chunk(passes), y.chunk(passes), strict=True):
            engine.backward(tm.loss_fn("mlp", engine(xs), ys))
        engine.step()
    if isinstance(engine, PeerEngine):
        module = engine.module.module if strategy == "torch-ddp" else engine.module
        params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
        got = [p.detach().clone() for p in params]
    else:
        got = list(engine.full_state_dict().values())
    engine.close()
    return {"params": got, "want": _one_process_on_the_whole_batch(steps)}


@pytest.mark.parametrize("strategy", ["replicate", "zero2", "zero3", "torch-ddp", "torch-fsdp2"])
def test_every_engine_accumulates_micro_batches_into_the_one_pass_step(pool, strategy: str) -> None:
    for rank in pool.run(_accumulated, strategy, 2, 3):
        for got, want in zip(rank["params"], rank["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _ddp_all_reduces_once_per_step(passes: int) -> int:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    engine = PeerEngine("torch-ddp", _plain_mlp(), dspark.get_world(), lr=1e-2, precision="fp32",
                        grad_accum_steps=passes)
    calls = [0]

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        calls[0] += 1
        return allreduce_hook(state, bucket)

    engine.module.register_comm_hook(None, counting)  # type: ignore[operator]
    for step in range(3):
        x, y = dspark.distribute_batch(tm.batch("mlp", GLOBAL_BATCH, step), shard_dim=0)
        for xs, ys in zip(x.chunk(passes), y.chunk(passes), strict=True):
            engine.backward(tm.loss_fn("mlp", engine(xs), ys))
        engine.step()
    engine.close()
    return calls[0]


def test_ddp_synchronises_only_the_windows_last_micro_batch(pool) -> None:
    # as DDP's users accumulate: no_sync() around the other micro-batches' forwards
    assert pool.run(_ddp_all_reduces_once_per_step, 2) == pool.run(_ddp_all_reduces_once_per_step, 1)


def test_a_peer_refuses_more_backward_calls_than_its_window(single_process) -> None:
    # DDP and FSDP2 need a process group: the count check comes before any of their machinery
    engine = PeerEngine.__new__(PeerEngine)
    engine.name, engine.grad_accum_steps, engine._micro_step = "torch-ddp", 2, 2
    with pytest.raises(RuntimeError, match="grad_accum_steps=2"):
        engine.backward(torch.ones((), requires_grad=True))


def test_deepspeed_accumulates_in_its_own_configuration() -> None:
    config = deepspeed_config("deepspeed-zero2", global_batch=256, world_size=2, precision="fp32",
                              bucket_mb=25.0, grad_accum_steps=4)
    assert config["train_batch_size"] == 256
    assert config["train_micro_batch_size_per_gpu"] == 32
    assert config["gradient_accumulation_steps"] == 4
    with pytest.raises(ValueError, match="grad_accum_steps=3"):
        deepspeed_config("deepspeed-zero2", global_batch=256, world_size=2, precision="fp32",
                         bucket_mb=25.0, grad_accum_steps=3)


def test_a_launch_in_micro_batches_records_them(single_process) -> None:
    # gpt2-cpu with --micro-batch 2: the lab's own worker, one rank, in this process
    config = BenchConfig(workload="gpt2-cpu", num_devices=1, precision="fp32", global_batch=8,
                         warmup_steps=0, measure_steps=1, max_micro_batch=2)
    m = run_config(config)
    assert m.micro_batches == 4 and m.max_micro_batch == 2
    assert m.engine_options["grad_accum_steps"] == 4
    recorded = m.engine_options["engine_config"]  # the whole EngineConfig, next to the result
    assert dspark.EngineConfig.from_dict(recorded).grad_accum_steps == 4 and "observation" not in recorded
    assert m.batch is not None and m.batch["samples_by_rank"] == [8]  # every pass counted
    assert m.config == config  # a rerun measures the same thing


def test_a_workloads_own_limit_applies_without_the_option(single_process, monkeypatch) -> None:
    import dspark.models

    small = dataclasses.replace(get_workload("gpt2-cpu"), max_micro_batch=4)
    monkeypatch.setattr(dspark.models, "get_workload", lambda name: small)
    m = run_config(BenchConfig(workload="gpt2-cpu", num_devices=1, precision="fp32",
                               global_batch=8, warmup_steps=0, measure_steps=1))
    assert m.micro_batches == 2 and m.max_micro_batch is None
    assert m.engine_options["grad_accum_steps"] == 2


def test_the_option_reaches_every_configuration_of_a_suite() -> None:
    from dspark.bench.measure.suites import Machine, SuiteOverrides, build_suite

    configs = build_suite("quick", SuiteOverrides(max_micro_batch=8, precision="fp32"),
                          machine=Machine(num_gpus=0, num_cpu_cores=2))
    assert configs and {c.max_micro_batch for c in configs} == {8}


def test_the_cli_refuses_a_micro_batch_below_one(capsys) -> None:
    from dspark.cli.main import main

    assert main(["bench", "--micro-batch", "0"]) == 2
    assert "--micro-batch" in capsys.readouterr().err


def test_a_configuration_without_the_option_keeps_its_earlier_hash() -> None:
    import hashlib
    import json

    config = BenchConfig(workload="gpt2-cpu", num_devices=2, global_batch=32)
    earlier = {k: v for k, v in dataclasses.asdict(config).items() if k != "max_micro_batch"}
    assert config.config_hash() == hashlib.sha256(
        json.dumps(earlier, sort_keys=True).encode()).hexdigest()[:16]
    assert dataclasses.replace(config, max_micro_batch=4).config_hash() != config.config_hash()


def test_an_out_of_memory_step_names_the_option() -> None:
    from dspark.bench.measure.worker import out_of_memory_hint

    config = BenchConfig(workload="gpt2-124m", num_devices=2, global_batch=256)
    hint = out_of_memory_hint(torch.cuda.OutOfMemoryError("CUDA out of memory"), config)
    assert_names(hint, "at most 32 samples", "--micro-batch N")
    resnet = BenchConfig(workload="resnet50", num_devices=1, global_batch=256, max_micro_batch=64)
    assert "at most 64 samples" in out_of_memory_hint(torch.cuda.OutOfMemoryError("x"), resnet)
    assert out_of_memory_hint(ValueError("x"), config) == ""


def test_the_batch_column_shows_the_micro_batches() -> None:
    assert batch_label(make_result(global_batch=256, num_devices=2, micro_batches=4)) == \
        "shard 256 (4 x 32)"
    assert batch_label(make_result(global_batch=256, num_devices=2)) == "shard 256"
