"""Bad ring streams are refused with an error frame and leave the receiver's accumulator untouched."""

import asyncio
import contextlib
import time

import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig
from ravnest_p2p.averaging.frames import PartHeader, read_ack, read_hello, write_hello, write_part
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import Compression, FakeNetwork, RpcEndpoint
from ravnest_p2p.utils.aio import wait_until
from tests.unit.averaging.helpers import SHAPES, replica

ENTRIES = [(n, int(torch.Size(s).numel())) for n, s in SHAPES.items()]
NAME = "ravnest/run/ring_parts"


async def accept_all(sender, reader, writer):
    """A right neighbour that acknowledges whatever arrives."""
    await read_hello(reader)
    count = 0
    with contextlib.suppress(EOFError, ConnectionError):
        while True:
            raw = await reader.readexactly(20)
            await reader.readexactly(int.from_bytes(raw[16:20], "big"))
            count += 1
            writer.write(b"RA\x00" + count.to_bytes(4, "big"))
    writer.close()


async def send(streams, me, hello, parts, *, raw_hello=None):
    """Open a stream, send `parts`, return the error code of the reply (None if all were acked)."""
    reader, writer = await streams.open(me, NAME)
    if raw_hello is not None:
        writer.write(raw_hello)
    else:
        write_hello(writer, hello)
    with contextlib.suppress(ConnectionError):
        for header, payload in parts:
            await write_part(writer, header, payload)
    acked = 0
    try:
        while acked < max(1, len(parts)):  # with no parts, expect the refusal of the hello
            acked, error = await asyncio.wait_for(read_ack(reader), 3)
            if error is not None:
                return error["code"]
        return None
    finally:
        writer.close()


async def test_bad_streams_and_parts_are_refused_without_touching_state():
    shard_map = build_shard_map([[("p0", ENTRIES)], [("p1", ENTRIES)], [("p2", ENTRIES)]], epoch=7)
    (shard,) = shard_map.shards
    left, me, right = shard.ring
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    config = RingConfig(step_timeout_s=1.5)
    server = RingAllReduce(RpcEndpoint(net.create(me), "run"), config, streams=hub.streams(me))
    await server.start()
    net.create(left)
    sender, stranger = hub.streams(left), hub.streams(right)
    net.create(right)
    await stranger.serve(NAME, accept_all)
    values = replica(0)
    round_task = asyncio.create_task(server.all_reduce(shard_map, values, round_index=4))
    await wait_until(lambda: shard.ring_id in server._sessions and server._sessions[shard.ring_id].running, 2)
    session = server._sessions[shard.ring_id]
    hello = StreamHello(ring_id=shard.ring_id, epoch=7, round=4, attempt=0, members_digest=session.digest)

    def part(at: int, *, fill: float | None = None, delta: int = 0, **changes):
        chunk = session.recv_chunk(at)
        lo, hi = session.part_bounds(chunk, 0)
        value = fill if fill is not None else (0.0 if at < 2 else 3.0)
        payload = memoryview(torch.full((hi - lo + delta,), value).numpy()).cast("B")
        fields = {"codec": Compression.NONE, "step": at, "chunk": chunk, "part": 0, **changes}
        return PartHeader(payload_bytes=payload.nbytes, **fields), payload

    bad = [
        ("stale_round", sender, hello.model_copy(update={"round": 3}), [part(0)]),
        ("stale_epoch", sender, hello.model_copy(update={"epoch": 6}), [part(0)]),
        ("membership_mismatch", sender, hello.model_copy(update={"members_digest": "x" * 16}), [part(0)]),
        ("chunks_mismatch", sender, hello.model_copy(update={"chunks_digest": "y" * 16}), [part(0)]),
        ("wrong_sender", stranger, hello, [part(0)]),
        ("wrong_step", sender, hello, [part(0, step=9)]),
        ("wrong_chunk", sender, hello, [part(0, chunk=(session.recv_chunk(0) + 1) % 3)]),
        ("wrong_part", sender, hello, [part(0, part=1)]),
        ("wrong_shape", sender, hello, [part(0, delta=1)]),
        ("wrong_codec", sender, hello, [part(0, codec=Compression.FP16)]),
        ("non_finite", sender, hello, [part(0, fill=float("nan"))]),
    ]
    before = session.acc.clone()
    for code, via, message, parts in bad:
        assert await send(via, me, message, parts) == code, code
        assert torch.equal(session.acc, before)
    assert await send(sender, me, None, [], raw_hello=b"XX\x00\x02{}") == "invalid_message"
    assert await send(sender, me, None, [], raw_hello=b"RH\xff\xff") == "payload_too_large"
    assert torch.equal(session.acc, before)
    # an unknown ring waits (bounded), then is refused
    unknown = asyncio.create_task(
        send(sender, me, hello.model_copy(update={"ring_id": "e7/s9/x"}), [part(0)])
    )
    # the real parts go through; a duplicate is refused
    assert await send(sender, me, hello, [part(0)]) is None
    assert await send(sender, me, hello, [part(0)]) == "duplicate"
    assert await send(sender, me, hello, [part(step) for step in range(1, session.num_steps)]) is None
    averaged, metrics = await asyncio.wait_for(round_task, 5)
    assert metrics.rings[0].participants == shard.ring
    flat = torch.cat([averaged[n].reshape(-1) for n in shard.names])
    local = torch.cat([values[n].reshape(-1) for n in shard.names])
    own = (session.position + 1) % 3
    bounds = [k * shard.numel // 3 for k in range(4)]
    for chunk in range(3):
        lo, hi = bounds[chunk], bounds[chunk + 1]
        expected = local[lo:hi] / 3 if chunk == own else torch.ones(hi - lo)
        torch.testing.assert_close(flat[lo:hi], expected)
    assert await unknown == "not_ready"
    await server.aclose()
    await hub.aclose()


async def test_a_neighbour_that_stops_reading_fails_the_attempt_by_the_step_deadline():
    entries = [("0.weight", 1 << 16)]
    shard_map = build_shard_map([[("a", entries)], [("b", entries)]], epoch=1)
    net = FakeNetwork()
    hub = MemoryStreamHub(net, capacity_bytes=4096)
    config = RingConfig(part_size_bytes=64 << 10, step_timeout_s=0.5, probe_timeout_s=0.2)
    server = RingAllReduce(RpcEndpoint(net.create("a"), "run"), config, streams=hub.streams("a"))
    await server.start()
    net.create("b")
    stalled = asyncio.Event()

    async def never_reads(sender, reader, writer):
        stalled.set()
        await asyncio.Event().wait()  # alive, holds the stream, reads nothing (cancelled by hub.aclose)

    await hub.streams("b").serve(NAME, never_reads)
    values = {"0.weight": torch.randn(1 << 16)}
    started = time.monotonic()
    averaged, metrics = await asyncio.wait_for(server.all_reduce(shard_map, values, round_index=0), 10)
    elapsed = time.monotonic() - started
    assert stalled.is_set()
    assert config.step_timeout_s <= elapsed < 3 * config.step_timeout_s + 1
    assert metrics.rings[0].participants == ("a",)
    assert torch.equal(averaged["0.weight"], values["0.weight"])
    await server.aclose()
    await hub.aclose()
