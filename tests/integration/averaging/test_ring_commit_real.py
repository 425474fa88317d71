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
