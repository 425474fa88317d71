"""Checks applied to every tensor a stage receives, before anything touches state.

A peer must never let a malformed message (wrong shape or dtype, NaN/inf, out-of-range token ids, an
unknown micro-batch) reach autograd or the optimizer: it would either crash the compute thread or,
worse, silently poison the weights. Every failure is an `InvalidMessage`.

Finite is not enough: activations of 1e30 are finite and overflow the next layer or the loss. With
``max_abs`` a float tensor must also lie within ``[-max_abs, max_abs]``; one pass answers both
questions, and a tensor already checked on this hop is not read again (`transport.codec_values`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models.spec import TensorSpec
from ravnest_p2p.transport.codec_values import int_range, within

__all__ = ["check_matches", "check_micro_batch_id", "check_tensor"]


def check_micro_batch_id(micro_batch_id: object) -> int:
    """Return the id if it is a non-negative ``int`` (not a bool), else raise `InvalidMessage`."""
    if isinstance(micro_batch_id, bool) or not isinstance(micro_batch_id, int) or micro_batch_id < 0:
        raise InvalidMessage(f"micro-batch id must be a non-negative int, got {micro_batch_id!r}")
    return micro_batch_id


def _check_values(tensor: Tensor, what: str, high: int | None, max_abs: float | None = None) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        # one pass per tensor per hop: a tensor already checked (when it was decoded, or by the
        # handler before the executor) is not read again (`codec_values`)
        if not within(tensor, max_abs):
            if max_abs is None:
                raise InvalidMessage(f"{what} contains NaN or inf")
            low_value, high_value = _min_max(tensor)
            raise InvalidMessage(f"{what} has values in [{low_value}, {high_value}], beyond +-{max_abs:g}")
    elif high is not None and tensor.numel() > 0:
        low_value, high_value = int_range(tensor)
        if low_value < 0 or high_value >= high:
            raise InvalidMessage(f"{what} values must lie in [0, {high}), got [{low_value}, {high_value}]")


def _min_max(tensor: Tensor) -> tuple[float, float]:
    """For the refusal's message only (NaN shows as nan)."""
    low, high = torch.aminmax(tensor.detach().reshape(-1).abs() if tensor.is_complex() else tensor.detach())
    return float(low), float(high)


def check_tensor(
    tensor: object,
    spec: TensorSpec,
    what: str,
    *,
    batch_size: int | None = None,
    max_abs: float | None = None,
) -> Tensor:
    """Check ``tensor`` against ``spec`` (any batch size >= 1 unless ``batch_size`` is given).

    Raises:
        InvalidMessage: not a tensor, wrong dtype/shape/batch size, non-finite or out-of-range values.
    """
    if not isinstance(tensor, Tensor):
        raise InvalidMessage(f"{what} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype != spec.dtype:
        raise InvalidMessage(f"{what} has dtype {tensor.dtype}, expected {spec.describe()}")
    if tensor.dim() != len(spec.shape) + 1 or tuple(tensor.shape[1:]) != spec.shape:
        raise InvalidMessage(f"{what} has shape {tuple(tensor.shape)}, expected {spec.describe()}")
    if tensor.shape[0] < 1:
        raise InvalidMessage(f"{what} has an empty batch")
    if batch_size is not None and tensor.shape[0] != batch_size:
        raise InvalidMessage(f"{what} has batch size {tensor.shape[0]}, expected {batch_size}")
    _check_values(tensor, what, spec.high, max_abs)
    return tensor


def check_matches(
    tensor: object, shape: torch.Size, dtype: torch.dtype, what: str, *, max_abs: float | None = None
) -> Tensor:
    """Check that ``tensor`` has exactly ``shape`` and ``dtype`` and finite values (within ``max_abs``).

    Raises:
        InvalidMessage: on any mismatch.
    """
    if not isinstance(tensor, Tensor):
        raise InvalidMessage(f"{what} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype or tensor.shape != shape:
        raise InvalidMessage(
            f"{what} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(shape)} {dtype}"
        )
    _check_values(tensor, what, None, max_abs)
    return tensor
