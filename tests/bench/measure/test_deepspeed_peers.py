"""DeepSpeed's ZeRO stages as optional peers: the configuration they are measured with, the suite
with and without DeepSpeed importable, and the error that names `make peers`. None of these needs
DeepSpeed (the import check is replaced); the end-to-end runs are in test_deepspeed_peers_e2e.py."""

from __future__ import annotations

import logging
import subprocess
from typing import Any

import pytest
import torch

import dspark
from dspark.bench.measure import deepspeed_peer
from dspark.bench.measure.deepspeed_peer import (
    DEEPSPEED_PEERS,
    DeepSpeedPeer,
    deepspeed_config,
    deepspeed_missing,
    dspark_bucket_mb,
)
from dspark.bench.measure.peers import buffer_sync, make_engine
from dspark.bench.measure.suites import Machine, SuiteOverrides, build_suite

_TWO_CORES = Machine(num_gpus=0, num_cpu_cores=2)


def _importable(monkeypatch: pytest.MonkeyPatch, missing: str | None) -> None:
    monkeypatch.setattr(deepspeed_peer, "deepspeed_missing", lambda: missing)


@pytest.mark.parametrize("name", sorted(DEEPSPEED_PEERS))
def test_the_config_matches_what_dspark_runs(name: str) -> None:
    config = deepspeed_config(name, global_batch=16, world_size=2, precision="fp32",
                              bucket_mb=dspark_bucket_mb())
    zero = config["zero_optimization"]
    assert zero["stage"] == int(name[-1])
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (16, 8, 1)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed would clip at 1.0; DSpark does not clip
    # DSpark's engine default, 25 MiB of fp32 gradients, in the elements DeepSpeed counts
    assert dspark_bucket_mb() == dspark_bucket_mb(dspark.Engine) == 25.0
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 25 * 2**20 // 4
    assert zero["overlap_comm"] is (name == "deepspeed-zero3")  # DeepSpeed's own default per stage
    assert zero.get("compute_grad_norm", True) is (name == "deepspeed-zero3")
    assert "torch_autocast" not in config and "bf16" not in config


def test_bf16_is_autocast_over_fp32_weights_and_fp16_is_refused() -> None:
    config = deepspeed_config("deepspeed-zero2", global_batch=4, world_size=2, precision="bf16",
                              bucket_mb=1.0)
    assert config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "bf16" not in config  # DeepSpeed's bf16 weights would be another trade
    assert config["zero_optimization"]["reduce_bucket_size"] == 2**18
    with pytest.raises(ValueError, match="loss scaler"):
        deepspeed_config("deepspeed-zero2", global_batch=4, world_size=2, precision="fp16",
                         bucket_mb=1.0)
    with pytest.raises(ValueError, match="split evenly"):
        deepspeed_config("deepspeed-zero1", global_batch=5, world_size=2, precision="fp32",
                         bucket_mb=1.0)
    with pytest.raises(ValueError, match="not one of"):
        deepspeed_config("deepspeed-zero4", global_batch=4, world_size=2, precision="fp32",
                         bucket_mb=1.0)


def test_peers_suite_adds_the_deepspeed_stages_when_deepspeed_imports(monkeypatch) -> None:
    _importable(monkeypatch, None)
    configs = build_suite("peers", machine=_TWO_CORES)
    strategies = list(dict.fromkeys(c.strategy for c in configs))
    assert strategies == ["replicate", "torch-ddp", "zero1", "deepspeed-zero1", "zero2",
                          "deepspeed-zero2", "zero3", "torch-fsdp2", "deepspeed-zero3"]
    assert {c.num_devices for c in configs if c.strategy in DEEPSPEED_PEERS} == {1, 2}


def test_peers_suite_without_deepspeed_skips_them_in_one_line(monkeypatch, caplog) -> None:
    _importable(monkeypatch, "DeepSpeed is not installed")
    with caplog.at_level(logging.WARNING, logger="dspark.bench.measure.suites"):
        configs = build_suite("peers", machine=_TWO_CORES)
    assert {c.strategy for c in configs} == {"replicate", "torch-ddp", "zero3", "torch-fsdp2"}
    lines = [r.getMessage() for r in caplog.records if "DeepSpeed" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "deepspeed-zero2" in lines[0] and "not installed" in lines[0]
    assert "make peers" in lines[0]


def test_chosen_strategies_skip_the_check_and_say_nothing(monkeypatch, caplog) -> None:
    def fail() -> str:
        raise AssertionError("no DeepSpeed peer was asked for: nothing to check")

    monkeypatch.setattr(deepspeed_peer, "deepspeed_missing", fail)
    with caplog.at_level(logging.WARNING):
        configs = build_suite("peers", SuiteOverrides(strategies=("zero2", "torch-ddp")),
                              machine=_TWO_CORES)
    assert {c.strategy for c in configs} == {"zero2", "torch-ddp"}
    assert not caplog.records


def test_an_explicit_deepspeed_peer_without_deepspeed_names_make_peers(monkeypatch) -> None:
    _importable(monkeypatch, "DeepSpeed is not installed")
    with pytest.raises(ValueError, match=r"deepspeed-zero2.*DeepSpeed.*make peers"):
        build_suite("quick", SuiteOverrides(strategies=("zero2", "deepspeed-zero2")),
                    machine=_TWO_CORES)
    _importable(monkeypatch, None)
    configs = build_suite("quick", SuiteOverrides(strategies=("deepspeed-zero2",)),
                          machine=_TWO_CORES)
    assert {c.strategy for c in configs} == {"deepspeed-zero2"}


def test_the_import_check_says_why_deepspeed_does_not_import(monkeypatch) -> None:
    import importlib.util

    def check() -> str | None:
        deepspeed_missing.cache_clear()
        try:
            return deepspeed_missing()
        finally:
            deepspeed_missing.cache_clear()

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert check() == "DeepSpeed is not installed"

    seen: dict[str, Any] = {}

    def broken(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.update(kwargs)
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nModuleNotFoundError: "
                                                       "No module named 'hjson'\n")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(subprocess, "run", broken)
    assert check() == "`import deepspeed` failed: ModuleNotFoundError: No module named 'hjson'"
    if not torch.cuda.is_available():  # DeepSpeed must not look for CUDA in the check either
        assert seen["env"]["DS_ACCELERATOR"] == "cpu"


def test_a_deepspeed_peer_keeps_its_own_buffer_policy_and_needs_the_batch(single_process) -> None:
    assert buffer_sync("deepspeed-zero2").startswith("none (DeepSpeed")
    with pytest.raises(ValueError, match="global_batch"):
        make_engine("deepspeed-zero1", _linear(), single_process, lr=0.1, precision="fp32")
    # the single-process stand-in has no process group for DeepSpeed to run on
    with pytest.raises(RuntimeError, match="process group"):
        DeepSpeedPeer("deepspeed-zero1", _linear(), single_process, lr=0.1, precision="fp32",
                      global_batch=2)


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)
