"""The envelope every RPC message travels in, and the frame that carries it over a byte stream.

Envelope: ``b"RV1" | u32 header length | msgpack header | blobs``. The header is a plain msgpack map
(never pickle); ``header["blobs"]`` lists blob sizes, which must add up to exactly the bytes that follow.
Blobs are tensors encoded by `codec.encode_tensor`. Frame (stream transport only): ``u64 length | bytes``;
the receiver checks the length against its limit *before* reading the body, so an oversized payload
costs it nothing.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ravnest_p2p.errors import InvalidMessage, PayloadTooLarge

__all__ = [
    "MAX_HEADER_BYTES",
    "Envelope",
    "decode_envelope",
    "encode_envelope",
    "encode_envelope_parts",
    "error_envelope",
    "frame_size",
    "read_frame",
    "write_frame",
]

_MAGIC = b"RV1"
_HEADER_LEN = struct.Struct("!I")
_FRAME_LEN = struct.Struct("!Q")
MAX_HEADER_BYTES = 256 * 1024
_WRITE_CHUNK_BYTES = 1 << 20
_READ_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Envelope:
    """A decoded message: a msgpack header and the raw blobs that follow it."""

    header: dict[str, Any]
    blobs: list[bytes | memoryview] = field(default_factory=list)  # views into the message: no copies


Buffer = bytes | bytearray | memoryview


def encode_envelope(header: dict[str, Any], blobs: Sequence[Buffer | Sequence[Buffer]] = ()) -> bytes:
    """Build an envelope; a blob may be given as a list of pieces, joined here with everything else."""
    return b"".join(encode_envelope_parts(header, blobs))


def encode_envelope_parts(
    header: dict[str, Any], blobs: Sequence[Buffer | Sequence[Buffer]] = ()
) -> list[Buffer]:
    """`encode_envelope` as pieces, for `write_frame`: tensor data is sent from the tensor, never copied."""
    pieces = [[b] if isinstance(b, bytes | bytearray | memoryview) else list(b) for b in blobs]
    full_header = {**header, "blobs": [sum(memoryview(x).nbytes for x in p) for p in pieces]}
    packed = msgpack.packb(full_header, use_bin_type=True)
    if len(packed) > MAX_HEADER_BYTES:
        raise PayloadTooLarge(f"header of {len(packed)} bytes exceeds {MAX_HEADER_BYTES}")
    return [_MAGIC + _HEADER_LEN.pack(len(packed)) + packed, *(x for p in pieces for x in p)]


def error_envelope(code: str, message: str) -> bytes:
    return encode_envelope({"kind": "error", "code": code, "message": message[:2000]})


def decode_envelope(data: bytes | bytearray, *, max_bytes: int) -> Envelope:
    """Parse an envelope, refusing anything malformed or larger than `max_bytes`."""
    if len(data) > max_bytes:
        raise PayloadTooLarge(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    prefix = len(_MAGIC) + _HEADER_LEN.size
    if len(data) < prefix or data[: len(_MAGIC)] != _MAGIC:
        raise InvalidMessage("not a ravnest message (bad magic)")
    (header_len,) = _HEADER_LEN.unpack_from(data, len(_MAGIC))
    if header_len > MAX_HEADER_BYTES or prefix + header_len > len(data):
        raise InvalidMessage("header length out of range")
    try:
        header = msgpack.unpackb(
            data[prefix : prefix + header_len],
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise InvalidMessage(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise InvalidMessage("header is not a map")
    sizes = header.get("blobs", [])
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise InvalidMessage("blob sizes are malformed")
    offset = prefix + header_len
    if offset + sum(sizes) != len(data):
        raise InvalidMessage("blob sizes do not match the message length")
    blobs: list[bytes | memoryview] = []
    view = memoryview(data)
    for size in sizes:
        blobs.append(view[offset : offset + size])
        offset += size
    return Envelope(header=header, blobs=blobs)


def frame_size(data: Buffer | Sequence[Buffer]) -> int:
    """Bytes of a message given whole or as pieces."""
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data).nbytes
    return sum(memoryview(piece).nbytes for piece in data)


async def write_frame(writer: asyncio.StreamWriter, data: Buffer | Sequence[Buffer]) -> None:
    """Write one length-prefixed frame (whole or in pieces) in chunks, respecting back-pressure."""
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else data
    writer.write(_FRAME_LEN.pack(frame_size(data)))
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), _WRITE_CHUNK_BYTES):
            writer.write(view[start : start + _WRITE_CHUNK_BYTES])
            await writer.drain()
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, *, max_bytes: int) -> bytearray:
    """Read one frame; refuse (without reading the body) if it announces more than `max_bytes`.

    The body goes into a buffer of its final size, which the caller owns (decoded tensors may keep using
    it), instead of `readexactly`'s growing buffer and the copy it returns.
    """
    (length,) = _FRAME_LEN.unpack(await reader.readexactly(_FRAME_LEN.size))
    if length > max_bytes:
        raise PayloadTooLarge(f"frame of {length} bytes exceeds the limit of {max_bytes}", size_bytes=length)
    body = bytearray(length)
    view = memoryview(body)
    received = 0
    while received < length:
        chunk = await reader.read(min(length - received, _READ_CHUNK_BYTES))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:received]), length)
        view[received : received + len(chunk)] = chunk
        received += len(chunk)
    return body
