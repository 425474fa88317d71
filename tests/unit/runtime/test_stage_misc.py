from __future__ import annotations

import pytest
import torch
from torch import nn

from ravnest_p2p.models import TensorSpec, build_model
from ravnest_p2p.runtime import StageConfig, StageExecutor

SPEC = TensorSpec((2, 3), torch.float32)


def test_stage_without_parameters_passes_gradients_through():
    first = StageExecutor(StageConfig(), [nn.Flatten()], input_spec=SPEC)
    middle = StageExecutor(StageConfig(first_layer_index=1), [nn.Flatten()], input_spec=SPEC)
    x = torch.randn(4, 2, 3)
    first.forward(0, x)
    assert first.backward(0, torch.ones(4, 6)) is None
    middle.forward(0, x)
    grad = middle.backward(0, torch.arange(24.0).view(4, 6))
    assert torch.equal(grad, torch.arange(24.0).view(4, 2, 3))
    assert middle.weight_version == 1
    assert middle.parameters_by_name() == {}


def test_global_names_predict_and_construction_errors():
    layers = build_model("mlp", {"hidden_features": [8, 8]}, seed=0)
    stage = StageExecutor(
        StageConfig(first_layer_index=1, is_last=True),
        layers[1:],
        input_spec=TensorSpec((8,), torch.float32),
        label_spec=TensorSpec((), torch.int64, high=10),
    )
    assert sorted(stage.parameters_by_name()) == ["1.0.bias", "1.0.weight", "2.bias", "2.weight"]
    before = {n: p.clone() for n, p in stage.parameters_by_name().items()}
    out = stage.predict(torch.randn(3, 8))
    assert out.shape == (3, 10)
    assert stage.module.training
    assert all(torch.equal(p, before[n]) for n, p in stage.parameters_by_name().items())
    with pytest.raises(ValueError, match="label_spec"):
        StageExecutor(StageConfig(is_last=True), layers, input_spec=SPEC)
    with pytest.raises(ValueError, match="at least one layer"):
        StageExecutor(StageConfig(), [], input_spec=SPEC)
    with pytest.raises(ValueError, match="max_in_flight"):
        StageConfig(max_in_flight=0)
    with pytest.raises(ValueError, match="extra"):
        StageConfig(recompte=True)
