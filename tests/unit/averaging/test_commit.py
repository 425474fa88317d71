"""The ring's commit rule (`commit.py`) on the in-memory transport: who serves a held mean, and to whom."""

import asyncio
import logging

import pytest
import torch

from ravnest_p2p.averaging import RingConfig
from ravnest_p2p.averaging.commit import _checked, fetch_result, result_slice
from ravnest_p2p.averaging.messages import ResultReply, ResultRequest
from ravnest_p2p.averaging.session import RingSession
from ravnest_p2p.errors import InvalidMessage
from tests.unit.averaging.helpers import fake_swarm, owned, replica

PARTS = RingConfig(part_size_bytes=1024, step_timeout_s=1.0, probe_timeout_s=0.5)


async def holding(members=("a", "b", "c"), me="a", numel=10) -> RingSession:
    session = RingSession(ring_id="r", epoch=1, round_index=4, me=me, numel=numel, part_numel=4)
    session.start_attempt(0, members, torch.arange(numel, dtype=torch.float32) * 3)
    return session


def request(**update) -> ResultRequest:
    fields = {"ring_id": "r", "epoch": 1, "round": 4, "attempt": 0, "offset": 2, "numel": 4, **update}
    return ResultRequest(**fields)


async def test_a_held_mean_is_served_to_members_of_its_attempt_only():
    session = await holding()
    assert session.holds == -1
    assert result_slice(session, request(), "b") is None
    for fut in session._received.values():
        fut.set_result(True)  # every part arrived: complete, still waiting for acks
    assert session.holds == 0
    before = result_slice(session, request(), "b")
    mean = session.average()
    assert torch.equal(before, mean[2:6])  # served from the sum before `average`: the same bits
    session.finish(done=True)
    assert torch.equal(result_slice(session, request(), "c"), mean[2:6])
    assert result_slice(session, request(attempt=1), "b") is None
    assert result_slice(session, request(round=5), "b") is None
    with pytest.raises(InvalidMessage):
        result_slice(session, request(), "stranger")
    with pytest.raises(InvalidMessage):
        result_slice(session, request(offset=8), "b")
    session.release()
    assert session.holds == -1
    assert result_slice(session, request(), "b") is None


async def test_a_member_of_the_ring_left_out_of_the_attempt_may_fetch_its_mean_a_stranger_may_not():
    session = await holding(members=("a", "b"))
    session.ring = ("a", "b", "late")
    for fut in session._received.values():
        fut.set_result(True)
    mean = session.average()
    assert torch.equal(result_slice(session, request(), "late"), mean[2:6])
    with pytest.raises(InvalidMessage):
        result_slice(session, request(), "stranger")


def test_a_fetched_slice_is_checked():
    good = torch.ones(4)
    assert torch.equal(_checked(ResultReply(available=True), [good], 4), good)
    for reply, tensors in [
        (ResultReply(available=False), []),
        (ResultReply(available=True), [torch.ones(3)]),
        (ResultReply(available=True), [torch.ones(4, dtype=torch.float64)]),
        (ResultReply(available=True), [torch.tensor([1.0, float("nan"), 0.0, 0.0])]),
    ]:
        with pytest.raises(InvalidMessage):
            _checked(reply, tensors, 4)


async def test_a_member_fetches_the_mean_from_a_holder_over_rpc():
    _net, shard_map, servers, _ = await fake_swarm(3, PARTS)
    shard = max(shard_map.shards, key=lambda s: len(s.owners))
    holder, fetcher, *_ = shard.owners

    def started(me: str, values: torch.Tensor) -> RingSession:
        session = RingSession(
            ring_id=shard.ring_id,
            epoch=shard_map.epoch,
            round_index=0,
            me=me,
            numel=shard.numel,
            part_numel=64,
        )
        session.start_attempt(0, shard.owners, values)
        return session

    held = started(holder, torch.randn(shard.numel))
    mean = held.adopt(torch.randn(shard.numel))
    servers[holder]._sessions[shard.ring_id] = held
    mine = started(fetcher, torch.zeros(shard.numel))
    fetched = await fetch_result(servers[fetcher].endpoint, mine, ["gone", holder], PARTS)
    assert fetched is not None
    assert torch.equal(fetched, mean)
    mine.start_attempt(1, shard.owners, torch.zeros(shard.numel))  # an attempt nobody holds
    assert await fetch_result(servers[fetcher].endpoint, mine, [holder], PARTS) is None


@pytest.mark.parametrize("phase", ["gather", "last_step", "complete"])
async def test_every_survivor_applies_the_same_mean_when_a_member_dies_late(phase, monkeypatch, caplog):
    net, shard_map, servers, cluster_of = await fake_swarm(3, PARTS)
    net.delay_s = 0.001
    inputs = [replica(s) for s in range(3)]
    victim = next(p for p, c in cluster_of.items() if c == 1)
    largest = max(shard_map.shards_of(victim), key=lambda s: s.numel)
    killed = []
    accept = RingSession.accept

    def accept_then_maybe_die(self, step, part, tensor):
        accept(self, step, part, tensor)
        if self.me != victim or self.ring_id != largest.ring_id or killed:
            return
        arrived = {s for (s, _), f in self._received.items() if f.done() and f.result()}
        last = self.num_steps - 1
        due = {
            "gather": any(s >= self.size - 1 for s in arrived),
            "last_step": all(f.done() for (s, _), f in self._received.items() if s < last),
            "complete": self.complete,
        }[phase]
        if due:
            killed.append(step)
            net.kill(victim)

    monkeypatch.setattr(RingSession, "accept", accept_then_maybe_die)
    caplog.set_level(logging.INFO, logger="ravnest_p2p.averaging")
    results = dict(
        zip(
            servers,
            await asyncio.gather(
                *(
                    servers[p].all_reduce(
                        shard_map, owned(shard_map, p, inputs[cluster_of[p]]), round_index=0
                    )
                    for p in servers
                )
            ),
            strict=True,
        )
    )
    assert killed
    for shard in shard_map.shards:
        alive = [p for p in shard.owners if p != victim]
        rings = [next(r for r in results[p][1].rings if r.ring_id == shard.ring_id) for p in alive]
        assert len({r.participants for r in rings}) == 1, [r.participants for r in rings]
        for n in shard.names:
            assert all(torch.equal(results[p][0][n], results[alive[0]][0][n]) for p in alive)
