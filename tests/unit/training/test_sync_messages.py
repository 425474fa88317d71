"""sync_backup: one message per owner per step, checked part by part (in-memory transport)."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest
import torch

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.training.sync_runner import SyncBackupRunner
from ravnest_p2p.training.sync_wire import SYNC_PUSH, ReplyKind, ReplyPart, SyncPush, SyncReply
from ravnest_p2p.transport.rpc import CallContext
from tests.unit.training.test_sync_backup import _reference, _runners

pytestmark = pytest.mark.timeout(60)


def _count_pushes(runner: SyncBackupRunner, sent: collections.Counter[tuple[str, str]]) -> None:
    call = runner.rpc.call

    async def counting(peer_id: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        if method is SYNC_PUSH:
            sent[(runner.rpc.peer_id, peer_id)] += 1
        return await call(peer_id, method, *args, **kwargs)

    runner.rpc.call = counting  # type: ignore[method-assign]


async def test_two_shards_per_owner_travel_in_one_message_and_b0_stays_exact() -> None:
    steps = 6
    _, runners = _runners(3, n=3, b=0, max_steps=steps, num_shards=4, owners=("w0", "w1"))
    # dealt by bytes: the 16x32 matrix (2 KB) to one owner, the other three tensors (656 B) to the other
    assert sorted(len(runners[0].layout.shards_of(w)) for w in ("w0", "w1")) == [1, 3]
    sent: collections.Counter[tuple[str, str]] = collections.Counter()
    for runner in runners:
        _count_pushes(runner, sent)
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done and m.step == steps for m in results)
    # one message per remote owner per step (own shards go to the local service, no message)
    assert dict(sent) == {
        (worker, owner): steps for worker in ("w0", "w1", "w2") for owner in ("w0", "w1") if owner != worker
    }
    reference = _reference(runners[0].job, 3, steps)
    for runner in runners:
        for name, expected in reference.items():
            torch.testing.assert_close(runner.params[name].detach(), expected, atol=1e-5, rtol=0)


async def test_a_push_with_one_bad_part_is_refused_whole_and_nothing_is_counted() -> None:
    _, runners = _runners(3, n=3, b=0, max_steps=2, num_shards=4, owners=("w0",))
    owner_runner, sender = runners[0], runners[1]
    service = owner_runner.owners
    await service.serve()
    try:
        shards = sorted(service.owned)
        assert len(shards) == 4
        names = [list(owner_runner.layout.shards[s]) for s in shards]
        good = [[torch.zeros_like(owner_runner.pieces[n]) for n in part] for part in names]

        async def push(parts: list[dict[str, Any]], tensors: list[torch.Tensor]) -> None:
            request = SyncPush.model_validate({"job_id": "sync", "parts": parts, "wait_s": 0})
            context = CallContext(remote_peer_id=sender.rpc.peer_id, method=SYNC_PUSH.name)
            await service.handle_push(request, tensors, context)

        parts = [{"shard": s, "step": 0, "names": n} for s, n in zip(shards, names, strict=True)]
        flat = [t for part in good for t in part]
        bad_last = [*flat[:-1], torch.zeros(3)]
        with pytest.raises(InvalidMessage, match="expected"):
            await push(parts, bad_last)  # the last part's tensor has the wrong shape
        with pytest.raises(InvalidMessage, match="twice"):
            await push([parts[0], parts[0]], good[0] + good[0])
        with pytest.raises(InvalidMessage, match="names for"):
            await push(parts, flat[:-1])
        assert all(service.owned[s].num_pending == 0 and service.owned[s].step == 0 for s in shards)
        await push(parts, flat)  # well-formed: every part counted
        assert all(service.owned[s].num_pending == 1 for s in shards)
    finally:
        await service.aclose()


def test_a_worker_refuses_a_reply_with_a_part_missing_extra_or_pending_with_tensors() -> None:
    _, runners = _runners(3, n=3, b=0, max_steps=2, num_shards=4, owners=("w0",))
    worker = runners[1]
    before = {n: p.detach().clone() for n, p in worker.params.items()}

    def part(shard: int, kind: ReplyKind = ReplyKind.APPLIED) -> tuple[ReplyPart, list[torch.Tensor]]:
        names = worker.layout.shards[shard]
        tensors = [torch.ones_like(worker.pieces[n]) for n in names]
        return ReplyPart(shard=shard, kind=kind, step=1, names=names), tensors

    (p0, t0), (p1, t1), (p2, t2) = part(0), part(1), part(2)
    pending = (ReplyPart(shard=1, kind=ReplyKind.PENDING, step=0, names=p1.names), t1)
    for parts, tensors in [
        ((p0,), t0),  # shard 1 missing
        ((p0, p1, p2), t0 + t1 + t2),  # shard 2 not asked
        ((p0, p0), t0 + t0),  # shard 0 twice
        ((p0, pending[0]), t0 + pending[1]),  # a pending part with tensors
    ]:
        with pytest.raises(InvalidMessage):
            worker._install(SyncReply(parts=parts), tensors, [0, 1])
    assert all(torch.equal(worker.params[n], before[n]) for n in before)
    assert worker.versions == [0] * len(worker.layout.shards)
    worker._install(SyncReply(parts=(p0, p1)), t0 + t1, [0, 1])  # well-formed: installed
    assert worker.versions[:2] == [1, 1]
