"""Compressing a pseudo-gradient with error feedback: 8-bit, 4-bit (per-chunk scale) and top-k.

Problem. An outer-optimizer sync (`outer.py`) moves one pseudo-gradient Δ = θ_outer - θ_local per shard.
Sending it in fp32 is 4 bytes per parameter; INTELLECT-1 sends int8 Δ, Streaming DiLoCo 4 bits, SparseLoCo
1-3 % of the entries. Lossy compression alone biases the average: what a rounding drops is lost for good.

Solution: error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD"). Each peer
keeps the residual e of what its last compression dropped and compresses c = Δ + e instead of Δ; the new
residual is c - Q(c). Nothing is lost, only delayed to a later sync.

Codecs (each works on one tensor, flattened):
- ``int8`` / ``int4``: symmetric uniform quantisation, one fp32 scale (absmax / 127 or / 7) per chunk
  of `chunk_numel` elements; payload n bytes (n / 2 for int4) plus 4 bytes per chunk.
- ``topk``: the ceil(fraction x n) entries of largest magnitude, as fp32 value + int32 index (8 bytes
  each); the rest are zero (and stay in the residual).

What travels. `compress` returns the *decoded* values and the size of the encoded form: the in-process
form, used by `OuterOptimizer.outgoing` (the simulator's path). On the rings (`OuterAverager`) the
encoded Δ itself crosses the wire (`deltawire.py`): int8/int4 are quantised by the ring, part by part
and hop by hop; top-k is chosen here (`OuterOptimizer.outgoing_deltas`) and summed exactly.

Determinism. Every operation is elementwise or a sort on one CPU thread: the same input gives the same
bits, but replicas need not agree here anyway (each compresses its own Δ; the ring's average is shared).
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
from torch import Tensor

__all__ = ["DeltaCompression", "compress", "encoded_bytes"]

_SCALE_BYTES = 4
_TOPK_ENTRY_BYTES = 8  # fp32 value + int32 index


class DeltaCompression(StrEnum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    TOPK = "topk"


_LEVELS = {DeltaCompression.INT8: 127, DeltaCompression.INT4: 7}


def encoded_bytes(
    numel: int, method: DeltaCompression, *, chunk_numel: int = 1024, topk_fraction: float = 0.01
) -> int:
    """Bytes of the encoded form of `numel` elements (headers excluded)."""
    if method is DeltaCompression.NONE:
        return 4 * numel
    if method is DeltaCompression.TOPK:
        return _TOPK_ENTRY_BYTES * _topk_count(numel, topk_fraction)
    chunks = -(-numel // chunk_numel)
    data = numel if method is DeltaCompression.INT8 else -(-numel // 2)
    return data + _SCALE_BYTES * chunks


def _topk_count(numel: int, fraction: float) -> int:
    return 0 if numel == 0 else min(numel, max(1, math.ceil(fraction * numel)))


def _quantise(flat: Tensor, levels: int, chunk_numel: int) -> Tensor:
    pad = (-flat.numel()) % chunk_numel
    chunks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, chunk_numel)
    scale = chunks.abs().amax(dim=1, keepdim=True) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(chunks / safe).clamp_(-levels, levels)
    # the scale as it would travel (fp32) times the integer code: what a receiver would decode
    return (codes * scale).reshape(-1)[: flat.numel()]


def _topk(flat: Tensor, fraction: float) -> Tensor:
    count = _topk_count(flat.numel(), fraction)
    out = torch.zeros_like(flat)
    if count:
        # sorted=True with a stable tie order: the same input keeps the same entries
        index = torch.topk(flat.abs(), count, sorted=True).indices
        out[index] = flat[index]
    return out


def compress(
    value: Tensor, method: DeltaCompression, *, chunk_numel: int = 1024, topk_fraction: float = 0.01
) -> tuple[Tensor, int]:
    """Encode and decode `value` (any shape); return (decoded fp32 tensor of its shape, encoded bytes).

    Raises:
        ValueError: `chunk_numel` < 1 or `topk_fraction` not in (0, 1].
    """
    if chunk_numel < 1:
        raise ValueError("chunk_numel must be at least 1")
    if not 0 < topk_fraction <= 1:
        raise ValueError("topk_fraction must be in (0, 1]")
    flat = value.detach().reshape(-1).to(torch.float32)
    nbytes = encoded_bytes(flat.numel(), method, chunk_numel=chunk_numel, topk_fraction=topk_fraction)
    if method is DeltaCompression.NONE or flat.numel() == 0:
        decoded = flat.clone()
    elif method is DeltaCompression.TOPK:
        decoded = _topk(flat, topk_fraction)
    else:
        decoded = _quantise(flat, _LEVELS[method], chunk_numel)
    return decoded.reshape(value.shape), nbytes
