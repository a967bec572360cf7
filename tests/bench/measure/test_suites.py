"""Suites as configuration lists, on machines described rather than detected."""

from __future__ import annotations

import pytest
import torch

from dspark.bench.measure.suites import Machine, SuiteOverrides, build_suite
from tests.messages import assert_line_names, assert_names

TWO_CORES = Machine(num_gpus=0, num_cpu_cores=2)
EIGHT_GPUS = Machine(num_gpus=8, num_cpu_cores=64)


def _shape(configs: list) -> list[tuple]:
    return [(c.workload, c.num_devices, c.batch_placement) for c in configs]


def test_quick_is_the_cpu_presets_on_one_and_two_devices_sharded() -> None:
    configs = build_suite("quick", machine=TWO_CORES)
    assert _shape(configs) == [("resnet50-cpu", 1, "shard"), ("resnet50-cpu", 2, "shard"),
                               ("gpt2-cpu", 1, "shard"), ("gpt2-cpu", 2, "shard")]
    assert {c.precision for c in configs} == {"bf16"}  # the presets' own precision
    assert [c.global_batch for c in configs] == [128, 128, 32, 32]


def test_seed_on_cpu_is_one_device_bug_and_fix_per_preset() -> None:
    configs = build_suite("seed", machine=TWO_CORES)
    assert _shape(configs) == [
        ("resnet50-cpu", 1, "shard"), ("resnet50-cpu", 2, "replicate"), ("resnet50-cpu", 2, "shard"),
        ("gpt2-cpu", 1, "shard"), ("gpt2-cpu", 2, "replicate"), ("gpt2-cpu", 2, "shard")]


def test_seed_on_gpus_is_the_articles_config() -> None:
    configs = build_suite("seed", machine=EIGHT_GPUS)
    assert {c.workload for c in configs} == {"resnet50", "gpt2-124m"}
    assert {(c.global_batch, c.precision) for c in configs} == {(256, "fp16")}
    assert {c.num_devices for c in configs} == {1, 2}


def test_full_covers_every_strategy_and_device_count_on_gpus() -> None:
    configs = build_suite("full", machine=EIGHT_GPUS)
    assert {c.num_devices for c in configs} == {1, 2, 4, 8}
    assert {c.strategy for c in configs} == {"replicate", "zero1", "zero2", "zero3"}
    assert len(configs) == 2 * 4 * 4


def test_full_skips_a_gpu_count_the_batch_does_not_split_over() -> None:
    configs = build_suite("full", machine=Machine(num_gpus=6, num_cpu_cores=32))
    assert {c.num_devices for c in configs} == {1, 2, 4}  # 256 / 6 is uneven


def test_full_without_gpus_says_what_to_run_instead() -> None:
    with pytest.raises(ValueError) as caught:
        build_suite("full", machine=TWO_CORES)
    assert_names(str(caught.value), "2 CUDA devices", "has 0", "--suite seed")


def test_overrides_replace_the_defaults() -> None:
    configs = build_suite("quick", SuiteOverrides(
        workloads=("gpt2-cpu",), devices=(2,), strategies=("zero1", "zero2"), precision="fp32",
        global_batch=8, warmup_steps=0, measure_steps=3), machine=TWO_CORES)
    assert [(c.workload, c.num_devices, c.strategy, c.precision, c.global_batch,
             c.warmup_steps, c.measure_steps) for c in configs] == [
        ("gpt2-cpu", 2, "zero1", "fp32", 8, 0, 3), ("gpt2-cpu", 2, "zero2", "fp32", 8, 0, 3)]


@pytest.mark.parametrize(("name", "overrides", "message"), [
    ("nope", SuiteOverrides(), r"suite='nope' is not one of quick, seed, peers, full"),
    ("quick", SuiteOverrides(workloads=("bert",)), r"unknown workload 'bert'; valid names: resnet50"),
    ("quick", SuiteOverrides(strategies=("zero4",)), r"unknown strategy 'zero4'; valid: replicate, zero1"),
    ("quick", SuiteOverrides(precision="fp8"), r"unknown precision 'fp8'; valid: fp32"),
    ("quick", SuiteOverrides(devices=(1, 3)), r"needs 3 devices, but this machine has 2 CPU core"),
    ("quick", SuiteOverrides(devices=(0,)), r"must be an int >= 1"),
    ("quick", SuiteOverrides(global_batch=5), r"global batch 5 of 'resnet50-cpu' does not split evenly over 2"),
])
def test_bad_choices_are_errors_listing_valid_ones(name: str, overrides: SuiteOverrides,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_suite(name, overrides, machine=TWO_CORES)


def test_more_devices_than_gpus_suggests_cpu_cores() -> None:
    with pytest.raises(ValueError, match=r"2 devices.*1 GPU.*CUDA_VISIBLE_DEVICES"):
        build_suite("quick", machine=Machine(num_gpus=1, num_cpu_cores=16))


def test_detect_sees_this_machine() -> None:
    machine = Machine.detect()
    assert machine.num_cpu_cores >= 1 and machine.num_devices >= 1


SLOW_BF16 = Machine(num_gpus=0, num_cpu_cores=2, cpu_matmul_ms=(("fp32", 1.9), ("bf16", 3.1), ("fp16", 1.7)))
FAST_BF16 = Machine(num_gpus=0, num_cpu_cores=2, cpu_matmul_ms=(("fp32", 2.8), ("bf16", 0.67), ("fp16", 103.0)))


@pytest.mark.parametrize("suite", ["quick", "peers"])
def test_quick_and_peers_run_fp32_on_a_cpu_that_runs_bf16_slower(suite: str, caplog) -> None:
    assert {c.precision for c in build_suite(suite, machine=SLOW_BF16)} == {"fp32"}
    assert_line_names(caplog.text, "resnet50-cpu, gpt2-cpu", "fp32", "bf16", "bf16 matmul 3.10 ms",
                      "fp32 1.90 ms")
    assert caplog.text.count("in fp32") == 1  # one line for the suite
    assert {c.precision for c in build_suite(suite, machine=FAST_BF16)} == {"bf16"}


def test_the_seed_suite_and_an_explicit_precision_ignore_the_cpus_speed() -> None:
    assert {c.precision for c in build_suite("seed", machine=SLOW_BF16)} == {"bf16"}
    configs = build_suite("quick", SuiteOverrides(precision="bf16"), machine=SLOW_BF16)
    assert {c.precision for c in configs} == {"bf16"}


def test_gpus_keep_the_presets_precision_whatever_the_cpu() -> None:
    machine = Machine(num_gpus=2, num_cpu_cores=2, cpu_matmul_ms=SLOW_BF16.cpu_matmul_ms)
    assert {c.precision for c in build_suite("quick", SuiteOverrides(workloads=("gpt2-cpu",)),
                                             machine=machine)} == {"bf16"}


def test_detect_times_fp32_and_bf16_matmuls_on_cpu_only_when_asked() -> None:
    timings = dict(Machine.detect().cpu_matmul_ms)
    if torch.cuda.is_available():
        assert timings == {}
    else:
        assert set(timings) == {"fp32", "bf16"} and all(ms > 0 for ms in timings.values())
    assert Machine.detect(time_matmuls=False).cpu_matmul_ms == ()
