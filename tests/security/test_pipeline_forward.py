"""Hostile forwards to real stages: refused before any state changes, counted against the sender.

The messages pass every type check (right dtype, rank, sizes, finite values) but mean something a
stage must not act on: labels outside the model's classes, activations that would overflow, ids
outside the window, replays of completed micro-batches, a stale epoch, a stranger's identity.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.runtime.messages import FORWARD, ForwardRequest
from tests.security._pipeline import EPOCH, batches, digest, hostile_pipeline, send, settle

pytestmark = pytest.mark.timeout(240)


async def test_hostile_forwards_are_refused_counted_and_training_finishes(hostile):
    hostile.surface = "rpc:forward"
    async with hostile_pipeline(threshold=40) as p:
        first, middle, last = p.services
        data = batches()
        x, y = data[0]
        act = await asyncio.to_thread(first.executor.predict, x)
        act_last = await asyncio.to_thread(middle.executor.predict, act)
        before = [digest(s) for s in p.services]

        def req(mb: int, epoch: int = EPOCH) -> ForwardRequest:
            return ForwardRequest(epoch=epoch, micro_batch_id=mb, weight_version=0)

        bad_labels = [y + 10, y - 20, torch.full_like(y, 2**40), torch.full_like(y, -1)]
        scales = [1e11, 1e15, 1e30, -1e25]
        far_ids = [10**6, 2**40, 2**62]
        counted = {middle: 0, last: 0}
        for target, sender_rpc, a in ((middle, p.rpcs[0], act), (last, p.rpcs[1], act_last)):
            codes = []
            for i, labels in enumerate(bad_labels):
                codes.append(
                    await send(hostile, sender_rpc, target.rpc.peer_id, FORWARD, req(i), [a, labels])
                )
            for i, scale in enumerate(scales):
                codes.append(
                    await send(hostile, sender_rpc, target.rpc.peer_id, FORWARD, req(i), [a * scale, y])
                )
            for mb in far_ids:
                codes.append(await send(hostile, sender_rpc, target.rpc.peer_id, FORWARD, req(mb), [a, y]))
            counted[target] = len(codes)
            for epoch in (0, 2, 2**40):  # stale: refused, but normal around a re-plan, so not counted
                codes.append(
                    await send(hostile, sender_rpc, target.rpc.peer_id, FORWARD, req(0, epoch), [a, y])
                )
            assert all(code != "ok" for code in codes), codes
            assert target.ledger.refused[sender_rpc.peer_id] == counted[target]
        # a stranger with perfect messages: refused, counted, and excluded past the threshold
        outsider_codes = [
            await send(hostile, p.outsider, middle.rpc.peer_id, FORWARD, req(mb), [act, y])
            for mb in range(45)
        ]
        assert set(outsider_codes) == {"invalid_message", "excluded"}
        assert middle.ledger.is_excluded(p.outsider.peer_id)
        assert middle.executor.in_flight == ()
        assert last.executor.in_flight == ()
        settle(hostile, p, before)
        assert hostile.state_changes == 0

        stats = await first.train(data)  # the stage keeps training and finishes
        assert stats.completed == 12
        assert all(s.failure is None for s in p.services)

        before = [digest(s) for s in p.services]
        replays = [
            await send(hostile, p.rpcs[0], middle.rpc.peer_id, FORWARD, req(mb), [act, y]) for mb in range(12)
        ]
        replays += [
            await send(hostile, p.rpcs[1], last.rpc.peer_id, FORWARD, req(mb), [act_last, y])
            for mb in range(12)
        ]
        assert set(replays) == {"invalid_message"}, replays
        assert last.executor.num_steps == 12  # the replay never reached an optimizer
        settle(hostile, p, before)
    assert hostile.stage_failures == 0
    assert hostile.state_changes == 0
    assert hostile.crashes == 0
