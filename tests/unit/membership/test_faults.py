"""Epochs strangers cannot move, rate-limited gossip, and suspects verified by ping (fake transport)."""

from __future__ import annotations

import random

import pytest

from ravnest_p2p.errors import RemoteError
from ravnest_p2p.membership import (
    GOSSIP_VIEW,
    MAX_EPOCH,
    GossipRequest,
    MembershipService,
    MemoryPlanBoard,
    MemorySuspectBoard,
    Phase,
    backed_epoch,
)
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from tests.unit.membership.test_service import CONFIG, Clock, Records, agreed, record, run_until


def test_backed_epoch_allows_one_past_the_records_or_one_past_another_members_digest():
    assert backed_epoch(5, record_epochs=[3, 4], previous_published_by_other=False) == 5
    assert backed_epoch(9, record_epochs=[3, 4], previous_published_by_other=False) == 5  # clamped
    assert backed_epoch(9, record_epochs=[3, 4], previous_published_by_other=True) == 9
    assert backed_epoch(2**62 + 7, record_epochs=[], previous_published_by_other=True) == MAX_EPOCH


async def make(num_peers: int):
    net, records, board, suspects, clock = (
        FakeNetwork(),
        Records(),
        MemoryPlanBoard(),
        MemorySuspectBoard(),
        Clock(),
    )
    clock.now = 2000.0  # the wall clock too: past the records' `updated_at` (1000), as in a real swarm
    services = {}
    for i in range(num_peers):
        pid = f"QmTestPeer{'abcdefghijkmnopqrstuvwxyz'[i]}"
        records.all[pid] = record(pid, i)
        service = MembershipService(
            CONFIG,
            RpcEndpoint(net.create(pid), "run"),
            records,
            board.view_as(pid),
            suspects=suspects.view_as(pid),
            clock=clock,
            rng=random.Random(i),
            wall_clock=clock,
        )
        await service.serve()
        services[pid] = service
    await run_until(clock, services, lambda: agreed(services))
    return net, records, suspects, clock, services


def gossip(epoch: int) -> GossipRequest:
    return GossipRequest(epoch=epoch, view_digest="0" * 64, bucket_digests=("0" * 16,) * CONFIG.num_buckets)


async def test_a_strangers_huge_or_next_epoch_moves_nobody_and_its_flood_is_rate_limited():
    net, _, _, clock, services = await make(4)
    outsider = RpcEndpoint(net.create("QmOutsider"), "run")
    target = sorted(services)[0]
    codes = []
    for epoch in (2**62, 2**62 - 1, 1, 1, 2) * 4:
        try:
            await outsider.call(target, GOSSIP_VIEW, gossip(epoch), timeout_s=1)
            codes.append("ok")
        except RemoteError as exc:
            codes.append(exc.code)
    assert set(codes) == {"ok", "rate_limited"}  # a stranger's bucket is small
    await run_until(clock, services, lambda: True, max_rounds=4)
    assert all(s.epoch == 0 and s.phase == Phase.ACTIVE for s in services.values())
    assert services[target].num_epoch_claims_dropped > 0


async def test_a_members_huge_epoch_is_clamped_to_one_past_the_records():
    _net, _, _, clock, services = await make(4)
    liar, target = sorted(services)[:2]
    await services[liar].gossiper.rpc.call(target, GOSSIP_VIEW, gossip(2**62), timeout_s=1)
    await services[target].step()
    assert services[target].epoch == 1  # records say 0: one re-plan at most, never 2^62
    await run_until(clock, services, lambda: agreed(services))
    assert all(s.epoch <= 2 for s in services.values())


async def test_report_suspect_excludes_a_dead_member_and_every_survivor_replans_around_it():
    net, records, suspects, clock, services = await make(5)
    victim = sorted(services)[2]
    net.kill(victim)  # dead, but its record is still "in the DHT"
    services.pop(victim)
    reporter = next(iter(services.values()))
    reporter.report_suspect(victim, "NeighbourLost in the test")
    rounds = await run_until(
        clock, services, lambda: agreed(services) and reporter.active_plan.epoch > 0, max_rounds=15
    )
    plan = reporter.active_plan
    assert victim not in str(plan.model_dump())
    assert victim in records.all  # not the record's expiry: the suspect report did it
    assert rounds < CONFIG.grace_s / CONFIG.gossip_period_s + 12
    assert victim in suspects.reports[reporter.peer_id]["suspects"][0]["peer_id"]
    assert all(s.suspicion.num_verified_dead == 1 for s in services.values())  # each pinged it itself


async def test_a_suspect_that_answers_our_ping_is_kept():
    _, _, _, clock, services = await make(4)
    alive = sorted(services)[1]
    reporter = services[sorted(services)[0]]
    reporter.report_suspect(alive, "somebody said so")
    await run_until(clock, services, lambda: True, max_rounds=3)
    assert reporter.suspicion.num_found_alive == 1
    assert all(s.epoch == 0 and s.phase == Phase.ACTIVE for s in services.values())


@pytest.mark.parametrize("witness", [True, False])
async def test_a_misbehaviour_report_is_taken_only_from_a_plan_neighbour(witness):
    _, _, _, clock, services = await make(4)
    suspect, neighbour = sorted(services)[:2]
    for service in services.values():  # the stand-in workload plans one-stage clusters: say who is adjacent
        service.suspicion._are_neighbours = lambda a, b: {a, b} == {suspect, neighbour}
    outsiders = [p for p in services if p not in (suspect, neighbour)]
    reporter = neighbour if witness else outsiders[0]
    services[reporter].report_misbehaviour(suspect, "20 refused messages")
    await run_until(clock, services, lambda: True, max_rounds=3)
    others = [s for p, s in services.items() if p not in (reporter, suspect)]
    assert all(s._is_excluded(suspect) == witness for s in others)


async def test_malformed_or_strangers_suspect_reports_exclude_nobody():
    _, _, suspects, clock, services = await make(4)
    target = sorted(services)[1]
    entry = {"peer_id": target, "kind": "unreachable", "reason": "x", "epoch": 0, "reported_at": 1.0}
    good = {"schema_version": 1, "suspects": [entry]}
    suspects.reports["QmStranger"] = good  # not a member: not even verified
    suspects.reports[sorted(services)[0] + "x"] = {"schema_version": 1, "suspects": "nope"}
    suspects.reports[sorted(services)[2]] = {"schema_version": 99, "suspects": []}
    suspects.reports[sorted(services)[3]] = {**good, "suspects": [{**entry, "epoch": -1}]}
    await run_until(clock, services, lambda: True, max_rounds=3)
    assert all(s.suspicion.num_found_alive == 0 for s in services.values())
    assert all(not s._is_excluded(target) for s in services.values())
    assert all(s.epoch == 0 and s.phase == Phase.ACTIVE for s in services.values())


async def test_an_excluded_dead_member_that_restarts_is_back_at_the_next_epoch_not_after_its_timer():
    """A peer killed, excluded by the survivors, then restarted with the same identity (a new signed
    record): every survivor ends the exclusion when it reads that record, and the next plan names it
    again well before `exclude_for_s`."""
    net, records, suspects, clock, services = await make(5)
    victim = sorted(services)[2]
    net.kill(victim)
    dead = services.pop(victim)
    reporter = next(iter(services.values()))
    reporter.report_suspect(victim, "NeighbourLost in the test")
    await run_until(
        clock, services, lambda: agreed(services) and reporter.active_plan.epoch > 0, max_rounds=15
    )
    assert victim not in str(reporter.active_plan.model_dump())
    excluded_at = clock.now
    # the restart: the same identity on the network again, a fresh record, its own membership service
    await dead.aclose()
    revived = MembershipService(
        CONFIG,
        RpcEndpoint(net.create(victim), "run"),
        records,
        dead._board,  # its view of the plan board (the same identity)
        suspects=suspects.view_as(victim),
        clock=clock,
        rng=random.Random(99),
        wall_clock=clock,
    )
    await revived.serve()
    services[victim] = revived
    records.all[victim] = records.all[victim].model_copy(update={"updated_at": clock.now + 10.0})
    await run_until(
        clock, services, lambda: agreed(services) and victim in str(reporter.active_plan.model_dump()), 30
    )
    assert clock.now - excluded_at < CONFIG.exclude_for_s / 2
