"""The envelope every RPC message travels in, and the frame that carries it over a byte stream.

Envelope: ``b"RV1" | u32 header length | msgpack header | blobs``. The header is a plain msgpack map
(never pickle); ``header["blobs"]`` lists blob sizes, which must add up to exactly the bytes that follow.
Blobs are tensors encoded by `codec.encode_tensor`. Frame (stream transport only): ``u64 length | bytes``;
the receiver checks the length against its limit *before* reading the body, so an oversized payload
costs it nothing.

A frame's body is read as its bytes arrive, into a buffer that grows with them (at most `_GROWTH` times
what arrived, never the announced length up front: eight bytes announcing 256 MiB cost 64 KiB), under a
deadline for the whole frame (`WireLimits.frame_timeout_s`) and an idle deadline (no byte for
`WireLimits.idle_timeout_s`). The buffer is uninitialised memory (`numpy.empty`): pages the sender never
filled are never touched, and the body is copied once from the stream into it, as before; growth copies
what arrived so far (a third of the frame in all, for a large one).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from ravnest_p2p.errors import InvalidMessage, PayloadTooLarge
from ravnest_p2p.transport.limits import KIB, MAX_HEADER_BYTES, WireLimits

__all__ = [
    "MAX_HEADER_BYTES",
    "Envelope",
    "decode_envelope",
    "encode_envelope",
    "encode_envelope_parts",
    "error_envelope",
    "frame_size",
    "read_frame",
    "read_frame_body",
    "read_frame_length",
    "write_frame",
]

_MAGIC = b"RV1"
_HEADER_LEN = struct.Struct("!I")
_FRAME_LEN = struct.Struct("!Q")
_WRITE_CHUNK_BYTES = 1 << 20
_READ_CHUNK_BYTES = 4 << 20
_FIRST_ALLOC_BYTES = 64 * KIB  # a frame's first buffer; it grows by `_GROWTH` as bytes arrive
_GROWTH = 4
_DEFAULT_LIMITS = WireLimits()


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


def decode_envelope(data: Buffer, *, max_bytes: int) -> Envelope:
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


async def read_frame_length(reader: asyncio.StreamReader, *, timeout_s: float | None) -> int:
    """The next frame's announced length (not yet checked), waiting at most `timeout_s` (None: forever).

    Raises:
        TimeoutError: no complete length in time.
        asyncio.IncompleteReadError: the stream ended.
    """
    async with asyncio.timeout(timeout_s):
        (length,) = _FRAME_LEN.unpack(await reader.readexactly(_FRAME_LEN.size))
    return int(length)


async def read_frame_body(
    reader: asyncio.StreamReader, length: int, *, limits: WireLimits = _DEFAULT_LIMITS
) -> memoryview:
    """Read a frame's `length` body bytes as they arrive; the caller owns the returned buffer.

    The buffer grows with the bytes received (at most `_GROWTH` times them), so memory follows what the
    sender sent, not what it announced. The whole frame has `limits.frame_timeout_s(length)`; the
    stream may go `limits.idle_timeout_s` without a byte (checked to within an eighth of it: the timer
    is moved at most eight times per idle period, not at every read).

    Raises:
        TimeoutError: the frame's deadline or the idle deadline passed.
        asyncio.IncompleteReadError: the stream ended first.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    frame_deadline = start + limits.frame_timeout_s(length)
    idle_s = limits.idle_timeout_s
    buffer = np.empty(min(length, _FIRST_ALLOC_BYTES), dtype=np.uint8)
    view = memoryview(buffer)  # type: ignore[arg-type]  # an ndarray is a buffer
    received = 0
    moved = start
    try:
        async with asyncio.timeout_at(min(frame_deadline, start + idle_s)) as timer:
            while received < length:
                if received == len(view):
                    grown = np.empty(min(length, received * _GROWTH), dtype=np.uint8)
                    grown[:received] = buffer[:received]
                    buffer, view = grown, memoryview(grown)  # type: ignore[arg-type]
                chunk = await reader.read(min(len(view) - received, _READ_CHUNK_BYTES))
                if not chunk:
                    ended = asyncio.IncompleteReadError(b"", length)
                    ended.add_note(f"the stream ended after {received} of {length} frame bytes")
                    raise ended
                view[received : received + len(chunk)] = chunk
                received += len(chunk)
                now = loop.time()
                if now - moved > idle_s / 8:
                    moved = now
                    timer.reschedule(min(frame_deadline, now + idle_s))
    except TimeoutError:
        what = "frame deadline" if loop.time() >= frame_deadline else f"idle {idle_s:.1f}s"
        raise TimeoutError(f"{what}: {received} of {length} frame bytes arrived") from None
    return view


async def read_frame(
    reader: asyncio.StreamReader,
    *,
    max_bytes: int,
    limits: WireLimits = _DEFAULT_LIMITS,
    first_byte_timeout_s: float | None = None,
) -> memoryview:
    """Read one frame; refuse (without reading the body) if it announces more than `max_bytes`.

    Args:
        reader: the stream.
        max_bytes: the largest body accepted.
        limits: the frame and idle deadlines of the body (`read_frame_body`).
        first_byte_timeout_s: how long to wait for the frame to start (None: the caller's deadline;
            a caller awaiting a reply waits for the remote handler, a server for a request does not).

    Raises:
        PayloadTooLarge: the announced length exceeds `max_bytes` (nothing of the body was read).
        TimeoutError, asyncio.IncompleteReadError: see `read_frame_body`.
    """
    length = await read_frame_length(reader, timeout_s=first_byte_timeout_s)
    if length > max_bytes:
        raise PayloadTooLarge(f"frame of {length} bytes exceeds the limit of {max_bytes}", size_bytes=length)
    return await read_frame_body(reader, length, limits=limits)
