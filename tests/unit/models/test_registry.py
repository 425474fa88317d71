from __future__ import annotations

import pytest
import torch
from torch import nn

from ravnest_p2p.models import (
    available_models,
    build_model,
    get_model_spec,
    make_loss,
    parse_config,
    sample_input,
    trace_output_specs,
)

SMALL_CONFIGS = {
    "mlp": {"hidden_features": [32, 16]},
    "digits_cnn": {},
    "resnet_small": {"image_size": 8, "width": 8, "blocks_per_stage": [1, 2]},
    "char_gpt": {"vocab_size": 20, "block_size": 12, "num_layers": 2, "embed_dim": 16, "num_heads": 2},
    "wide_mlp": {"hidden_features": [16, 8]},
    "causal_lm": {"vocab_size": 20, "block_size": 12, "num_layers": 2, "embed_dim": 16, "num_heads": 2},
}


def test_registry_has_required_models():
    assert {"mlp", "digits_cnn", "resnet_small", "char_gpt"} <= set(available_models())
    assert set(SMALL_CONFIGS) == set(available_models())


@pytest.mark.parametrize("key", sorted(SMALL_CONFIGS))
def test_layers_compose_to_full_model(key):
    config = SMALL_CONFIGS[key]
    layers = build_model(key, config, seed=3)
    model = nn.Sequential(*layers).eval()
    x = sample_input(key, config, batch_size=3)
    with torch.no_grad():
        full = model(x)
        h = x
        for layer in layers:
            h = layer(h)
    torch.testing.assert_close(h, full)
    spec = get_model_spec(key)
    parsed = parse_config(key, config)
    labels = spec.label_spec(parsed)
    if labels.dtype == torch.int64:
        assert full.shape[-1] == labels.high
    assert full.shape[0] == 3
    assert spec.input_spec(parsed).shape == tuple(x.shape[1:])
    # the loss the registry names accepts the model's output and labels
    y = torch.zeros((3, *labels.shape), dtype=labels.dtype)
    assert torch.isfinite(make_loss(spec.loss(parsed))(full, y))
    # every cut carries a single tensor whose spec is traceable
    assert len(trace_output_specs(layers, x)) == len(layers)


@pytest.mark.parametrize("key", sorted(SMALL_CONFIGS))
def test_seed_makes_weights_identical_and_leaves_global_rng(key):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = nn.Sequential(*build_model(key, SMALL_CONFIGS[key], seed=7))
    b = nn.Sequential(*build_model(key, SMALL_CONFIGS[key], seed=7))
    assert torch.equal(before, torch.get_rng_state())
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb
        assert torch.equal(pa, pb)


def test_unknown_key_and_bad_config_raise_value_error():
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        build_model("nope", {})
    with pytest.raises(ValueError, match=r"invalid config for model 'mlp'.*colour"):
        build_model("mlp", {"colour": "red"})
    with pytest.raises(ValueError, match="num_heads"):
        build_model("char_gpt", {"embed_dim": 10, "num_heads": 3})
    with pytest.raises(ValueError, match="dropout"):
        build_model("digits_cnn", {"dropout": 1.5})


def test_char_gpt_is_causal():
    config = SMALL_CONFIGS["char_gpt"]
    model = nn.Sequential(*build_model("char_gpt", config, seed=0)).eval()
    x = sample_input("char_gpt", config, batch_size=1)
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % config["vocab_size"]
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :-1], model(y)[:, :-1])


def test_resnet_blocks_keep_skip_inside():
    layers = build_model("resnet_small", SMALL_CONFIGS["resnet_small"], seed=0)
    assert any(isinstance(m, nn.BatchNorm2d) for m in layers[0].modules())
    assert type(layers[1]).__name__ == "BasicBlock"
    assert len(layers) == 1 + 3 + 1  # stem, 1 + 2 blocks, head
