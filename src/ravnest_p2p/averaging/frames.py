"""The ring's own framing on a raw byte stream: a hello, fixed-size part headers, raw payloads, acks.

Why not the RPC envelope. A ring moves gigabytes in parts of a few MiB between the same two peers; the
RPC path (msgpack header, protobuf tensor, one stream and one reply per part) cost ~1.5x hivemind's
averager on loopback. Here one stream per (ring, attempt) carries every part from a member to its right
neighbour: a fixed 20-byte header, then the part's bytes exactly as they lie in the sender's flat buffer
(fp32 or fp16, little-endian), written from the buffer without a copy. The receiver answers each part
with a 7-byte ack, or one error frame before it closes the stream.

Every field is checked before anything is allocated or read: the hello is a bounded msgpack map
validated by a pydantic model (never pickle), a part header's payload length is compared with what the
receiver's own session expects for that (step, chunk, part) before the payload is read.

Frames::

    hello   b"RH" u16 length | msgpack map (StreamHello)          sender -> receiver, once
    part    b"RP" u8 version u8 codec u32 step u32 chunk u32 part u32 payload_bytes | payload
    ack     b"RA" u8 0 u32 parts accepted so far                 receiver -> sender
    error   b"RA" u8 1 u32 length | msgpack {"code", "message"}  receiver -> sender, then closes
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch
from pydantic import ValidationError

from ravnest_p2p.averaging.deltawire import WIRE_CODEC_IDS
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.errors import InvalidMessage, PayloadTooLarge
from ravnest_p2p.transport import Compression, decode_tensor, encode_tensor
from ravnest_p2p.transport.limits import MAX_RING_HELLO_BYTES

__all__ = [
    "CODEC_IDS",
    "ByteReader",
    "ByteWriter",
    "Pacer",
    "PartHeader",
    "all_finite",
    "codec_id",
    "decode_payload",
    "encode_payload",
    "max_payload_bytes",
    "read_ack",
    "read_hello",
    "read_part_header",
    "read_payload_into",
    "write_ack",
    "write_error",
    "write_hello",
    "write_part",
]

_HELLO = struct.Struct("!2sH")
_PART = struct.Struct("!2sBBIIII")
_ACK = struct.Struct("!2sBI")
_VERSION = 1
MAX_HELLO_BYTES = MAX_RING_HELLO_BYTES
_MAX_ERROR_BYTES = 4096
_READ_CHUNK_BYTES = 1 << 20
# lossy codecs other than fp16 go through hivemind's protobuf (stats + quantized bytes): allow its overhead
_CODEC_OVERHEAD_BYTES = 64 << 10

CODEC_IDS = {c: i for i, c in enumerate(Compression)}
# ids of the Δ wire codecs (`deltawire.py`) are kept apart: both enums are StrEnums ("none" == "none")
_CODECS: dict[int, Compression | DeltaCompression] = {i: c for c, i in CODEC_IDS.items()}
_CODECS.update({i: c for c, i in WIRE_CODEC_IDS.items()})


def codec_id(codec: Compression | DeltaCompression) -> int:
    return CODEC_IDS[codec] if isinstance(codec, Compression) else WIRE_CODEC_IDS[codec]


class ByteReader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...

    async def read(self, n: int = -1) -> bytes: ...


class ByteWriter(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PartHeader:
    codec: Compression | DeltaCompression
    step: int
    chunk: int
    part: int
    payload_bytes: int


# ----- sender -> receiver ------------------------------------------------------------------------


def write_hello(writer: ByteWriter, hello: StreamHello) -> None:
    packed = msgpack.packb(hello.model_dump(mode="json"), use_bin_type=True)
    assert len(packed) <= MAX_HELLO_BYTES
    writer.write(_HELLO.pack(b"RH", len(packed)) + packed)


async def read_hello(reader: ByteReader) -> StreamHello:
    """Read and validate the hello.

    Raises:
        InvalidMessage: bad magic, oversized, not msgpack, or not a valid `StreamHello`.
    """
    magic, length = _HELLO.unpack(await reader.readexactly(_HELLO.size))
    if magic != b"RH":
        raise InvalidMessage("not a ring stream (bad magic)")
    if length > MAX_HELLO_BYTES:
        raise PayloadTooLarge(f"hello of {length} bytes")
    try:
        body = msgpack.unpackb(await reader.readexactly(length), raw=False, strict_map_key=True)
        return StreamHello.model_validate(body)
    except ValidationError as exc:
        raise InvalidMessage(f"hello does not validate: {exc.error_count()} errors") from None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise InvalidMessage(f"hello is not msgpack: {type(exc).__name__}") from None


def encode_payload(values: torch.Tensor, codec: Compression) -> bytes | memoryview:
    """The bytes of a contiguous fp32 slice under `codec`: a view of `values` itself when uncompressed.

    The caller must write them before it changes `values`.
    """
    if codec is Compression.NONE:
        return memoryview(values.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    if codec is Compression.FP16:
        return memoryview(values.to(torch.float16).numpy()).cast("B")  # type: ignore[arg-type]
    return encode_tensor(values, codec)


class Pacer:
    """Spaces writes to `bytes_per_s` (no credit for idle time, so no burst after a wait)."""

    def __init__(self, bytes_per_s: float, *, slice_bytes: int = 64 << 10) -> None:
        assert bytes_per_s > 0
        self.bytes_per_s = bytes_per_s
        self.slice_bytes = slice_bytes
        self._next = 0.0

    async def wait(self, nbytes: int) -> None:
        now = time.monotonic()
        self._next = max(self._next, now) + nbytes / self.bytes_per_s
        if self._next > now:
            await asyncio.sleep(self._next - now)


async def write_part(
    writer: ByteWriter, header: PartHeader, payload: bytes | memoryview, pacer: Pacer | None = None
) -> None:
    """Write a part; with `pacer`, its payload in slices spaced to the pacer's rate."""
    assert header.payload_bytes == memoryview(payload).nbytes
    writer.write(
        _PART.pack(
            b"RP",
            _VERSION,
            codec_id(header.codec),
            header.step,
            header.chunk,
            header.part,
            header.payload_bytes,
        )
    )
    if pacer is None:
        writer.write(payload)
        await writer.drain()
        return
    view = memoryview(payload).cast("B")
    for start in range(0, max(len(view), 1), pacer.slice_bytes):
        piece = view[start : start + pacer.slice_bytes]
        writer.write(piece)
        await writer.drain()
        await pacer.wait(len(piece))


async def read_part_header(reader: ByteReader) -> PartHeader | None:
    """The next part header, or None at a clean end of stream.

    Raises:
        InvalidMessage: bad magic, version or codec.
    """
    try:
        raw = await reader.readexactly(_PART.size)
    except EOFError as exc:  # asyncio.IncompleteReadError
        if getattr(exc, "partial", b"") == b"":
            return None
        raise
    magic, version, codec, step, chunk, part, payload_bytes = _PART.unpack(raw)
    if magic != b"RP" or version != _VERSION:
        raise InvalidMessage("not a ring part (bad magic or version)")
    if codec not in _CODECS:
        raise InvalidMessage(f"unknown codec {codec}")
    return PartHeader(_CODECS[codec], step, chunk, part, payload_bytes)


def max_payload_bytes(numel: int, codec: Compression) -> int:
    """The exact payload size for `numel` elements (fp32/fp16), or an upper bound (other codecs)."""
    if codec is Compression.NONE:
        return 4 * numel
    if codec is Compression.FP16:
        return 2 * numel
    return 4 * numel + _CODEC_OVERHEAD_BYTES


async def read_payload_into(reader: ByteReader, buffer: bytearray, size: int) -> memoryview:
    """Read exactly `size` bytes into the front of `buffer` (which the caller reuses) and return them."""
    view = memoryview(buffer)[:size]
    received = 0
    while received < size:
        chunk = await reader.read(min(size - received, _READ_CHUNK_BYTES))
        if not chunk:
            raise EOFError(f"stream ended after {received} of {size} payload bytes")
        view[received : received + len(chunk)] = chunk
        received += len(chunk)
    return view


def decode_payload(payload: memoryview, codec: Compression, numel: int) -> torch.Tensor:
    """A tensor of `numel` fp32 values from the payload (a view of it when uncompressed).

    Raises:
        InvalidMessage: wrong size, shape or dtype.
    """
    if codec is Compression.NONE or codec is Compression.FP16:
        dtype = torch.float32 if codec is Compression.NONE else torch.float16
        if payload.nbytes != numel * (4 if codec is Compression.NONE else 2):
            raise InvalidMessage(f"payload of {payload.nbytes} bytes for {numel} elements")
        tensor = torch.frombuffer(payload, dtype=dtype) if numel else torch.zeros(0, dtype=dtype)
        return tensor.float() if codec is Compression.FP16 else tensor
    tensor = decode_tensor(payload, max_numel=numel, require_finite=False)
    if tensor.dtype != torch.float32 or tuple(tensor.shape) != (numel,):
        raise InvalidMessage(f"got {tensor.dtype} {tuple(tensor.shape)}, want ({numel},) float32")
    return tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN/inf: a sum is finite iff every element is, barring overflow, which the exact check settles."""
    return tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


# ----- receiver -> sender ------------------------------------------------------------------------


def write_ack(writer: ByteWriter, accepted: int) -> None:
    writer.write(_ACK.pack(b"RA", 0, accepted))


def write_error(writer: ByteWriter, code: str, message: str) -> None:
    packed = msgpack.packb({"code": code[:64], "message": message[:1000]}, use_bin_type=True)
    writer.write(_ACK.pack(b"RA", 1, len(packed)) + packed)


async def read_ack(reader: ByteReader) -> tuple[int, dict[str, Any] | None]:
    """(parts accepted so far, None) or (-1, {"code", "message"}) for an error frame.

    Raises:
        InvalidMessage: a malformed frame.
        asyncio.IncompleteReadError: the stream ended.
    """
    magic, kind, value = _ACK.unpack(await reader.readexactly(_ACK.size))
    if magic != b"RA" or kind not in (0, 1):
        raise InvalidMessage("not a ring ack")
    if kind == 0:
        return value, None
    if value > _MAX_ERROR_BYTES:
        raise InvalidMessage("oversized error frame")
    try:
        body = msgpack.unpackb(await reader.readexactly(value), raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        body = None
    if not isinstance(body, dict):
        body = {"code": "invalid_message", "message": "malformed error frame"}
    return -1, {"code": str(body.get("code", "")), "message": str(body.get("message", ""))}
