"""Small stages and a hand-driven pipeline step, shared by the stage-state, hand-over and checkpoint tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stage_state import live_tensors
from ravnest_p2p.training.stages import build_stage

ADAM = OptimizerConfig(name="adam", lr=1e-2, schedule="warmup_cosine", warmup_steps=2, total_steps=20)
SGD = OptimizerConfig(name="sgd", lr=5e-2, momentum=0.9)


def resnet_job(optimizer: OptimizerConfig = ADAM, **overrides: object) -> JobSpec:
    """A tiny ResNet (BatchNorm buffers, 5 layers) on 8x8 inputs."""
    fields: dict[str, object] = {
        "job_id": "state",
        "model": "resnet_small",
        "model_params": {"image_size": 8, "width": 4, "in_channels": 1},
        "optimizer": optimizer,
        "seed": 3,
    }
    return JobSpec.model_validate({**fields, **overrides})


def build_split(job: JobSpec, split: Sequence[tuple[int, int]]) -> list[StageExecutor]:
    return [build_stage(job, first, end, max_in_flight=1) for first, end in split]


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, 1, 8, 8, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def train_step(stages: Sequence[StageExecutor], seed: int) -> float:
    """One micro-batch through a hand-driven pipeline of `stages` (forward, loss, backward)."""
    x, y = batch(seed)
    torch.manual_seed(seed)
    for stage in stages[:-1]:
        x = stage.forward(seed, x)
    result = stages[-1].forward_loss(seed, x, y)
    grad = result.grad_input
    for stage in reversed(stages[:-1]):
        grad = stage.backward(seed, grad)  # type: ignore[arg-type]
    return result.loss


def union_state(stages: Sequence[StageExecutor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in stages:
        out.update({n: t.clone() for n, t in live_tensors(stage).items()})
    return out


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
