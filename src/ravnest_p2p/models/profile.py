"""Per-layer cost profile of a model, the input of the stage partitioner.

Why a dry run: the planner splits the model by time and memory, not by parameter count (what
Ravnest's own code does), so it needs, per cuttable layer, the compute of one sample, the memory the
layer pins on its stage (parameters + optimizer state) and the bytes it sends to the next stage.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on one forward pass: it counts
matmuls and convolutions analytically (2 FLOPs per multiply-add) and ignores elementwise work. Layers
with no matmul at all (embeddings, pooling) would then cost zero, which lies to the planner; we floor
each layer at one FLOP per output element. The figure is **forward** FLOPs per sample; a training
step (forward + backward) costs about three times that, which is the planner's convention to apply.

Activation memory is measured, not guessed: a second forward with autograd on records, through
``torch.autograd.graph.saved_tensors_hooks``, every tensor autograd keeps for backward, counted once per
storage and without the parameters (they are saved by reference, not copied).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ravnest_p2p.types import LayerProfile

__all__ = ["OPTIMIZER_STATE_SLOTS", "profile_layers"]

# Tensors of optimizer state per trainable parameter element.
OPTIMIZER_STATE_SLOTS: dict[str, int] = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}


def _param_bytes(layer: nn.Module, *, trainable_only: bool) -> int:
    return sum(
        p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad or not trainable_only
    )


def _saved_bytes(layer: nn.Module, x: Tensor) -> int:
    """Bytes of the tensors autograd saves in one forward of ``layer`` (parameters excluded)."""
    param_storages = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    kept: list[Tensor] = []  # alive until the forward ends, so no storage is freed and reused meanwhile

    def pack(t: Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        kept.append(t)
        # the graph keeps nothing: returning the tensor would let an op that saves its own output hold
        # itself through its grad_fn, a cycle the garbage collector cannot see (it leaked every layer)

    def unpack(_: None) -> Tensor:
        raise AssertionError("the profiler never runs backward")

    inputs = x.detach().requires_grad_(x.is_floating_point())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        layer(inputs)
    kept.clear()
    return sum(seen.values())


def profile_layers(
    layers: Iterable[nn.Module], sample_input: Tensor, *, optimizer: str = "adam"
) -> list[LayerProfile]:
    """Profile each cuttable layer with one forward pass of ``sample_input``.

    Layers are run in eval mode under ``no_grad`` (so BatchNorm statistics are not touched) and put
    back in the mode they were in.

    Args:
        layers: the model's cuttable layers, in order (any iterable: a generator that builds each
            layer on demand keeps one layer in memory at a time).
        sample_input: a batch of at least one sample of the model's input.
        optimizer: one of `OPTIMIZER_STATE_SLOTS` (sets optimizer state bytes).

    Returns:
        One `LayerProfile` per layer, named by its index (``"0"``, ``"1"``, ...) and class.

    Raises:
        ValueError: unknown optimizer or empty batch.
    """
    if optimizer not in OPTIMIZER_STATE_SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_SLOTS)}")
    batch_size = sample_input.shape[0] if sample_input.dim() > 0 else 0
    if batch_size < 1:
        raise ValueError("sample_input must have a batch dimension with at least one sample")
    slots = OPTIMIZER_STATE_SLOTS[optimizer]
    profiles: list[LayerProfile] = []
    x = sample_input
    for index, layer in enumerate(layers):
        was_training = layer.training
        layer.eval()
        try:
            saved = _saved_bytes(layer, x)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                x = layer(x)
        finally:
            layer.train(was_training)
        output_elements_per_sample = x.numel() // batch_size
        flops = max(counter.get_total_flops() / batch_size, float(output_elements_per_sample))
        profiles.append(
            LayerProfile(
                name=f"{index}:{type(layer).__name__}",
                flops_per_sample=flops,
                param_bytes=_param_bytes(layer, trainable_only=False),
                optimizer_state_bytes=slots * _param_bytes(layer, trainable_only=True),
                activation_bytes_per_sample=output_elements_per_sample * x.element_size(),
                trainable_bytes=_param_bytes(layer, trainable_only=True),
                saved_bytes_per_sample=saved // batch_size,
            )
        )
    return profiles
