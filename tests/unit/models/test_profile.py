from __future__ import annotations

import pytest
import torch

from ravnest_p2p.models import build_model, profile_layers, sample_input
from tests.unit.models.test_registry import SMALL_CONFIGS


@pytest.mark.parametrize("key", sorted(SMALL_CONFIGS))
def test_profile_is_positive_and_param_bytes_exact(key):
    layers = build_model(key, SMALL_CONFIGS[key], seed=0)
    x = sample_input(key, SMALL_CONFIGS[key], batch_size=4)
    profiles = profile_layers(layers, x, optimizer="adam")
    assert len(profiles) == len(layers)
    h = x
    for layer, profile in zip(layers, profiles, strict=True):
        h = layer(h)
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert profile.param_bytes == param_bytes
        assert profile.optimizer_state_bytes == 2 * param_bytes
        assert profile.activation_bytes_per_sample == h[0].numel() * h.element_size()
        assert profile.flops_per_sample > 0
    sgd = profile_layers(layers, x, optimizer="sgd")
    assert all(p.optimizer_state_bytes == 0 for p in sgd)


def test_linear_flops_are_analytic():
    layers = build_model("mlp", {"in_features": 64, "hidden_features": [32], "out_features": 10}, seed=0)
    profiles = profile_layers(layers, torch.randn(5, 64))
    assert profiles[0].flops_per_sample == 2 * 64 * 32
    assert profiles[1].flops_per_sample == 2 * 32 * 10


def test_profile_does_not_touch_batchnorm_or_mode():
    layers = build_model("resnet_small", SMALL_CONFIGS["resnet_small"], seed=0)
    before = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in layers]
    profile_layers(layers, sample_input("resnet_small", SMALL_CONFIGS["resnet_small"], batch_size=4))
    for layer, saved in zip(layers, before, strict=True):
        assert layer.training
        for k, v in layer.state_dict().items():
            assert torch.equal(v, saved[k])


def test_profile_rejects_bad_arguments():
    layers = build_model("mlp", {}, seed=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        profile_layers(layers, torch.randn(2, 64), optimizer="lion")
    with pytest.raises(ValueError, match="at least one sample"):
        profile_layers(layers, torch.randn(0, 64))
