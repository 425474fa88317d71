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
- ``topk`` chunked and quantised (SparseLoCo, `topk_chunk` > 0 and/or `topk_bits` < 32): the tensor is
  cut into chunks of `topk_chunk` elements and each keeps its ceil(fraction x chunk) largest entries, so
  an index is ceil(log2 chunk) bits (12 for 4096) instead of 32. With `topk_bits` b < 32 a kept value
  is a sign and a (b-1)-bit magnitude level, uniform between the chunk's smallest and largest kept
  magnitude (two fp32 per chunk): 2 bits = sign + {smallest, largest}. What the levels round off stays
  in the residual like what top-k leaves out. Encoded per chunk: 8 B (b < 32) + ceil((where + k b) / 8)
  where `where` is k indices or a bitmap of the chunk, whichever is smaller (the bitmap above ~8 %).

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
    numel: int,
    method: DeltaCompression,
    *,
    chunk_numel: int = 1024,
    topk_fraction: float = 0.01,
    topk_chunk: int = 0,
    topk_bits: int = 32,
) -> int:
    """Bytes of the encoded form of `numel` elements (headers excluded)."""
    if method is DeltaCompression.NONE:
        return 4 * numel
    if method is DeltaCompression.TOPK:
        if topk_chunk <= 0 and topk_bits >= 32:
            return _TOPK_ENTRY_BYTES * _topk_count(numel, topk_fraction)
        return _chunked_topk_bytes(numel, topk_fraction, topk_chunk, topk_bits)
    chunks = -(-numel // chunk_numel)
    data = numel if method is DeltaCompression.INT8 else -(-numel // 2)
    return data + _SCALE_BYTES * chunks


def _topk_count(numel: int, fraction: float) -> int:
    return 0 if numel == 0 else min(numel, max(1, math.ceil(fraction * numel)))


def _chunk_width(numel: int, topk_chunk: int) -> int:
    return numel if topk_chunk <= 0 else max(1, min(numel, topk_chunk))


def _chunked_topk_bytes(numel: int, fraction: float, topk_chunk: int, bits: int) -> int:
    if numel == 0:
        return 0
    width = _chunk_width(numel, topk_chunk)
    chunks, per_chunk = -(-numel // width), _topk_count(width, fraction)
    index_bits = max(1, (width - 1).bit_length())
    where = min(width, per_chunk * index_bits)  # a bitmap of the chunk when it is smaller
    scales = 2 * _SCALE_BYTES if bits < 32 else 0
    return chunks * (scales + -(-(where + per_chunk * bits) // 8))


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


def _chunked_topk(flat: Tensor, fraction: float, topk_chunk: int, bits: int) -> Tensor:
    """Each chunk's largest entries, their magnitudes rounded to 2^(bits-1) levels (bits < 32)."""
    n = flat.numel()
    width = _chunk_width(n, topk_chunk)
    rows = torch.nn.functional.pad(flat, (0, (-n) % width)).reshape(-1, width)
    count = _topk_count(width, fraction)
    index = torch.topk(rows.abs(), count, dim=1, sorted=True).indices
    kept = rows.gather(1, index)
    if bits < 32:
        levels = 1 << (bits - 1)
        mag = kept.abs()
        lo, hi = mag.amin(dim=1, keepdim=True), mag.amax(dim=1, keepdim=True)
        step = (hi - lo) / max(1, levels - 1)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        code = torch.round((mag - lo) / safe).clamp_(0, levels - 1)
        kept = torch.sign(kept) * (lo + code * step)  # a zero stays zero (sign 0)
    out = torch.zeros_like(rows).scatter_(1, index, kept)
    return out.reshape(-1)[:n]


def compress(
    value: Tensor,
    method: DeltaCompression,
    *,
    chunk_numel: int = 1024,
    topk_fraction: float = 0.01,
    topk_chunk: int = 0,
    topk_bits: int = 32,
) -> tuple[Tensor, int]:
    """Encode and decode `value` (any shape); return (decoded fp32 tensor of its shape, encoded bytes).

    Raises:
        ValueError: `chunk_numel` < 1, `topk_fraction` not in (0, 1] or `topk_bits` not in [2, 32].
    """
    if chunk_numel < 1:
        raise ValueError("chunk_numel must be at least 1")
    if not 0 < topk_fraction <= 1:
        raise ValueError("topk_fraction must be in (0, 1]")
    if not 2 <= topk_bits <= 32:
        raise ValueError("topk_bits must be in [2, 32]")
    flat = value.detach().reshape(-1).to(torch.float32)
    nbytes = encoded_bytes(
        flat.numel(),
        method,
        chunk_numel=chunk_numel,
        topk_fraction=topk_fraction,
        topk_chunk=topk_chunk,
        topk_bits=topk_bits,
    )
    if method is DeltaCompression.NONE or flat.numel() == 0:
        decoded = flat.clone()
    elif method is DeltaCompression.TOPK and (topk_chunk > 0 or topk_bits < 32):
        decoded = _chunked_topk(flat, topk_fraction, topk_chunk, topk_bits)
    elif method is DeltaCompression.TOPK:
        decoded = _topk(flat, topk_fraction)
    else:
        decoded = _quantise(flat, _LEVELS[method], chunk_numel)
    return decoded.reshape(value.shape), nbytes
