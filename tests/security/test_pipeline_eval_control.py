"""Hostile evaluation traffic and control messages (drop notices, pings, finish) to real stages."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.runtime.messages import (
    DROP,
    EVAL_RESULT,
    FINISH,
    FORWARD,
    PING,
    DropNotice,
    EvalResult,
    FinishRequest,
    ForwardRequest,
    Mode,
    PingRequest,
)
from ravnest_p2p.training.stages import load_dataset
from tests.security._pipeline import EPOCH, JOB, batches, digest, hostile_pipeline, send, settle

pytestmark = pytest.mark.timeout(240)


async def test_eval_results_for_ids_never_issued_and_bad_eval_forwards_change_nothing(hostile):
    hostile.surface = "rpc:eval"
    async with hostile_pipeline(threshold=40) as p:
        first, middle, _last = p.services
        x, y = batches()[0]
        act = await asyncio.to_thread(first.executor.predict, x)
        before = [digest(s) for s in p.services]

        def result(mb: int) -> EvalResult:
            return EvalResult(
                epoch=EPOCH, micro_batch_id=mb, loss_sum=1.0, num_correct=1, num_samples=16, num_targets=16
            )

        codes = [
            await send(hostile, p.rpcs[2], first.rpc.peer_id, EVAL_RESULT, result(mb)) for mb in range(25)
        ]
        codes += [
            await send(hostile, p.outsider, first.rpc.peer_id, EVAL_RESULT, result(mb)) for mb in range(25)
        ]
        assert "ok" not in codes
        assert first.ledger.refused[p.rpcs[2].peer_id] == 0  # a late result is a race, not misbehaviour
        assert first.ledger.is_excluded(p.outsider.peer_id) is False  # 25 < 40
        assert first.ledger.refused[p.outsider.peer_id] == 25

        def eval_req(mb: int) -> ForwardRequest:
            return ForwardRequest(epoch=EPOCH, micro_batch_id=mb, mode=Mode.EVAL, weight_version=0)

        bad = [
            (10**7, act, y),
            (2**62, act, y),
            (3, act, y + 10),
            (4, act * 1e30, y),
            (5, act, torch.full_like(y, -3)),
        ]
        for mb, a, labels in bad * 3:
            code = await send(hostile, p.rpcs[0], middle.rpc.peer_id, FORWARD, eval_req(mb), [a, labels])
            assert code != "ok"
        # an eval request for an id never issued, inside the window: it runs, its result is refused at
        # the first stage (no evaluation pending), and nobody fails
        assert await send(hostile, p.rpcs[0], middle.rpc.peer_id, FORWARD, eval_req(500), [act, y]) == "ok"
        await asyncio.sleep(0)
        settle(hostile, p, before)
        assert hostile.state_changes == 0

        _, held_out = load_dataset(JOB)
        loss, accuracy = await first.evaluate([(held_out.inputs[:64], held_out.labels[:64])])
        assert loss > 0
        assert 0 <= accuracy <= 1
        stats = await first.train(batches())
        assert stats.completed == 12
        settle(hostile, p)
    assert hostile.stage_failures == 0
    assert hostile.crashes == 0


async def test_control_messages_from_strangers_or_for_unknown_micro_batches_change_nothing(hostile):
    hostile.surface = "rpc:control"
    async with hostile_pipeline(threshold=60) as p:
        first, middle, last = p.services
        before = [digest(s) for s in p.services]
        codes = []
        for mb in list(range(10)) + [2**62]:
            notice = DropNotice(epoch=EPOCH, micro_batch_id=mb, reason="x" * 200)
            codes.append(
                await send(hostile, p.rpcs[2], middle.rpc.peer_id, DROP, notice)
            )  # nothing in flight
            codes.append(await send(hostile, p.rpcs[1], first.rpc.peer_id, DROP, notice))
            codes.append(await send(hostile, p.outsider, middle.rpc.peer_id, DROP, notice))
            codes.append(await send(hostile, p.outsider, first.rpc.peer_id, DROP, notice))
        for _ in range(15):
            codes.append(await send(hostile, p.outsider, middle.rpc.peer_id, PING, PingRequest(epoch=EPOCH)))
            codes.append(
                await send(hostile, p.outsider, last.rpc.peer_id, FINISH, FinishRequest(epoch=EPOCH))
            )
            codes.append(await send(hostile, p.rpcs[1], last.rpc.peer_id, FINISH, FinishRequest(epoch=EPOCH)))
        assert "ok" not in codes
        assert not last.finished.is_set()
        # a cluster member's ping is answered (that is how neighbours tell dead from slow)
        assert await send(hostile, p.rpcs[0], middle.rpc.peer_id, PING, PingRequest(epoch=EPOCH)) == "ok"
        hostile.sent -= 1
        settle(hostile, p, before)
        assert hostile.state_changes == 0
        assert middle.ledger.refused[p.outsider.peer_id] >= 26
        stats = await first.train(batches())
        assert stats.completed == 12
        await first.finish()
        settle(hostile, p)
    assert hostile.stage_failures == 0
    assert hostile.crashes == 0
