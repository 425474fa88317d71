"""Models named by key: a registry of builders plus pydantic configs, never pickled code.

A job names a model by key and a plain config dict; every peer builds the same layers from them.
Each builder returns an ordered list of cuttable layers such that ``nn.Sequential(*layers)`` is the
whole model, so a stage is just a contiguous slice of that list.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import pydantic
import torch
from pydantic import BaseModel
from torch import Tensor, nn

from ravnest_p2p.models.char_gpt import CharGPTConfig, build_char_gpt
from ravnest_p2p.models.convnets import (
    DigitsCNNConfig,
    ResNetSmallConfig,
    build_digits_cnn,
    build_resnet_small,
)
from ravnest_p2p.models.mlp import MLPConfig, build_mlp
from ravnest_p2p.models.spec import LossName, TensorSpec, trace_output_specs
from ravnest_p2p.models.transformer import CausalLMConfig, build_causal_lm, build_causal_lm_range
from ravnest_p2p.models.wide_mlp import WideMLPConfig, build_wide_mlp

__all__ = [
    "BUILTIN_MODELS",
    "ModelSpec",
    "available_models",
    "build_layers",
    "build_model",
    "count_layers",
    "get_model_spec",
    "inter_layer_spec",
    "parse_config",
    "sample_input",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Everything a peer needs to know about a registered model, given its parsed config.

    Attributes:
        key: registry key.
        config_cls: the pydantic config class (``extra="forbid"``).
        build: builds the cuttable layers from a parsed config.
        input_spec: spec of the model's input (what stage 0 accepts).
        label_spec: spec of the labels the last stage's loss accepts.
        loss: name of the loss in `ravnest_p2p.models.spec.LOSSES`.
        build_range: builds only layers ``[start, end)``, equal to the same slice of a full build from
            the same RNG state (None: `build_layers` builds everything and slices).
        num_layers: the layer count without building (None: counted from a full build).
        output_spec: the spec of layer ``i``'s output without building (None: traced).
    """

    key: str
    config_cls: type[BaseModel]
    build: Callable[[Any], list[nn.Module]]
    input_spec: Callable[[Any], TensorSpec]
    label_spec: Callable[[Any], TensorSpec]
    loss: Callable[[Any], LossName]
    build_range: Callable[[Any, int, int], list[nn.Module]] | None = None
    num_layers: Callable[[Any], int] | None = None
    output_spec: Callable[[Any, int], TensorSpec] | None = None


def _classification(config: Any) -> LossName:
    return "cross_entropy"


def _mlp_labels(c: MLPConfig) -> TensorSpec:
    if c.task == "regression":
        return TensorSpec((c.out_features,), torch.float32)
    return TensorSpec((), torch.int64, high=c.out_features)


_REGISTRY: dict[str, ModelSpec] = {
    spec.key: spec
    for spec in (
        ModelSpec(
            key="mlp",
            config_cls=MLPConfig,
            build=build_mlp,
            input_spec=lambda c: TensorSpec((c.in_features,), torch.float32),
            label_spec=_mlp_labels,
            loss=lambda c: "mse" if c.task == "regression" else "cross_entropy",
        ),
        ModelSpec(
            key="digits_cnn",
            config_cls=DigitsCNNConfig,
            build=build_digits_cnn,
            input_spec=lambda c: TensorSpec((1, 8, 8), torch.float32),
            label_spec=lambda c: TensorSpec((), torch.int64, high=c.num_classes),
            loss=_classification,
        ),
        ModelSpec(
            key="resnet_small",
            config_cls=ResNetSmallConfig,
            build=build_resnet_small,
            input_spec=lambda c: TensorSpec((c.in_channels, c.image_size, c.image_size), torch.float32),
            label_spec=lambda c: TensorSpec((), torch.int64, high=c.num_classes),
            loss=_classification,
        ),
        ModelSpec(
            key="char_gpt",
            config_cls=CharGPTConfig,
            build=build_char_gpt,
            input_spec=lambda c: TensorSpec((c.block_size,), torch.int64, high=c.vocab_size),
            label_spec=lambda c: TensorSpec((c.block_size,), torch.int64, high=c.vocab_size),
            loss=_classification,
        ),
        ModelSpec(
            key="wide_mlp",
            config_cls=WideMLPConfig,
            build=build_wide_mlp,
            input_spec=lambda c: TensorSpec((c.in_features,), torch.float32),
            label_spec=lambda c: TensorSpec((), torch.int64, high=c.out_features),
            loss=_classification,
        ),
        ModelSpec(
            key="causal_lm",
            config_cls=CausalLMConfig,
            build=build_causal_lm,
            input_spec=lambda c: TensorSpec((c.block_size,), torch.int64, high=c.vocab_size),
            label_spec=lambda c: TensorSpec((c.block_size,), torch.int64, high=c.vocab_size),
            loss=_classification,
            build_range=build_causal_lm_range,
            num_layers=lambda c: c.num_model_layers,
            output_spec=lambda c, i: TensorSpec(
                (c.block_size, c.vocab_size if i == c.num_model_layers - 1 else c.embed_dim), torch.float32
            ),
        ),
    )
}
# every peer of this version has these; any other model name comes from a plugin (`models.plugins`)
BUILTIN_MODELS: frozenset[str] = frozenset(_REGISTRY)


def _specs() -> Mapping[str, ModelSpec]:
    """Built-ins plus the installed packages' ``ravnest_p2p.models`` entry points (`models.plugins`)."""
    from ravnest_p2p.models.plugins import plugin_models  # lazy: plugins imports ModelSpec from here

    return {**plugin_models(builtins=_REGISTRY.keys()), **_REGISTRY}


def available_models() -> list[str]:
    """Keys of every registered model (built-in or from an installed plugin), sorted."""
    return sorted(_specs())


def get_model_spec(key: str) -> ModelSpec:
    """Return the registry entry for ``key``.

    Raises:
        ValueError: if the key is unknown.
    """
    try:
        return _specs()[key]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; available: {available_models()}") from None


def parse_config(key: str, config_dict: Mapping[str, Any] | None = None) -> BaseModel:
    """Validate ``config_dict`` against the config class of model ``key``.

    Raises:
        ValueError: unknown key, unknown field, or out-of-range value (message names the field).
    """
    spec = get_model_spec(key)
    try:
        return spec.config_cls.model_validate(dict(config_dict or {}))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ValueError(f"invalid config for model {key!r}: {problems}") from None


def build_model(
    key: str, config_dict: Mapping[str, Any] | None = None, *, seed: int | None = None
) -> list[nn.Module]:
    """Build the cuttable layers of model ``key``.

    Args:
        key: registry key (see `available_models`).
        config_dict: plain config values; unknown fields are rejected.
        seed: if given, initialise the weights from this seed without disturbing the global RNG, so
            every peer that builds the same (key, config, seed) gets bit-identical initial weights.

    Returns:
        The ordered layers; ``nn.Sequential(*layers)`` is the whole model.

    Raises:
        ValueError: unknown key or bad config.
    """
    spec = get_model_spec(key)
    config = parse_config(key, config_dict)
    if seed is None:
        return spec.build(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.build(config)


def sample_input(key: str, config_dict: Mapping[str, Any] | None = None, *, batch_size: int = 2) -> Tensor:
    """A deterministic dummy input batch for model ``key`` (for profiling and shape tracing)."""
    spec = get_model_spec(key)
    ispec = spec.input_spec(parse_config(key, config_dict))
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, *ispec.shape)
    if ispec.dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=ispec.dtype)
    return torch.randint(0, ispec.high or 2, shape, generator=generator, dtype=ispec.dtype)


def build_layers(
    key: str, config_dict: Mapping[str, Any] | None, *, seed: int | None, start: int, end: int
) -> list[nn.Module]:
    """Layers ``[start, end)`` of model ``key``, with the weights a full `build_model` would give them.

    Models with a `ModelSpec.build_range` build only those layers (a stage of a 1B model never allocates
    the rest); others are built whole and sliced.

    Raises:
        ValueError: unknown key, bad config, or a range outside the model.
    """
    spec = get_model_spec(key)
    config = parse_config(key, config_dict)
    if spec.build_range is None:
        layers = build_model(key, config_dict, seed=seed)
        if not 0 <= start < end <= len(layers):
            raise ValueError(f"layers [{start}, {end}) outside a model of {len(layers)} layers")
        return layers[start:end]
    if seed is None:
        return spec.build_range(config, start, end)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.build_range(config, start, end)


def count_layers(key: str, config_dict: Mapping[str, Any] | None = None) -> int:
    """How many cuttable layers model ``key`` has (without building it where the model allows)."""
    spec = get_model_spec(key)
    config = parse_config(key, config_dict)
    if spec.num_layers is not None:
        return spec.num_layers(config)
    return len(spec.build(config))


def inter_layer_spec(key: str, config_dict: Mapping[str, Any] | None, index: int) -> TensorSpec:
    """The spec of layer ``index``'s output (the input of a stage starting at ``index + 1``)."""
    spec = get_model_spec(key)
    config = parse_config(key, config_dict)
    if spec.output_spec is not None:
        return spec.output_spec(config, index)
    return trace_output_specs(build_model(key, config_dict), sample_input(key, config_dict))[index]
