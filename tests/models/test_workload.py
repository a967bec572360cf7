from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dspark.models import WORKLOADS, Workload, count_params, get_workload
from tests.messages import assert_names

PRESETS = ("resnet50-cpu", "gpt2-cpu")


def test_registered_names() -> None:
    assert set(WORKLOADS) == {"resnet50", "gpt2-124m", "resnet50-cpu", "gpt2-cpu"}
    assert all(get_workload(name).name == name for name in WORKLOADS)


def test_unknown_name_is_a_value_error_listing_the_valid_names() -> None:
    with pytest.raises(ValueError) as caught:
        get_workload("resnet-50")
    assert_names(str(caught.value), "'resnet-50'", "resnet50, gpt2-124m")


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        WORKLOADS["mine"] = WORKLOADS["gpt2-cpu"]  # type: ignore[index]


def test_workloads_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_workload("gpt2-cpu").default_global_batch = 8  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_default_batch_splits_over_2_and_4_ranks(name: str) -> None:
    wl = get_workload(name)
    assert wl.default_global_batch % 2 == 0 and wl.default_global_batch % 4 == 0
    assert wl.default_precision in ("fp32", "fp16", "bf16") and wl.description


def test_real_sizes_carry_the_seed_config() -> None:
    for name, params in (("resnet50", 25_557_032), ("gpt2-124m", 124_439_808)):
        wl = get_workload(name)
        assert (wl.default_global_batch, wl.default_precision) == (256, "fp16")
        assert wl.num_params(wl.build_model(device="meta")) == params


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_small_and_never_fp16(name: str) -> None:
    wl = get_workload(name)
    # fp16 has no fast CPU kernels; a few million parameters keep the all-reduce small.
    assert wl.default_precision in ("fp32", "bf16")
    assert 500_000 < wl.num_params(wl.build_model(device="meta")) < 5_000_000


def test_presets_reuse_the_real_architectures() -> None:
    assert type(get_workload("resnet50-cpu").build_model(device="meta")) is type(
        get_workload("resnet50").build_model(device="meta"))
    assert type(get_workload("gpt2-cpu").build_model(device="meta")) is type(
        get_workload("gpt2-124m").build_model(device="meta"))


@pytest.mark.parametrize(("name", "inputs_shape", "output_shape"), [
    ("resnet50-cpu", (4, 3, 96, 96), (4, 100)),
    ("gpt2-cpu", (4, 128), (4, 128, 2048)),
])
def test_preset_batch_and_output_shapes(name: str, inputs_shape: tuple[int, ...],
                                        output_shape: tuple[int, ...]) -> None:
    wl = get_workload(name)
    inputs, targets = wl.make_batch(4, seed=0)
    assert inputs.shape == inputs_shape and targets.dtype == torch.int64
    with torch.no_grad():
        output = wl.build_model(seed=0)(inputs)
    assert output.shape == output_shape
    assert wl.loss(output, targets).shape == ()


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", PRESETS)
def test_init_is_deterministic_from_the_seed(name: str) -> None:
    wl = get_workload(name)
    a, b, c = (_state(wl.build_model(seed=s)) for s in (1, 1, 2))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_building_a_model_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    get_workload("gpt2-cpu").build_model(seed=5)
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize("name", PRESETS)
def test_batches_are_deterministic_from_the_seed(name: str) -> None:
    wl = get_workload(name)
    a, b, c = (wl.make_batch(4, seed=s) for s in (0, 0, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_seed_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="seed='0'"):
        get_workload("gpt2-cpu").build_model(seed="0")  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "batch", "steps", "lr"), [
    ("resnet50-cpu", 8, 6, 1e-3),
    ("gpt2-cpu", 4, 6, 1e-3),
])
def test_loss_is_finite_and_decreases_under_adamw(name: str, batch: int, steps: int,
                                                  lr: float) -> None:
    wl = get_workload(name)
    model = wl.build_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    inputs, targets = wl.make_batch(batch, seed=0)
    losses = []
    for _ in range(steps):
        loss = wl.loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_gpt_loss_starts_near_uniform() -> None:
    # GPT-2's small init predicts nearly uniformly: the first loss is about ln(vocab).
    wl = get_workload("gpt2-cpu")
    inputs, targets = wl.make_batch(2, seed=0)
    with torch.no_grad():
        loss = wl.loss(wl.build_model(seed=0)(inputs), targets).item()
    assert abs(loss - math.log(2048)) < 0.3


def test_bf16_autocast_forward_gives_an_fp32_loss() -> None:
    wl = get_workload("gpt2-cpu")
    inputs, targets = wl.make_batch(2, seed=0)
    model = wl.build_model(seed=0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(inputs)
    assert output.dtype == torch.bfloat16
    assert wl.loss(output, targets).dtype == torch.float32


def test_workload_validates_its_defaults() -> None:
    wl = get_workload("gpt2-cpu")
    with pytest.raises(ValueError, match="default_precision='fp8'"):
        dataclasses.replace(wl, default_precision="fp8")
    with pytest.raises(ValueError, match="default_global_batch=6"):
        dataclasses.replace(wl, default_global_batch=6)
    with pytest.raises(ValueError, match="seq_len=129"):
        dataclasses.replace(wl, seq_len=129)


def test_count_params_counts_a_shared_tensor_once() -> None:
    shared = torch.nn.Linear(3, 3)
    assert count_params(torch.nn.Sequential(shared, shared)) == 12
    assert Workload.num_params(shared) == 12
