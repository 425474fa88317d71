"""Four real peers agree; one dies with its record still live; a suspect report re-plans within seconds."""

from __future__ import annotations

import time

import pytest

from ravnest_p2p.utils import wait_until
from tests.integration.membership._real_peers import agreed_plan, members, real_peers

pytestmark = pytest.mark.timeout(180)

RECORD_TTL_S = 40.0


async def test_survivors_agree_on_a_plan_without_a_dead_member_well_before_its_record_expires():
    async with real_peers(4, "suspects-it", record_ttl_s=RECORD_TTL_S) as peers:
        await wait_until(lambda: agreed_plan(peers) is not None, 90, message="one agreed plan")
        plan = agreed_plan(peers)
        assert plan is not None
        assert members(plan) == {p.peer_id for p in peers}

        victim = peers.pop()
        await victim.aclose(drain=False)  # dies: its record stays in the DHT until it expires
        died_at = time.monotonic()
        reporter = peers[0].membership
        assert reporter is not None
        reporter.report_suspect(victim.peer_id, "NeighbourLost: no answer for 6.0s")

        def replanned() -> bool:
            new = agreed_plan(peers)
            return new is not None and new.epoch > plan.epoch and victim.peer_id not in members(new)

        await wait_until(replanned, RECORD_TTL_S, message="a new plan without the dead member")
        replan_s = time.monotonic() - died_at
        new_plan = agreed_plan(peers)
        assert new_plan is not None
        assert members(new_plan) == {p.peer_id for p in peers}
        assert replan_s < RECORD_TTL_S / 2, replan_s  # well before the record's expiry (+ grace)
        records = await peers[0].directory.refresh()
        assert victim.peer_id in records  # its record was still there: the report did it
        # every survivor verified the suspect by its own ping (the reporter's word was not enough)
        assert all(p.membership and p.membership.suspicion.num_verified_dead >= 1 for p in peers)
        print(f"re-planned {replan_s:.1f}s after the death (record TTL {RECORD_TTL_S:.0f}s)")
