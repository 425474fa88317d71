"""Bad Δ parts are refused with an error frame and leave the receiver's accumulator untouched."""

import asyncio
import struct

import torch

from ravnest_p2p.averaging import DeltaCompression, RingAllReduce, RingConfig
from ravnest_p2p.averaging.deltawire import WireCodec
from ravnest_p2p.averaging.frames import PartHeader
from ravnest_p2p.averaging.messages import StreamHello
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import Compression, FakeNetwork, RpcEndpoint
from ravnest_p2p.utils.aio import wait_until
from tests.unit.averaging.helpers import replica
from tests.unit.averaging.test_ring_refusals import ENTRIES, NAME, accept_all, send

WIRE = WireCodec(DeltaCompression.INT8, 64)


async def test_bad_delta_parts_are_refused_and_good_ones_average():
    shard_map = build_shard_map([[("p0", ENTRIES)], [("p1", ENTRIES)], [("p2", ENTRIES)]], epoch=7)
    (shard,) = shard_map.shards
    left, me, right = shard.ring
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    server = RingAllReduce(
        RpcEndpoint(net.create(me), "run"), RingConfig(step_timeout_s=1.5), streams=hub.streams(me)
    )
    await server.start()
    net.create(left)
    net.create(right)
    sender = hub.streams(left)
    await hub.streams(right).serve(NAME, accept_all)
    values = {n: 0.01 * t for n, t in replica(0).items()}
    round_task = asyncio.create_task(server.all_reduce(shard_map, values, round_index=4, wire=WIRE))
    await wait_until(lambda: shard.ring_id in server._sessions and server._sessions[shard.ring_id].running, 2)
    session = server._sessions[shard.ring_id]
    hello = StreamHello(
        ring_id=shard.ring_id, epoch=7, round=4, attempt=0, members_digest=session.digest, codec=WIRE.label
    )

    def part(at: int, *, payload: bytes | None = None, **changes):
        chunk = session.recv_chunk(at)
        lo, hi = session.part_bounds(chunk, 0)
        if payload is None:
            payload = WIRE.encode(torch.full((hi - lo,), 0.0 if at < 2 else 0.5))
        fields = {"codec": DeltaCompression.INT8, "step": at, "chunk": chunk, "part": 0, **changes}
        return PartHeader(payload_bytes=len(payload), **fields), payload

    good = part(0)[1]
    nan_scale = struct.pack("<f", float("nan")) + good[4:]
    bad_code = bytearray(good)
    bad_code[-1] = 0x80  # -128
    bad = [
        ("wrong_codec", hello.model_copy(update={"codec": ""}), [part(0)]),  # an fp32 ring's stream
        ("wrong_codec", hello.model_copy(update={"codec": "int8/1024"}), [part(0)]),  # another block
        ("wrong_codec", hello, [part(0, codec=Compression.NONE)]),
        ("wrong_codec", hello, [part(0, codec=DeltaCompression.INT4)]),
        ("wrong_shape", hello, [part(0, payload=good + b"\x00")]),  # the size is the receiver's
        ("wrong_shape", hello, [part(0, payload=good[:-1])]),
        ("wrong_shape", hello, [part(0, payload=nan_scale)]),
        ("wrong_shape", hello, [part(0, payload=bytes(bad_code))]),
    ]
    before = session.acc.clone()
    for code, message, parts in bad:
        assert await send(sender, me, message, parts) == code, code
        assert torch.equal(session.acc, before)
    assert await send(sender, me, hello, [part(step) for step in range(session.num_steps)]) is None
    _, metrics = await asyncio.wait_for(round_task, 5)
    assert metrics.rings[0].participants == shard.ring
    assert metrics.bytes_received == sum(len(part(s)[1]) for s in range(session.num_steps))
    await server.aclose()
    await hub.aclose()
