"""Hostile gossip against real peers: an outsider's epoch (huge or + 1) moves nobody; floods are limited.

Before this was fixed, one unauthenticated `gossip_view` with epoch 2^62 moved every peer there (and
the next re-plan overflowed the record's epoch cap, so peers stopped announcing), and one with epoch + 1
forced a swarm-wide re-plan.
"""

from __future__ import annotations

import pytest

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.membership import GOSSIP_VIEW, GossipRequest, Phase
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity
from ravnest_p2p.utils import wait_until
from tests.integration.membership._real_peers import MEMBERSHIP, agreed_plan, real_peers

pytestmark = pytest.mark.timeout(180)

RUN = "gossip-hostile"


def request(epoch: int, *, push: bool = False) -> GossipRequest:
    return GossipRequest(
        epoch=epoch,
        view_digest="0" * 64,
        bucket_digests=("0" * 16,) * MEMBERSHIP.num_buckets,
        push_buckets=(0,) if push else (),
    )


async def test_an_outsiders_epochs_move_no_real_peer_and_its_flood_is_rate_limited(hostile):
    hostile.surface = "rpc:gossip"
    async with real_peers(3, RUN) as peers:
        await wait_until(lambda: agreed_plan(peers) is not None, 90, message="one agreed plan")
        plan = agreed_plan(peers)
        assert plan is not None
        outsider_transport = await P2PTransport.create(HostConfig(), load_or_create_identity(None))
        try:
            outsider = RpcEndpoint(outsider_transport, RUN)
            for peer in peers:
                outsider_transport.add_addresses(peer.peer_id, peer.maddrs)
            codes: dict[str, int] = {}
            epochs = [2**62, 2**62 - 1, 2**40, plan.epoch + 1, plan.epoch + 2, plan.epoch + 1]
            for round_ in range(10):
                for peer in peers:
                    for epoch in epochs:
                        hostile.sent += 1
                        try:
                            await outsider.call(
                                peer.peer_id, GOSSIP_VIEW, request(epoch, push=round_ % 2 == 1), timeout_s=5
                            )
                            code = "ok"
                        except RemoteError as exc:
                            hostile.refused += 1
                            hostile.crashes += exc.code == "internal"
                            code = exc.code
                        except TransportError:
                            code = "transport"
                        codes[code] = codes.get(code, 0) + 1
            assert codes.get("rate_limited", 0) > 0, codes  # a stranger's bucket is small
            assert "transport" not in codes
            # nobody moved: same epoch, same active plan, still announcing
            services = [p.membership for p in peers if p.membership is not None]
            rounds_before = [m.num_rounds for m in services]
            await wait_until(
                lambda: all(m.num_rounds >= r + 4 for m, r in zip(services, rounds_before, strict=True)),
                20,
                message="a few membership rounds after the attack",
            )
            for peer in peers:
                membership = peer.membership
                assert membership is not None
                hostile.state_changes += membership.epoch != plan.epoch
                assert membership.epoch == plan.epoch
                assert membership.phase == Phase.ACTIVE
                assert membership.active_plan is not None
                assert membership.active_plan.digest() == plan.digest()
            assert sum(m.num_epoch_claims_dropped for m in services) > 0
            records = await peers[0].directory.refresh()
            assert all(records[p.peer_id].epoch == plan.epoch for p in peers)  # still announcing
        finally:
            await outsider_transport.aclose()
    assert hostile.crashes == 0
    assert hostile.state_changes == 0
