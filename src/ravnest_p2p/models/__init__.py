"""Model registry (models by key + pydantic config), tensor specs, losses and the layer profiler."""

from ravnest_p2p.models.char_gpt import CharGPTConfig
from ravnest_p2p.models.convnets import DigitsCNNConfig, ResNetSmallConfig
from ravnest_p2p.models.mlp import MLPConfig
from ravnest_p2p.models.profile import OPTIMIZER_STATE_SLOTS, profile_layers
from ravnest_p2p.models.registry import (
    ModelSpec,
    available_models,
    build_layers,
    build_model,
    count_layers,
    get_model_spec,
    inter_layer_spec,
    parse_config,
    sample_input,
)
from ravnest_p2p.models.spec import LOSSES, LossFn, LossName, TensorSpec, make_loss, trace_output_specs
from ravnest_p2p.models.transformer import CausalLMConfig
from ravnest_p2p.models.wide_mlp import WideMLPConfig

__all__ = [
    "LOSSES",
    "OPTIMIZER_STATE_SLOTS",
    "CausalLMConfig",
    "CharGPTConfig",
    "DigitsCNNConfig",
    "LossFn",
    "LossName",
    "MLPConfig",
    "ModelSpec",
    "ResNetSmallConfig",
    "TensorSpec",
    "WideMLPConfig",
    "available_models",
    "build_layers",
    "build_model",
    "count_layers",
    "get_model_spec",
    "inter_layer_spec",
    "make_loss",
    "parse_config",
    "profile_layers",
    "sample_input",
    "trace_output_specs",
]
