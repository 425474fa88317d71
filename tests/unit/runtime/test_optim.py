from __future__ import annotations

import itertools

import pytest
import torch

from ravnest_p2p.runtime import OptimizerConfig, build_optimizer, lr_factor


def test_constant_and_warmup_cosine_factors():
    assert lr_factor(1000, OptimizerConfig()) == 1.0
    config = OptimizerConfig(schedule="warmup_cosine", warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    factors = [lr_factor(step, config) for step in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5)
    assert factors[14:] == pytest.approx([0.1] * 6)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))


def test_scheduler_drives_optimizer_lr():
    config = OptimizerConfig(name="sgd", lr=0.5, schedule="warmup_cosine", warmup_steps=1, total_steps=3)
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = build_optimizer([param], config)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * lr_factor(s, config) for s in range(4)])


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"schedule": "warmup_cosine"}, "total_steps"),
        ({"warmup_steps": 5, "total_steps": 2}, "warmup_steps"),
        ({"lr": 0}, "lr"),
        ({"name": "lion"}, "name"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"momentun": 0.9}, "momentun"),
    ],
)
def test_bad_config_is_a_value_error(fields, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**fields)


def test_state_slots():
    assert OptimizerConfig(name="sgd").state_slots == 0
    assert OptimizerConfig(name="sgd", momentum=0.9).state_slots == 1
    assert OptimizerConfig(name="adamw").state_slots == 2
