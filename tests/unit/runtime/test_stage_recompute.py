"""Recompute mode (inputs only) gives the same gradients and weights as stored-activation mode."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.models import build_model, sample_input
from ravnest_p2p.runtime import OptimizerConfig
from ravnest_p2p.runtime.schedule import one_f_one_b_schedule
from tests.unit.runtime.helpers import all_params, make_stages

CASES = {
    "mlp": {"hidden_features": [32, 32], "dropout": 0.3},
    "resnet_small": {"image_size": 8, "width": 4, "blocks_per_stage": [1, 1]},
}


def _train(key: str, recompute: bool) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict]:
    config = CASES[key]
    layers = build_model(key, config, seed=0)
    stages = make_stages(
        key, config, layers, [1, 2], OptimizerConfig(name="sgd", lr=0.1), max_in_flight=3, recompute=recompute
    )
    torch.manual_seed(123)
    xs = [sample_input(key, config, batch_size=4) + i for i in range(5)]
    ys = [torch.randint(0, 10, (4,)) for _ in range(5)]
    schedules = one_f_one_b_schedule(3, 5)
    # drive the three stages in a valid 1F1B interleaving: round-robin over each stage's op list
    activations: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    input_grads, param_grads = [], []
    cursor = [0, 0, 0]
    while any(cursor[s] < len(schedules[s]) for s in range(3)):
        for s in range(3):
            if cursor[s] == len(schedules[s]):
                continue
            kind, mb = schedules[s][cursor[s]]
            if kind == "F" and s == 2 and (1, mb) in activations:
                grads[(2, mb)] = stages[2].forward_loss(mb, activations[(1, mb)], ys[mb]).grad_input
            elif kind == "F" and s < 2 and (s == 0 or (s - 1, mb) in activations):
                activations[(s, mb)] = stages[s].forward(mb, xs[mb] if s == 0 else activations[(s - 1, mb)])
            elif kind == "B" and s == 2:
                pass  # the last stage did its backward inside forward_loss
            elif kind == "B" and (s + 1, mb) in grads:
                grads[(s, mb)] = stages[s].backward(mb, grads[(s + 1, mb)])
                input_grads.append(grads[(s, mb)] if s > 0 else torch.zeros(()))
                param_grads.append(stages[s].last_param_grads)
            else:
                continue
            cursor[s] += 1
    return input_grads, param_grads, all_params(stages)


@pytest.mark.parametrize("key", sorted(CASES))
def test_recompute_matches_stored_activations(key):
    stored = _train(key, recompute=False)
    recomputed = _train(key, recompute=True)
    assert len(stored[0]) == 10
    for a, b in zip(stored[0], recomputed[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(stored[1], recomputed[1], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    for name, value in stored[2].items():
        # includes BatchNorm running statistics: the replay must not update them twice
        torch.testing.assert_close(value, recomputed[2][name], atol=1e-6, rtol=1e-5)
