"""A wide MLP with BatchNorm: the model Independent Subnetwork Training splits by hidden unit.

Each hidden layer is ``Linear(bias=False) -> BatchNorm1d -> ReLU`` (the layout of the IST authors' code:
BatchNorm re-normalises a sub-network's partial sums, and makes the Linear's bias redundant); the head is
a plain ``Linear`` with bias. Widths of 2048-4096 are what IST is for; the default is small for tests.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

__all__ = ["WideMLPConfig", "build_wide_mlp"]


class WideMLPConfig(BaseModel):
    """Config of `wide_mlp`. Inputs of any shape ``(N, *)`` are flattened to ``in_features``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_features: int = Field(default=64, ge=1)
    hidden_features: tuple[int, ...] = Field(default=(64, 64), min_length=1)
    out_features: int = Field(default=10, ge=1)
    bn_momentum: float = Field(default=0.1, gt=0.0, le=1.0)


def build_wide_mlp(config: WideMLPConfig) -> list[nn.Module]:
    """Build ``[Flatten+Linear+BN+ReLU, Linear+BN+ReLU, ..., Linear]`` (one cuttable layer each)."""
    if any(h < 1 for h in config.hidden_features):
        raise ValueError(f"hidden widths must be >= 1, got {config.hidden_features}")
    layers: list[nn.Module] = []
    width = config.in_features
    for i, hidden in enumerate(config.hidden_features):
        parts: list[nn.Module] = [nn.Flatten()] if i == 0 else []
        parts += [
            nn.Linear(width, hidden, bias=False),
            nn.BatchNorm1d(hidden, momentum=config.bn_momentum),
            nn.ReLU(),
        ]
        layers.append(nn.Sequential(*parts))
        width = hidden
    layers.append(nn.Linear(width, config.out_features))
    return layers
