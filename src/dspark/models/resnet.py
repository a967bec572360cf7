"""ResNet with bottleneck blocks (the ResNet-50 family), parametrised so a CPU preset reuses it.

The layout is the standard "v1.5" one: a 7x7/2 stem and a 3x3/2 max-pool, four stages of
bottleneck blocks (1x1 reduce, 3x3, 1x1 expand by ``expansion``) whose first block strides by 2
in its 3x3 convolution (stages 2-4), batch norm after every convolution, a projection shortcut
(1x1 conv + BN) wherever the shape changes, global average pooling and one linear classifier.
Convolutions have no bias (the BN that follows makes it redundant); the classifier has one.

With the defaults (width 64, blocks (3, 4, 6, 3), 1000 classes) it has exactly 25,557,032
parameters. The network is size-agnostic (adaptive pooling), so image size is a workload choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet", "ResNetConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ResNetConfig:
    """Shape of a bottleneck ResNet."""

    base_width: int = 64
    """Channels of the stem and of the first stage's inner convolutions; stage i uses base_width * 2**i."""
    blocks_per_stage: tuple[int, ...] = (3, 4, 6, 3)
    """Bottleneck blocks in each stage; (3, 4, 6, 3) is ResNet-50, (3, 4, 23, 3) ResNet-101."""
    expansion: int = 4
    """Output channels of a block / its inner width."""
    num_classes: int = 1000
    """Classifier outputs."""
    in_channels: int = 3
    """Image channels."""

    def __post_init__(self) -> None:
        if self.base_width < 1:
            raise ValueError(f"base_width={self.base_width!r} must be >= 1")
        if not self.blocks_per_stage or any(n < 1 for n in self.blocks_per_stage):
            raise ValueError(f"blocks_per_stage={self.blocks_per_stage!r} must be a non-empty "
                             "tuple of counts >= 1, e.g. (3, 4, 6, 3)")
        if self.expansion < 1 or self.num_classes < 1 or self.in_channels < 1:
            raise ValueError(f"expansion={self.expansion!r}, num_classes={self.num_classes!r} and "
                             f"in_channels={self.in_channels!r} must all be >= 1")


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus a shortcut, then ReLU."""

    def __init__(self, in_channels: int, width: int, *, stride: int, expansion: int) -> None:
        super().__init__()
        out_channels = width * expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Bottleneck ResNet: ``images (B, C, H, W) float -> logits (B, num_classes)``.

    Example::

        model = ResNet(ResNetConfig())                      # ResNet-50, 25,557,032 parameters
        logits = model(torch.randn(2, 3, 224, 224))         # (2, 1000)
    """

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        width = config.base_width
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_channels = width
        for i, num_blocks in enumerate(config.blocks_per_stage):
            stage_width = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(num_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(Bottleneck(in_channels, stage_width, stride=stride,
                                         expansion=config.expansion))
                in_channels = stage_width * config.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        # Each residual branch starts as zero (its last BN scale is 0), so every block begins as
        # the identity: deep nets train stably from the first step, which short benchmarks need.
        for module in self.modules():
            if isinstance(module, Bottleneck):
                nn.init.zeros_(module.bn3.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)                 # (B, w, H/4, W/4)
        x = self.stages(x)                    # (B, w*2**(S-1)*expansion, H/2**(S+1), W/2**(S+1))
        x = torch.flatten(self.pool(x), 1)    # (B, features)
        return self.fc(x)                     # (B, num_classes)
