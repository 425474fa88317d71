"""The commit rule over real daemons: a member's daemon SIGKILLed at each phase of an outer sync.

3 clusters x 2 stages (`test_rings_real`'s swarm), an `OuterAverager` per stage owner (int8 Δ on the
wire, momentum in use). Round 1: the victim's daemon is killed while its largest ring is in the
reduce-scatter, in the all-gather, or once it holds the whole mean (the commit point: its neighbours may
still be finishing). The survivors of every ring must then hold the same parameters and the same anchor,
momentum (they all applied the committed mean, or all the next attempt's), and again after
the next outer step (round 2, without the victim).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig
from ravnest_p2p.averaging.ring import RingAllReduce
from ravnest_p2p.averaging.session import RingSession
from tests.integration.averaging.helpers import drift, outer_averagers

pytestmark = pytest.mark.timeout(120)

VICTIM = 3  # cluster 1, stage 1: in three of the four rings


def reached(session: RingSession, phase: str) -> bool:
    """Whether the victim's session just reached `phase` (called after each part it accepts)."""
    arrived = [step for (step, _), fut in session._received.items() if fut.done() and fut.result()]
    gather = [s for s in arrived if s >= session.size - 1]
    if phase == "reduce":  # its first reduce part
        return bool(arrived) and not gather
    if phase == "gather":  # its first gather part
        return bool(gather)
    if phase == "last_step":  # every part but the last step's: it may not have sent its own last ones
        return all(fut.done() for (step, _), fut in session._received.items() if step < session.num_steps - 1)
    return session.complete  # commit: the whole mean, its last ack not yet written


def same(tensors: list[dict[str, torch.Tensor]], names) -> bool:
    return all(all(torch.equal(t[n], tensors[0][n]) for n in names if n in tensors[0]) for t in tensors)


@pytest.mark.parametrize(
    "phase",
    [  # ~16 s each; "commit" (the victim holds the whole mean) reproduced the bug without commit.py
        pytest.param("reduce", marks=pytest.mark.slow),
        pytest.param("gather", marks=pytest.mark.slow),
        pytest.param("last_step", marks=pytest.mark.slow),
        "commit",
    ],
)
async def test_survivors_apply_the_same_mean_whatever_phase_a_member_dies_in(
    swarm,
    phase,
    monkeypatch,
):
    transports, servers, shard_map, owner_values, closed = swarm
    cluster_of = {p: c for p, (c, _) in owner_values.items()}
    outer = OuterOptimizerConfig(compression=DeltaCompression.INT8)
    live, averagers = outer_averagers(servers, shard_map, owner_values, outer)
    drift(live, cluster_of, 0)
    await asyncio.gather(*(a.run_round(0) for a in averagers.values()))

    victim = servers[VICTIM]
    largest = max(shard_map.shards_of(victim.peer_id), key=lambda s: s.numel)

    killed = []
    accept = RingSession.accept

    def accept_then_maybe_die(self, step, part, tensor):  # the kill lands between two parts
        accept(self, step, part, tensor)
        mine = self.me == victim.peer_id and self.ring_id == largest.ring_id and self.round == 1
        if mine and not killed and reached(self, phase):
            killed.append((step, part))
            os.kill(transports[VICTIM]._p2p._child.pid, signal.SIGKILL)

    monkeypatch.setattr(RingSession, "accept", accept_then_maybe_die)
    drift(live, cluster_of, 1)
    survivors = {p: a for p, a in averagers.items() if p != victim.peer_id}
    victim_round = asyncio.ensure_future(averagers[victim.peer_id].run_round(1))
    await asyncio.gather(*(a.run_round(1) for a in survivors.values()))
    assert killed
    victim_round.cancel()
    with contextlib.suppress(BaseException):
        await victim_round
    closed.add(VICTIM)
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(victim.aclose(), 10)
    with contextlib.suppress(BaseException):
        await asyncio.wait_for(transports[VICTIM].aclose(), 10)

    for r in (1, 2):
        if r == 2:  # the next outer step, the victim gone
            drift(live, cluster_of, 2)
            await asyncio.gather(*(a.run_round(2) for a in survivors.values()))
        for shard in shard_map.shards:
            alive = [p for p in shard.owners if p != victim.peer_id]
            outers = [survivors[p].outer for p in alive]
            rings = [
                next(x for x in survivors[p].history[-1].rings if x.ring_id == shard.ring_id) for p in alive
            ]
            # who averaged with whom, in how many attempts: tells a member left out for lateness (it
            # reports itself alone) from a commit fault (members of one attempt with different values)
            seen = [(x.participants, x.attempts) for x in rings]
            assert same([live[p] for p in alive], shard.names), (phase, r, shard.ring_id, seen)
            for slot in ("theta", "momentum"):  # the residual is each member's own roundings
                assert same([getattr(o, slot) for o in outers], shard.names), (phase, r, slot, seen)
            assert len({x.participants for x in rings}) == 1, (phase, r, [x.participants for x in rings])
            assert len(rings[0].participants) == len(alive) or victim.peer_id in rings[0].participants


@pytest.mark.timeout(300)  # the lateness grows with the step deadline, which grows with the load
async def test_a_member_late_for_a_ring_takes_the_step_the_others_took(swarm, monkeypatch):
    """Not a fault: one member reaches a ring after the others formed it without it (later than a step
    deadline). It fetches their mean and takes the same outer step: anchors and momentum stay identical."""
    _, servers, shard_map, owner_values, _ = swarm
    cluster_of = {p: c for p, (c, _) in owner_values.items()}
    config = OuterOptimizerConfig(wait_for_behind=False)  # the default waits for it (tested below)
    live, averagers = outer_averagers(servers, shard_map, owner_values, config)
    drift(live, cluster_of, 0)
    await asyncio.gather(*(a.run_round(0) for a in averagers.values()))
    late, ring = servers[4].peer_id, shard_map.shards[0]  # cluster 2 stage 0, in ring e2/s0
    owners = ring.owners
    assert late in owners
    run_ring = RingAllReduce._run_ring

    async def late_run_ring(self, epoch, shard, tensors, round_index, *args):
        if self.peer_id == late and shard.index == ring.index and round_index == 1:
            await asyncio.sleep(1.5 * self.config.step_timeout_s)
        return await run_ring(self, epoch, shard, tensors, round_index, *args)

    monkeypatch.setattr(RingAllReduce, "_run_ring", late_run_ring)
    for r in (1, 2):
        drift(live, cluster_of, r)
        await asyncio.gather(*(a.run_round(r) for a in averagers.values()))
        for shard in shard_map.shards:
            outers = [averagers[p].outer for p in shard.owners]
            for slot in ("theta", "momentum"):
                assert same([getattr(o, slot) for o in outers], shard.names), (r, slot, shard.ring_id)
        seen = [next(x for x in averagers[p].history[-1].rings if x.ring_id == ring.ring_id) for p in owners]
        everyone = set(ring.owners) if r == 2 else set(ring.owners) - {late}
        assert all(set(x.participants) == everyone for x in seen), (r, [x.participants for x in seen])
        if r == 1:  # its own Δ waits for its next sync, in what it continues from
            assert not same([live[p] for p in owners], ring.names)
