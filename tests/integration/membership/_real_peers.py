"""A few real peers (real p2pd, loopback) running membership with short timings, for fault tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ravnest_p2p.measurement import ProbeConfig
from ravnest_p2p.membership import DhtSuspectBoard, MembershipConfig
from ravnest_p2p.node import EmulationConfig, Peer, PeerConfig
from ravnest_p2p.planning import Plan

MEMBERSHIP = MembershipConfig(
    gossip_period_s=0.5,
    fanout=3,
    call_timeout_s=2.0,
    stable_rounds=3,
    hysteresis_s=1.0,
    join_delay_s=1.5,
    grace_s=3.0,
    agreement_timeout_s=20.0,
)

# what these tests check does not depend on compute: the figure is pinned, not measured (measuring on a
# busy host takes seconds per peer, one peer after another, and gives figures that differ wildly)
PINNED_COMPUTE = EmulationConfig(flops_per_s=4e9)


def config(run_id: str, initial_peers: tuple[str, ...] = (), *, record_ttl_s: float = 30.0) -> PeerConfig:
    return PeerConfig(
        run_id=run_id,
        initial_peers=initial_peers,
        record_ttl_s=record_ttl_s,
        directory_refresh_s=0.5,
        check_identity_free=False,
        probe=ProbeConfig(period_s=30.0, initial_probe_bytes=64 * 1024, max_probe_bytes=128 * 1024),
        membership=MEMBERSHIP,
        emulate=PINNED_COMPUTE,
    )


def agreed_plan(peers: list[Peer]) -> Plan | None:
    plans = [p.membership.active_plan if p.membership else None for p in peers]
    if any(plan is None for plan in plans) or len({plan.digest() for plan in plans if plan}) != 1:
        return None
    return plans[0]


def members(plan: Plan) -> set[str]:
    return {pid for c in plan.clusters for pid in c.peer_ids} | set(plan.spare_peer_ids)


@contextlib.asynccontextmanager
async def real_peers(n: int, run_id: str, *, record_ttl_s: float = 30.0) -> AsyncIterator[list[Peer]]:
    """``n`` started peers of ``run_id`` (suspect reports go through the DHT)."""
    ttl = record_ttl_s
    first = await Peer.start(config(run_id, record_ttl_s=ttl))
    peers = [first]
    try:
        results = await asyncio.gather(
            *(
                Peer.start(config(run_id, tuple(first.maddrs), record_ttl_s=record_ttl_s))
                for _ in range(n - 1)
            ),
            return_exceptions=True,
        )
        peers += [r for r in results if isinstance(r, Peer)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        for peer in peers:  # the service found the DHT through its plan board
            assert peer.membership is not None
            assert isinstance(peer.membership.suspicion.board, DhtSuspectBoard)
        yield peers
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(p.aclose() for p in peers), return_exceptions=True), 60)
