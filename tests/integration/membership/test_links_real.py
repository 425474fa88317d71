"""Four real peers (real p2pd, loopback) publish their measured links and agree on a matrix-aware plan."""

from __future__ import annotations

from ravnest_p2p.membership.agreement import view_links
from ravnest_p2p.utils import wait_until
from tests.integration.membership._real_peers import agreed_plan, real_peers

NUM_PEERS = 4


async def test_records_carry_links_and_the_agreed_plan_uses_them() -> None:
    async with real_peers(NUM_PEERS, "links-it") as peers:
        ids = {p.peer_id for p in peers}

        def every_record_has_links() -> bool:
            for peer in peers:
                records = peer.directory.peers
                for pid in ids:
                    record = records.get(pid)
                    if record is None or {link.peer_id for link in record.links} != ids - {pid}:
                        return False
            return True

        await wait_until(every_record_has_links, timeout_s=120)
        for record in peers[0].directory.peers.values():
            for link in record.links:
                assert link.up_mbps > 0
                assert link.down_mbps > 0
                assert link.rtt_ms >= 0

        def views_hold_every_link() -> bool:
            for peer in peers:
                assert peer.membership is not None
                live = peer.membership.view.live()
                if set(live) != ids or any(len(cap.links) != NUM_PEERS - 1 for cap in live.values()):
                    return False
            return True

        await wait_until(views_hold_every_link, timeout_s=60)
        # a new epoch, so the plan is made from views that hold the links (an active plan is kept
        # while membership is unchanged)
        first = peers[0].membership
        assert first is not None
        epoch = max(p.membership.epoch for p in peers if p.membership) + 1
        first.tracker.open_epoch(epoch)

        def agreed_at_new_epoch() -> bool:
            plan = agreed_plan(peers)
            return plan is not None and plan.epoch >= epoch

        await wait_until(agreed_at_new_epoch, timeout_s=120)
        plan = agreed_plan(peers)
        assert plan is not None
        live = first.view.live()
        links = view_links(live, [cap.to_peer_capacity(pid) for pid, cap in live.items()])
        assert len(links) == NUM_PEERS * (NUM_PEERS - 1)  # every directed pair measured
        if plan.epoch == first.epoch:
            assert first.compute_plan().digest() == plan.digest()
