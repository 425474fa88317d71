"""Round indices every replica agrees on when rounds outlast the averaging period (`RoundSchedule`)."""

from __future__ import annotations

import asyncio

from ravnest_p2p.averaging import RingMetrics, RoundMetrics, Shard, ShardMap
from ravnest_p2p.training.replicas import ReplicaAverager
from ravnest_p2p.training.round_schedule import RESYNC_SLOTS, RoundSchedule
from ravnest_p2p.utils.aio import TaskOwner


def _metrics(index: int, participants: tuple[str, ...]) -> RoundMetrics:
    ring = RingMetrics("r", 1, participants, attempts=1, time_s=0.1, bytes_sent=0, bytes_received=0)
    return RoundMetrics(round=index, time_s=0.1, bytes_sent=0, bytes_received=0, rings=[ring])


def _bare(period_steps: int) -> ReplicaAverager:
    """A replica averager with only its round scheduling (`_run` is replaced by the test)."""
    replicas = ReplicaAverager.__new__(ReplicaAverager)
    replicas._round, replicas.skipped, replicas.final_done = None, 0, False
    replicas._tasks = TaskOwner("test")
    replicas.period_steps, replicas.final_step, replicas.num_fragments = period_steps, 10**9, 1
    replicas.schedule, replicas.period_s = RoundSchedule(), 0.0
    shard = Shard(index=0, ring_id="r", names=("n",), numels=(1,), owners=("a", "b"), ring=("a", "b"))
    replicas.shard_map = ShardMap(epoch=0, shards=(shard,))
    return replicas


async def _until(predicate, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)


async def test_replicas_at_different_steps_give_a_deferred_round_the_same_index():
    # average every step; a round outlasts several steps and ends at the same moment on both replicas
    # (they finish it together), when one is at step 4 and the other at step 6. The first design gave
    # the deferred round the step's index (4 and 6): the two never met again (lab: 4 of 1062 rounds).
    replicas = {"a": _bare(1), "b": _bare(1)}
    ran: dict[str, list[int]] = {"a": [], "b": []}
    finish: dict[int, asyncio.Event] = {}

    def make_run(who: str):
        async def run(index: int, *, ring_ids: frozenset[str] | None = None) -> RoundMetrics:
            ran[who].append(index)
            await finish.setdefault(index, asyncio.Event()).wait()
            return _metrics(index, ("a", "b"))

        return run

    for who, r in replicas.items():
        r._run = make_run(who)  # type: ignore[method-assign]
        await r.on_step(1)
    for step in range(2, 5):
        await replicas["a"].on_step(step)
    for step in range(2, 7):
        await replicas["b"].on_step(step)
    await _until(lambda: ran["a"] == ran["b"] == [1])
    finish.setdefault(1, asyncio.Event()).set()
    await _until(lambda: len(ran["a"]) == len(ran["b"]) == 2)
    assert ran["a"] == ran["b"] == [1, 2]
    # still in lockstep: both are due again while round 2 runs, and run round 3 after it
    await replicas["a"].on_step(5)
    await replicas["b"].on_step(7)
    finish.setdefault(2, asyncio.Event()).set()
    await _until(lambda: len(ran["a"]) == len(ran["b"]) == 3)
    assert ran["a"] == ran["b"] == [1, 2, 3]
    finish.setdefault(3, asyncio.Event()).set()
    await _until(lambda: all(r._round is not None and r._round.done() for r in replicas.values()))
    # idle again: the next round takes the period's index (the step), as replicas that step alike agree
    await replicas["a"].on_step(9)
    await _until(lambda: ran["a"][-1] == 9)
    for r in replicas.values():
        finish.setdefault(9, asyncio.Event()).set()
        await r._tasks.aclose()


def test_schedule_defers_one_round_counts_the_rest_as_skipped_and_never_reuses_an_index():
    schedule = RoundSchedule()
    assert schedule.due(5, busy=False) == 5
    assert schedule.due(6, busy=True) is None  # deferred
    assert schedule.due(7, busy=True) is None  # adds nothing
    assert schedule.skipped == 1
    assert schedule.finished(complete=True, resync_index=10**9) == 6  # the next index, not the newest (7)
    assert schedule.finished(complete=True, resync_index=10**9) is None  # nothing came due meanwhile
    assert schedule.due(6, busy=False) == 7  # an index at or below the last one is never reused
    assert schedule.due(12, busy=False) == 12
    # a member missing and nothing deferred (periods longer than rounds): the step index goes on
    assert schedule.finished(complete=False, resync_index=10**9) is None
    assert schedule.due(13, busy=False) == 13


def test_out_of_phase_the_deferred_round_takes_the_clocks_index_at_once():
    schedule = RoundSchedule()
    assert schedule.due(9, busy=False) == 9
    assert schedule.due(10, busy=True) is None
    assert schedule.finished(complete=False, resync_index=1000 * RESYNC_SLOTS) == 1000 * RESYNC_SLOTS
    assert schedule.due(13, busy=False) == 1000 * RESYNC_SLOTS + 1  # then in lockstep, never below
    assert schedule.due(14, busy=True) is None
    assert schedule.finished(complete=False, resync_index=1000 * RESYNC_SLOTS) == 1000 * RESYNC_SLOTS + 2
    schedule.new_epoch()  # new rings: back to the step index, as a replica new to them takes
    assert schedule.due(20, busy=False) == 20


async def test_replicas_out_of_phase_take_the_same_wall_clock_index(monkeypatch):
    # each ran its first round alone (steps apart: 1 and 7) with another due meanwhile; the next
    # rounds, started as their first ones end, take the clock's index: the same at both
    monkeypatch.setattr("ravnest_p2p.training.replicas.time.time", lambda: 2001.0)
    replicas = {"a": _bare(1), "b": _bare(1)}
    ran: dict[str, list[int]] = {"a": [], "b": []}

    def make_run(who: str):
        async def run(index: int, *, ring_ids: frozenset[str] | None = None) -> RoundMetrics:
            ran[who].append(index)
            if len(ran[who]) == 1:
                await replicas[who].on_step(index + 1)  # due meanwhile
                return _metrics(index, (who,))
            return _metrics(index, ("a", "b"))

        return run

    for who, r in replicas.items():
        r._run = make_run(who)  # type: ignore[method-assign]
    await replicas["a"].on_step(1)
    await replicas["b"].on_step(7)
    await _until(lambda: len(ran["a"]) == len(ran["b"]) == 2)
    assert ran["a"] == [1, 1000 * RESYNC_SLOTS]  # 2001 s // RESYNC_S (2 s) = 1000
    assert ran["b"] == [7, 1000 * RESYNC_SLOTS]
    for r in replicas.values():
        await r._tasks.aclose()
