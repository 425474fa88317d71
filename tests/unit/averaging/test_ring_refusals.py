"""Bad ring messages are refused with an error reply and leave the receiver's accumulator untouched."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig
from ravnest_p2p.averaging.messages import RING_GATHER, RING_REDUCE, PartAck, PartMessage
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.errors import RemoteError
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils.aio import wait_until
from tests.unit.averaging.helpers import SHAPES, replica

ENTRIES = [(n, int(torch.Size(s).numel())) for n, s in SHAPES.items()]


async def test_bad_parts_are_refused_without_touching_state():
    shard_map = build_shard_map([[("p0", ENTRIES)], [("p1", ENTRIES)], [("p2", ENTRIES)]], epoch=7)
    (shard,) = shard_map.shards
    left, me, right = shard.ring
    net = FakeNetwork()
    server = RingAllReduce(RpcEndpoint(net.create(me), "run"), RingConfig(step_timeout_s=1.5))
    await server.start()
    sender = RpcEndpoint(net.create(left), "run")
    stranger = RpcEndpoint(net.create(right), "run")

    async def accept_all(msg, tensors, ctx):
        return PartAck()

    await stranger.serve(RING_REDUCE, accept_all)
    await stranger.serve(RING_GATHER, accept_all)
    values = replica(0)
    round_task = asyncio.create_task(server.all_reduce(shard_map, values, round_index=4))
    await wait_until(lambda: shard.ring_id in server._sessions and server._sessions[shard.ring_id].running, 2)
    session = server._sessions[shard.ring_id]

    def good(step: int) -> tuple[PartMessage, torch.Tensor]:
        chunk = session.recv_chunk(step)
        lo, hi = session.part_bounds(chunk, 0)
        msg = PartMessage(
            ring_id=shard.ring_id,
            epoch=7,
            round=4,
            attempt=0,
            members_digest=session.digest,
            step=step,
            chunk=chunk,
            part=0,
        )
        return msg, torch.zeros(hi - lo) if step < 2 else torch.full((hi - lo,), 3.0)

    msg, tensor = good(0)
    bad = [
        ("stale_round", RING_REDUCE, msg.model_copy(update={"round": 3}), tensor, sender),
        ("stale_epoch", RING_REDUCE, msg.model_copy(update={"epoch": 6}), tensor, sender),
        ("wrong_step", RING_GATHER, msg, tensor, sender),
        ("wrong_step", RING_REDUCE, msg.model_copy(update={"step": 9}), tensor, sender),
        ("wrong_chunk", RING_REDUCE, msg.model_copy(update={"chunk": (msg.chunk + 1) % 3}), tensor, sender),
        ("wrong_part", RING_REDUCE, msg.model_copy(update={"part": 1}), tensor, sender),
        ("wrong_shape", RING_REDUCE, msg, torch.zeros(tensor.numel() + 1), sender),
        ("wrong_shape", RING_REDUCE, msg, tensor.double(), sender),
        ("codec_error", RING_REDUCE, msg, torch.full_like(tensor, float("nan")), sender),
        ("wrong_sender", RING_REDUCE, msg, tensor, stranger),
        (
            "membership_mismatch",
            RING_REDUCE,
            msg.model_copy(update={"members_digest": "x" * 16}),
            tensor,
            sender,
        ),
    ]
    before = session.acc.clone()
    for code, method, message, payload, via in bad:
        with pytest.raises(RemoteError) as err:
            await via.call(me, method, message, tensors=[payload], timeout_s=2)
        assert err.value.code == code, (code, err.value)
        assert torch.equal(session.acc, before)
    # an unknown ring is buffered (bounded), then refused
    unknown = msg.model_copy(update={"ring_id": "e7/s9/nothere"})
    waiting = asyncio.create_task(sender.call(me, RING_REDUCE, unknown, tensors=[tensor], timeout_s=5))
    # the real parts go through, a duplicate is refused
    for step in range(session.num_steps):
        message, payload = good(step)
        await sender.call(
            me, RING_REDUCE if step < 2 else RING_GATHER, message, tensors=[payload], timeout_s=2
        )
        if step == 0:
            with pytest.raises(RemoteError) as err:
                await sender.call(me, RING_REDUCE, message, tensors=[payload], timeout_s=2)
            assert err.value.code == "duplicate"
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
    with pytest.raises(RemoteError) as err:
        await waiting
    assert err.value.code == "not_ready"
    await server.aclose()
