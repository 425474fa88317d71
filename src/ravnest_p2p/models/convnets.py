"""Small convolutional models: a CNN for 8x8 digits and a tiny ResNet with BatchNorm.

Residual connections stay inside a block so that every cut point carries a single tensor.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

__all__ = ["BasicBlock", "DigitsCNNConfig", "ResNetSmallConfig", "build_digits_cnn", "build_resnet_small"]


class DigitsCNNConfig(BaseModel):
    """Config of `digits_cnn`: inputs ``(N, 1, 8, 8)``, ``num_classes`` logits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    channels: tuple[int, int] = (16, 32)
    hidden_features: int = Field(default=64, ge=1)
    num_classes: int = Field(default=10, ge=2)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)


def build_digits_cnn(config: DigitsCNNConfig) -> list[nn.Module]:
    """Build ``[conv, conv+pool, flatten+fc, fc]`` (8x8 -> 4x4 after one pooling)."""
    c1, c2 = config.channels
    if c1 < 1 or c2 < 1:
        raise ValueError(f"digits_cnn channels must be positive, got {config.channels}")
    fc_parts: list[nn.Module] = [nn.Flatten(), nn.Linear(c2 * 4 * 4, config.hidden_features), nn.ReLU()]
    if config.dropout > 0:
        fc_parts.append(nn.Dropout(config.dropout))
    return [
        nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(*fc_parts),
        nn.Linear(config.hidden_features, config.num_classes),
    ]


class ResNetSmallConfig(BaseModel):
    """Config of `resnet_small`: inputs ``(N, in_channels, image_size, image_size)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_channels: int = Field(default=3, ge=1)
    image_size: int = Field(default=16, ge=4)
    num_classes: int = Field(default=10, ge=2)
    width: int = Field(default=16, ge=1)
    blocks_per_stage: tuple[int, ...] = (1, 1, 1)


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN with an identity (or 1x1 projection) shortcut, as in He et al. 2016."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def build_resnet_small(config: ResNetSmallConfig) -> list[nn.Module]:
    """Build ``[stem, block, ..., block, pool+fc]``; each stage after the first halves the resolution."""
    if not config.blocks_per_stage or any(n < 1 for n in config.blocks_per_stage):
        raise ValueError(f"resnet_small blocks_per_stage must be positive, got {config.blocks_per_stage}")
    w = config.width
    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(config.in_channels, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
    ]
    channels = w
    for stage, num_blocks in enumerate(config.blocks_per_stage):
        out_channels = w * 2**stage
        for b in range(num_blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            layers.append(BasicBlock(channels, out_channels, stride))
            channels = out_channels
    layers.append(
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, config.num_classes))
    )
    return layers
