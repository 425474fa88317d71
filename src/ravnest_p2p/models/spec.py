"""What a model expects at its boundaries: input/label tensor specs and the loss it trains with.

The executor of each stage checks every incoming tensor against a `TensorSpec` before it touches
state, so the spec is the contract between a stage and whoever sends it activations or labels.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LOSSES", "LossFn", "LossName", "TensorSpec", "make_loss", "trace_output_specs"]

LossName = Literal["cross_entropy", "mse"]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension) and dtype of a tensor a stage accepts.

    Attributes:
        shape: the per-sample shape; the leading batch dimension is free.
        dtype: the exact dtype accepted.
        high: for integer tensors (token ids, class labels), values must lie in ``[0, high)``.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int | None = None

    def describe(self) -> str:
        """A short human-readable form for error messages."""
        rng = f", values in [0, {self.high})" if self.high is not None else ""
        return f"(N, {', '.join(map(str, self.shape))}) {self.dtype}{rng}".replace("(N, )", "(N,)")


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    # Flatten so that (N, C) classification and (N, T, C) language modelling share one loss.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _mse(prediction: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(prediction, target)


LOSSES: dict[str, LossFn] = {"cross_entropy": _cross_entropy, "mse": _mse}


def make_loss(name: str) -> LossFn:
    """Return the loss function named ``name`` (mean over the micro-batch).

    Raises:
        ValueError: if the name is unknown.
    """
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}") from None


def trace_output_specs(layers: list[torch.nn.Module], sample_input: Tensor) -> list[TensorSpec]:
    """Run ``sample_input`` through ``layers`` (no grad) and return each layer's output spec.

    The input spec of a stage starting at layer ``i > 0`` is ``trace_output_specs(...)[i - 1]``.
    """
    specs: list[TensorSpec] = []
    x = sample_input
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
            specs.append(TensorSpec(shape=tuple(x.shape[1:]), dtype=x.dtype))
    return specs
