from __future__ import annotations

import re

import pytest
import torch

from dspark.models import ResNet, ResNetConfig, count_params


def _meta_resnet(config: ResNetConfig) -> ResNet:
    with torch.device("meta"):
        return ResNet(config)


def test_resnet50_has_exactly_the_standard_parameter_count() -> None:
    assert count_params(_meta_resnet(ResNetConfig())) == 25_557_032


def test_depth_is_a_parameter_resnet101_count() -> None:
    # Same code, another standard depth: ResNet-101 has 44,549,160 parameters.
    assert count_params(_meta_resnet(ResNetConfig(blocks_per_stage=(3, 4, 23, 3)))) == 44_549_160


def test_resnet50_output_shape_on_meta() -> None:
    logits = _meta_resnet(ResNetConfig())(torch.empty(2, 3, 224, 224, device="meta"))
    assert logits.shape == (2, 1000)


def test_narrow_resnet_forward_shape_and_blocks() -> None:
    model = ResNet(ResNetConfig(base_width=8, blocks_per_stage=(1, 2), num_classes=7))
    assert [len(stage) for stage in model.stages] == [1, 2]  # type: ignore[arg-type]
    assert model(torch.randn(3, 3, 32, 32)).shape == (3, 7)


def test_residual_branches_start_at_zero() -> None:
    # Each block's last BN scale starts at 0, so a fresh block is the identity plus ReLU.
    model = ResNet(ResNetConfig(base_width=8, blocks_per_stage=(1,), num_classes=3))
    block = model.stages[0][0]  # type: ignore[index]
    assert torch.count_nonzero(block.bn3.weight) == 0


@pytest.mark.parametrize("kwargs", [
    {"base_width": 0}, {"blocks_per_stage": ()}, {"blocks_per_stage": (3, 0)},
    {"num_classes": 0}, {"expansion": 0},
])
def test_bad_config_is_a_value_error_echoing_the_value(kwargs: dict[str, object]) -> None:
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r}")):
        ResNetConfig(**kwargs)  # type: ignore[arg-type]
