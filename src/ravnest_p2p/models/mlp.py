"""A plain multi-layer perceptron: one cuttable layer per hidden Linear (+ activation)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

__all__ = ["MLPConfig", "build_mlp"]

_ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}


class MLPConfig(BaseModel):
    """Config of `mlp`. Inputs of any shape ``(N, *)`` are flattened to ``in_features``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    in_features: int = Field(default=64, ge=1)
    hidden_features: tuple[int, ...] = (128, 128)
    out_features: int = Field(default=10, ge=1)
    activation: Literal["relu", "gelu", "tanh"] = "relu"
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    task: Literal["classification", "regression"] = "classification"


def build_mlp(config: MLPConfig) -> list[nn.Module]:
    """Build the MLP as ``[Flatten+Linear+act(+dropout), ..., Linear]``."""
    layers: list[nn.Module] = []
    width = config.in_features
    for i, hidden in enumerate(config.hidden_features):
        parts: list[nn.Module] = [nn.Flatten()] if i == 0 else []
        parts += [nn.Linear(width, hidden), _ACTIVATIONS[config.activation]()]
        if config.dropout > 0:
            parts.append(nn.Dropout(config.dropout))
        layers.append(nn.Sequential(*parts))
        width = hidden
    head = nn.Linear(width, config.out_features)
    layers.append(head if config.hidden_features else nn.Sequential(nn.Flatten(), head))
    return layers
