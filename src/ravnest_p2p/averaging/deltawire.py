"""Pseudo-gradients on the wire: the ring's part codecs for encoded Δ (int8, int4, sparse).

Problem. An outer-optimizer sync (`outer.py`) averages one pseudo-gradient Δ per shard. In fp32 the ring
moves 2(C-1)/C x 4 bytes per element per member; INTELLECT-1 sends int8, Streaming DiLoCo 4 bits,
SparseLoCo a few percent of the entries. Here the ring's parts carry the encoded Δ itself.

How the reduction works with quantised parts (the choice, and the trade):
- ``int8`` / ``int4``: the ring re-quantises at every hop, as INTELLECT-1 does. A member decodes the
  part it receives into its fp32 accumulator, adds its own Δ in fp32, and encodes the partial sum for
  the next hop; the owner of a fully reduced chunk encodes it once, keeps the decoded copy, and the
  all-gather relays those bytes verbatim (never re-encoded), so every member decodes the same bytes
  and ends with the same bits. Bytes per member: 2(C-1)/C x (1 or 1/2 byte + 4 bytes per block) per
  element, ~1/4 (1/8) of fp32. Each encoding loses up to half a quantisation step; the member that
  encoded keeps that loss (in sum units) and adds it to its next Δ (`RingSession.errors`): error
  feedback for the ring's own roundings, so the sum over syncs loses nothing for good.
  Rejected: all-gather every member's encoded Δ and average locally (one rounding per member, but
  (C-1) x the encoded size per member: C/2 x the bytes of the ring, 2x at 4 clusters).
- ``topk`` (`SPARSE`): each member sends its top-k Δ (chosen, with error feedback, in `outer.py`); the
  ring sums it exactly: a part travels as (index, value) pairs of its non-zero entries, or dense fp32
  when that is smaller. Lossless, so the ring stays exact and the partial sums only get denser (at
  most C x k entries): bytes per member ≤ ~1.5 (C-1) x 8 bytes per kept entry when members' indices
  are disjoint, less when they overlap.

Parts (one per ring part, `part_numel` elements, blocks of `block_numel` elements each with a scale)::

    int8    f32 scales[ceil(n / block)] | i8 codes[n]                 codes in [-127, 127]
    int4    f32 scales[ceil(n / block)] | u8 packed[ceil(n / 2)]      nibble = code + 8, code in [-7, 7]
    sparse  u8 0 | f32 values[n]                                       dense
            u8 1 | u32 count | i32 indices[count] | f32 values[count]  strictly increasing, < n

Decoding trusts nothing: sizes are exact for the receiver's own part length (never an announced one),
scales finite and ≥ 0, codes in range, indices strictly increasing and in range, values finite.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.errors import InvalidMessage

__all__ = ["WIRE_CODEC_IDS", "WireCodec"]

WIRE_CODEC_IDS = {DeltaCompression.INT8: 16, DeltaCompression.INT4: 17, DeltaCompression.TOPK: 18}
_LEVELS = {DeltaCompression.INT8: 127, DeltaCompression.INT4: 7}
_COUNT = struct.Struct("<BI")


@dataclass(frozen=True)
class WireCodec:
    """How a ring's parts carry Δ: `kind` (int8, int4, topk → sparse) and the quantisation block."""

    kind: DeltaCompression
    block_numel: int = 1024

    def __post_init__(self) -> None:
        if self.kind not in WIRE_CODEC_IDS:
            raise ValueError(f"no wire codec for {self.kind}")
        if self.block_numel < 1:
            raise ValueError("block_numel must be at least 1")

    @property
    def lossy(self) -> bool:
        return self.kind is not DeltaCompression.TOPK

    @property
    def label(self) -> str:
        """What both ends of a stream must agree on (travels in the stream's hello)."""
        return f"{self.kind.value}/{self.block_numel}"

    def max_bytes(self, numel: int) -> int:
        """The exact payload size (int8, int4) or its upper bound (sparse) for `numel` elements."""
        blocks = -(-numel // self.block_numel)
        if self.kind is DeltaCompression.INT8:
            return 4 * blocks + numel
        if self.kind is DeltaCompression.INT4:
            return 4 * blocks + -(-numel // 2)
        return 1 + 4 * numel  # dense is chosen when sparse is not smaller

    # ----- encode ------------------------------------------------------------------------------
    def encode(self, values: torch.Tensor) -> bytes:
        """The payload of a contiguous fp32 slice (finite values)."""
        flat = values.detach().reshape(-1).to(torch.float32)
        if self.kind is DeltaCompression.TOPK:
            return _encode_sparse(flat)
        levels = _LEVELS[self.kind]
        n, block = flat.numel(), self.block_numel
        pad = (-n) % block
        blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, block)
        scales = blocks.abs().amax(dim=1) / levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8).reshape(-1)[:n]
        if self.kind is DeltaCompression.INT8:
            body = codes.numpy().tobytes()
        else:
            nibbles = (codes + 8).to(torch.uint8)
            if n % 2:
                nibbles = torch.cat([nibbles, torch.tensor([8], dtype=torch.uint8)])
            pairs = nibbles.reshape(-1, 2)
            body = (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()
        return scales.numpy().astype("<f4").tobytes() + body

    # ----- decode ------------------------------------------------------------------------------
    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """A new fp32 tensor of `numel` values from a payload.

        Raises:
            InvalidMessage: wrong size, non-finite or negative scale, code or index out of range,
                non-finite value.
        """
        view = memoryview(payload).cast("B")
        if self.kind is DeltaCompression.TOPK:
            return _decode_sparse(view, numel)
        if view.nbytes != self.max_bytes(numel):
            raise InvalidMessage(f"{self.kind} payload of {view.nbytes} bytes for {numel} elements")
        if numel == 0:
            return torch.zeros(0)
        levels = _LEVELS[self.kind]
        num_blocks = -(-numel // self.block_numel)
        scales = torch.frombuffer(bytearray(view[: 4 * num_blocks]), dtype=torch.float32)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise InvalidMessage("a block scale is negative or not finite")
        raw = bytearray(view[4 * num_blocks :])
        if self.kind is DeltaCompression.INT8:
            codes = torch.frombuffer(raw, dtype=torch.int8).to(torch.float32)
        else:
            packed = torch.frombuffer(raw, dtype=torch.uint8)
            if numel % 2 and int(packed[-1]) >> 4 != 8:
                raise InvalidMessage("the int4 padding nibble is not zero")
            nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:numel]
            codes = nibbles.to(torch.float32) - 8
        if bool((codes.abs() > levels).any()):
            raise InvalidMessage(f"a code is outside [-{levels}, {levels}]")
        pad = (-numel) % self.block_numel
        full = torch.nn.functional.pad(codes, (0, pad)).reshape(num_blocks, self.block_numel)
        decoded = (full * scales[:, None]).reshape(-1)[:numel].contiguous()
        if not bool(torch.isfinite(decoded).all()):  # a huge scale times a code can overflow
            raise InvalidMessage("decoded values are not finite")
        return decoded

    def roundtrip(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """(payload, what every receiver decodes from it): the sender keeps exactly the receivers' bits."""
        payload = self.encode(values)
        return payload, self.decode(payload, values.numel())


def _encode_sparse(flat: torch.Tensor) -> bytes:
    index = torch.nonzero(flat, as_tuple=True)[0]
    count = index.numel()
    if 8 * count + 4 >= 4 * flat.numel():  # not smaller than dense
        return b"\x00" + flat.numpy().astype("<f4").tobytes()
    return (
        _COUNT.pack(1, count)
        + index.to(torch.int32).numpy().astype("<i4").tobytes()
        + flat[index].numpy().astype("<f4").tobytes()
    )


def _decode_sparse(view: memoryview, numel: int) -> torch.Tensor:
    if view.nbytes < 1:
        raise InvalidMessage("empty sparse payload")
    mode = view[0]
    if mode == 0:
        if view.nbytes != 1 + 4 * numel:
            raise InvalidMessage(f"dense payload of {view.nbytes} bytes for {numel} elements")
        out = torch.frombuffer(bytearray(view[1:]), dtype=torch.float32) if numel else torch.zeros(0)
    elif mode == 1:
        if view.nbytes < _COUNT.size:
            raise InvalidMessage("truncated sparse header")
        _, count = _COUNT.unpack(view[: _COUNT.size])
        if count > numel or view.nbytes != _COUNT.size + 8 * count:
            raise InvalidMessage(f"sparse payload of {view.nbytes} bytes, {count} entries of {numel}")
        out = torch.zeros(numel)
        if count:
            body = bytearray(view[_COUNT.size :])
            index = torch.frombuffer(body[: 4 * count], dtype=torch.int32).to(torch.int64)
            values = torch.frombuffer(body[4 * count :], dtype=torch.float32)
            if bool(index[0] < 0) or bool(index[-1] >= numel) or bool((index[1:] <= index[:-1]).any()):
                raise InvalidMessage("sparse indices not strictly increasing within the part")
            out[index] = values
    else:
        raise InvalidMessage(f"unknown sparse mode {mode}")
    if not bool(torch.isfinite(out).all()):
        raise InvalidMessage("non-finite values")
    return out
