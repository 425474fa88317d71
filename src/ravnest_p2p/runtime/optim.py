"""Per-stage optimizer and learning-rate schedule, built from a small pydantic config.

Each pipeline stage owns the optimizer of its own parameters; all stages of all clusters follow the
same schedule (indexed by the stage's own optimizer step count) so replicas stay comparable when
they are averaged. The schedule is a pure function of the step so it can be checked without torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["OptimizerConfig", "build_optimizer", "lr_factor"]


class OptimizerConfig(BaseModel):
    """Optimizer and LR schedule of a stage.

    ``schedule="warmup_cosine"`` ramps linearly from 0 to ``lr`` over ``warmup_steps`` then decays
    with a half cosine to ``min_lr_ratio * lr`` at ``total_steps`` (and stays there).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    schedule: Literal["constant", "warmup_cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, ge=1)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if self.schedule == "warmup_cosine" and self.total_steps is None:
            raise ValueError("schedule 'warmup_cosine' needs total_steps")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError("warmup_steps must not exceed total_steps")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self

    @property
    def state_slots(self) -> int:
        """Optimizer-state tensors kept per parameter (for memory planning)."""
        if self.name == "sgd":
            return 1 if self.momentum > 0 else 0
        return 2


def lr_factor(step: int, config: OptimizerConfig) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based)."""
    if config.schedule == "constant":
        return 1.0
    assert config.total_steps is not None
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    decay_steps = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_optimizer(
    params: Iterable[torch.nn.Parameter], config: OptimizerConfig
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """Build the optimizer over ``params`` and its LR scheduler (call ``scheduler.step()`` per step)."""
    param_list = list(params)
    optimizer: torch.optim.Optimizer
    if config.name == "sgd":
        optimizer = torch.optim.SGD(
            param_list, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    elif config.name == "adam":
        optimizer = torch.optim.Adam(
            param_list, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
    else:
        optimizer = torch.optim.AdamW(
            param_list, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, config))
    return optimizer, scheduler
