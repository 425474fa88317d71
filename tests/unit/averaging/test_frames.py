"""The ring's framing: round trips, and malformed frames refused before anything is allocated."""

import asyncio
import struct
import time

import msgpack
import pytest
import torch

from ravnest_p2p.averaging.frames import (
    Pacer,
    PartHeader,
    all_finite,
    decode_payload,
    encode_payload,
    read_ack,
    read_hello,
    read_part_header,
    write_ack,
    write_error,
    write_hello,
    write_part,
)
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.errors import InvalidMessage, PayloadTooLarge
from ravnest_p2p.transport import Compression


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += memoryview(data).cast("B")

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reader(self) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(self.data))
        reader.feed_eof()
        return reader


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


HELLO = StreamHello(ring_id="e1/s0/x", epoch=1, round=2, attempt=0, members_digest="d" * 16)


async def test_round_trip_of_hello_parts_and_acks():
    sink = Sink()
    write_hello(sink, HELLO)
    values = torch.randn(1000)
    for codec in (Compression.NONE, Compression.FP16, Compression.MEANSTD16):
        payload = encode_payload(values, codec)
        await write_part(sink, PartHeader(codec, 3, 1, 7, memoryview(payload).nbytes), payload)
    reader = sink.reader()
    assert await read_hello(reader) == HELLO
    for codec, tol in ((Compression.NONE, 0), (Compression.FP16, 1e-3), (Compression.MEANSTD16, 1e-2)):
        header = await read_part_header(reader)
        assert (header.codec, header.step, header.chunk, header.part) == (codec, 3, 1, 7)
        buffer = bytearray(header.payload_bytes)
        body = await reader.readexactly(header.payload_bytes)
        buffer[:] = body
        decoded = decode_payload(memoryview(buffer), codec, 1000)
        torch.testing.assert_close(decoded, values, atol=tol * 4, rtol=tol)
    assert await read_part_header(reader) is None  # clean end of stream
    acks = Sink()
    write_ack(acks, 5)
    write_error(acks, "wrong_step", "no step 9")
    reader = acks.reader()
    assert await read_ack(reader) == (5, None)
    assert await read_ack(reader) == (-1, {"code": "wrong_step", "message": "no step 9"})


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"XX\x00\x02{}", InvalidMessage),  # bad magic
        (b"RH\xff\xff", PayloadTooLarge),  # announced length over the cap: nothing read
        (b"RH\x00\x01\xc1", InvalidMessage),  # not msgpack
        (b"RH" + struct.pack("!H", 3) + msgpack.packb([1, 2]), InvalidMessage),  # not a map
        (b"RH" + struct.pack("!H", 10) + msgpack.packb({"ring_id": 5}), InvalidMessage),  # invalid model
    ],
)
async def test_malformed_hello_is_refused(raw, error):
    with pytest.raises(error):
        await read_hello(reader_of(raw))


async def test_malformed_part_header_is_refused():
    good = struct.pack("!2sBBIIII", b"RP", 1, 0, 0, 0, 0, 4)
    with pytest.raises(InvalidMessage):
        await read_part_header(reader_of(b"RX" + good[2:]))
    with pytest.raises(InvalidMessage):
        await read_part_header(reader_of(good[:2] + b"\x09" + good[3:]))  # unknown version
    with pytest.raises(InvalidMessage):
        await read_part_header(reader_of(good[:3] + b"\x63" + good[4:]))  # unknown codec
    with pytest.raises(asyncio.IncompleteReadError):
        await read_part_header(reader_of(good[:7]))  # cut mid-header


def test_payload_of_the_wrong_size_or_values():
    with pytest.raises(InvalidMessage):
        decode_payload(memoryview(bytearray(12)), Compression.NONE, 4)
    with pytest.raises(InvalidMessage):
        decode_payload(memoryview(bytearray(6)), Compression.FP16, 4)
    assert not all_finite(torch.tensor([1.0, float("inf")]))
    assert not all_finite(torch.tensor([float("nan")]))
    assert all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the values are finite


async def test_pacer_spaces_writes_to_its_rate_without_credit_for_idle_time():
    pacer = Pacer(1_000_000.0)
    started = time.monotonic()
    for _ in range(5):
        await pacer.wait(20_000)  # 5 x 20 ms
    assert 0.09 <= time.monotonic() - started < 0.5
    await asyncio.sleep(0.1)  # idle: no burst allowed afterwards
    started = time.monotonic()
    await pacer.wait(20_000)
    assert time.monotonic() - started >= 0.015
