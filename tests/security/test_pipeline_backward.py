"""Hostile backwards to real stages, before, during and after training.

During training the next stage's own identity sends garbage gradients (finite, right shape, far too
large) for whatever micro-batches are in flight: each one is refused, the micro-batch is dropped (its
stash released), a drop notice walks back to the first stage, which re-issues it; training finishes.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.runtime.messages import BACKWARD, BackwardRequest
from tests.security._pipeline import EPOCH, batches, digest, hostile_pipeline, send, settle

pytestmark = pytest.mark.timeout(240)


async def test_hostile_backwards_drop_micro_batches_but_training_finishes(hostile):
    hostile.surface = "rpc:backward"
    async with hostile_pipeline(threshold=200) as p:
        first, middle, last = p.services
        data = batches()
        batch = data[0][0].shape[0]
        grad_middle = torch.ones(batch, *last.executor.input_spec.shape)  # what the middle stage outputs
        grad_first = torch.ones(batch, *middle.executor.input_spec.shape)
        before = [digest(s) for s in p.services]

        def req(mb: int, epoch: int = EPOCH) -> BackwardRequest:
            return BackwardRequest(epoch=epoch, micro_batch_id=mb, loss=1.0)

        codes = []
        for target, sender, grad in ((middle, p.rpcs[2], grad_middle), (first, p.rpcs[1], grad_first)):
            for mb in (0, 1, 5, 11, 10**6, 2**62):  # nothing is in flight: every one is unknown here
                codes.append(await send(hostile, sender, target.rpc.peer_id, BACKWARD, req(mb), [grad]))
                codes.append(
                    await send(hostile, sender, target.rpc.peer_id, BACKWARD, req(mb), [grad * 1e30])
                )
            codes.append(await send(hostile, sender, target.rpc.peer_id, BACKWARD, req(0), [grad, grad]))
            codes.append(await send(hostile, sender, target.rpc.peer_id, BACKWARD, req(0, EPOCH + 1), [grad]))
            for mb in range(10):
                codes.append(await send(hostile, p.outsider, target.rpc.peer_id, BACKWARD, req(mb), [grad]))
        assert "ok" not in codes
        assert middle.ledger.refused[p.outsider.peer_id] == 10
        settle(hostile, p, before)
        assert hostile.state_changes == 0

        stop = asyncio.Event()
        garbage_sent = 0

        async def garbage_gradients() -> None:
            nonlocal garbage_sent
            # until one lands before the real backward of its micro-batch (a race that a busy host often
            # loses: the real one arrives first and the garbage is refused as late), at most 60
            while not stop.is_set() and middle.stats.dropped == 0 and garbage_sent < 60:
                in_flight = middle.executor.in_flight
                if in_flight:
                    mb = in_flight[-1]
                    await send(
                        hostile, p.rpcs[2], middle.rpc.peer_id, BACKWARD, req(mb), [grad_middle * 1e30]
                    )
                    garbage_sent += 1
                await asyncio.sleep(0.005)

        attacker = asyncio.create_task(garbage_gradients())
        try:
            stats = await first.train(data)
        finally:
            stop.set()
            await attacker
        assert garbage_sent > 0
        assert stats.completed + stats.skipped == 12  # every batch trained, or re-issued and then skipped
        assert middle.stats.dropped > 0
        assert stats.reissued > 0
        assert all(s.failure is None for s in p.services)
        assert all(s.executor.in_flight == () for s in p.services)  # dropped stash released everywhere

        before = [digest(s) for s in p.services]
        replays = [
            await send(hostile, p.rpcs[2], middle.rpc.peer_id, BACKWARD, req(mb), [grad_middle])
            for mb in range(20)
        ]
        assert set(replays) == {"invalid_message"}
        settle(hostile, p, before)
    assert hostile.stage_failures == 0
    assert hostile.state_changes == 0
    assert hostile.crashes == 0
