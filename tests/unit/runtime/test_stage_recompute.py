"""Recompute mode (inputs only) gives the same gradients and weights as stored-activation mode."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.models import build_model, sample_input
from ravnest_p2p.runtime import OptimizerConfig
from tests.unit.runtime.helpers import all_params, drive_1f1b, make_stages

CASES = {
    "mlp": {"hidden_features": [32, 32], "dropout": 0.3},
    "resnet_small": {"image_size": 8, "width": 4, "blocks_per_stage": [1, 1]},
}


def _train(key: str, recompute: bool) -> tuple[list, list[dict[str, torch.Tensor]], dict]:
    config = CASES[key]
    layers = build_model(key, config, seed=0)
    stages = make_stages(
        key, config, layers, [1, 2], OptimizerConfig(name="sgd", lr=0.1), max_in_flight=3, recompute=recompute
    )
    torch.manual_seed(123)
    xs = [sample_input(key, config, batch_size=4) + i for i in range(5)]
    ys = [torch.randint(0, 10, (4,)) for _ in range(5)]
    input_grads, param_grads, _ = drive_1f1b(stages, xs, ys)
    return input_grads, param_grads, all_params(stages)


@pytest.mark.parametrize("key", sorted(CASES))
def test_recompute_matches_stored_activations(key):
    stored = _train(key, recompute=False)
    recomputed = _train(key, recompute=True)
    assert len(stored[0]) == 10
    for a, b in zip(stored[0], recomputed[0], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(stored[1], recomputed[1], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    for name, value in stored[2].items():
        # includes BatchNorm running statistics: the replay must not update them twice
        torch.testing.assert_close(value, recomputed[2][name], atol=1e-6, rtol=1e-5)
