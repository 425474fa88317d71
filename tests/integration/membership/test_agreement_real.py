"""Twelve real peers (real p2pd, loopback) agree on one plan; a crash re-plans; a liar is ignored."""

from __future__ import annotations

import asyncio
import contextlib
import time

from ravnest_p2p.discovery import PEERS_KEY, RunDHT, dht_time
from ravnest_p2p.measurement import ProbeConfig
from ravnest_p2p.membership import DhtPlanBoard, MembershipConfig
from ravnest_p2p.node import EmulationConfig, Peer, PeerConfig
from ravnest_p2p.planning import Plan
from ravnest_p2p.status import fetch_run, format_plan
from ravnest_p2p.transport import HostConfig, P2PTransport, load_or_create_identity
from ravnest_p2p.utils import wait_until

MEMBERSHIP = MembershipConfig(
    gossip_period_s=0.5,
    fanout=3,
    call_timeout_s=2.0,
    stable_rounds=3,
    hysteresis_s=1.5,
    join_delay_s=2.0,
    grace_s=2.0,
    agreement_timeout_s=20.0,
)
NUM_PEERS = 12


def config(i: int, initial_peers: tuple[str, ...] = ()) -> PeerConfig:
    return PeerConfig(
        run_id="membership-it",
        initial_peers=initial_peers,
        record_ttl_s=6.0,
        directory_refresh_s=0.5,
        check_identity_free=False,
        probe=ProbeConfig(period_s=30.0, initial_probe_bytes=64 * 1024, max_probe_bytes=128 * 1024),
        membership=MEMBERSHIP,
        emulate=EmulationConfig(  # heterogeneous on loopback: 4 compute levels, 3 uplink caps
            flops_per_s=4e9,  # pinned: 12 peers measuring one after another on a busy host take ~30 s
            flops_scale=(0.25, 0.5, 1.0, 2.0)[i % 4],
            upload_mbps=(10.0, 40.0, 160.0)[i % 3],
            download_mbps=200.0,
        ),
    )


def members(plan: Plan) -> set[str]:
    return {pid for c in plan.clusters for pid in c.peer_ids} | set(plan.spare_peer_ids)


def agreed_plan(peers: list[Peer]) -> Plan | None:
    plans = [p.membership.active_plan if p.membership else None for p in peers]
    if any(plan is None for plan in plans) or len({plan.digest() for plan in plans if plan}) != 1:
        return None
    return plans[0]


async def start_lying_peer(initial_peers: tuple[str, ...]) -> tuple[P2PTransport, RunDHT]:
    """A peer that tries to announce 10^18 FLOP/s (valid signature, absurd figure) and runs nothing else."""
    transport = await P2PTransport.create(
        HostConfig(initial_peers=initial_peers), load_or_create_identity(None)
    )
    dht = await RunDHT.create(transport, run_id="membership-it", initial_peers=initial_peers)
    record = {
        "schema_version": 1,
        "peer_id": transport.peer_id,
        "flops": 1e18,
        "free_memory_bytes": 2**34,
        "upload_mbps": 1000.0,
        "download_mbps": 1000.0,
        "state": "ready",
        "updated_at": dht_time(),
    }
    # the run's record validator refuses the absurd figure at every replica (readers would drop it too)
    assert not await dht.store_own(PEERS_KEY, record, ttl_s=120.0)
    return transport, dht


async def test_twelve_peers_agree_replan_after_crash_and_ignore_a_liar():
    started = time.monotonic()
    first = await Peer.start(config(0))
    peers = [first]
    liar = None
    try:
        liar = await start_lying_peer(tuple(first.maddrs))
        results = await asyncio.gather(
            *(Peer.start(config(i, tuple(first.maddrs))) for i in range(1, NUM_PEERS)), return_exceptions=True
        )
        peers += [r for r in results if isinstance(r, Peer)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        ids = {p.peer_id for p in peers}

        await wait_until(lambda: agreed_plan(peers) is not None, 60, message="one agreed plan")
        plan = agreed_plan(peers)
        assert plan is not None
        assert members(plan) == ids  # everybody, and not the liar
        assert liar[0].peer_id not in members(plan)
        # the liar's record was refused by the run's validator where it tried to store it
        assert any(p.dht.run_validator.refused.get("schema") for p in peers)
        published = await DhtPlanBoard(first.dht).read(plan.epoch)
        assert {pid: d for pid, d in published.items() if pid in ids} == dict.fromkeys(ids, plan.digest())
        agreed_after_s = time.monotonic() - started

        placed = {pid for c in plan.clusters for pid in c.peer_ids}

        async def positions_published() -> bool:
            # every record must carry the epoch, and every placed peer its cluster (a record refreshed
            # between the two would show one cluster fewer)
            records = await first.directory.refresh()
            return all(
                pid in records
                and records[pid].epoch == plan.epoch
                and (records[pid].cluster is not None or pid not in placed)
                for pid in ids
            )

        await wait_until(positions_published, 20, message="records carry the epoch")
        # The status view (`fetch_run`) reads the records through a fresh DHT client: on a busy host its
        # first read can miss a record the peers already see (session 21: "11 clusters" of 12, once), so
        # it is polled until it shows the whole plan, and the last view read is checked.
        expected = f"epoch {plan.epoch}: {len(plan.clusters)} clusters"
        epoch, shown = -1, ""
        digests: dict[str, str] = {}

        async def status_shows_the_plan() -> bool:
            nonlocal epoch, digests, shown
            records, epoch, digests = await fetch_run(first.maddrs, "membership-it")
            shown = format_plan(records, epoch, digests)
            return expected in shown

        await wait_until(status_shows_the_plan, 30, message="the status view shows the agreed plan")
        assert epoch == plan.epoch
        assert digests.get(first.peer_id) == plan.digest()
        assert expected in shown

        victim = peers.pop()
        await victim.aclose(drain=False)  # a crash: its record simply expires
        crashed_at = time.monotonic()

        def replanned() -> bool:
            new = agreed_plan(peers)
            return new is not None and new.epoch > plan.epoch

        await wait_until(replanned, 180, message="a new agreed plan without the crashed peer")
        new_plan = agreed_plan(peers)
        assert new_plan is not None
        assert members(new_plan) == ids - {victim.peer_id}
        replan_s = time.monotonic() - crashed_at
        print(f"agreement {agreed_after_s:.1f}s after start; re-plan {replan_s:.1f}s after crash")
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(p.aclose() for p in peers), return_exceptions=True), 60)
        if liar is not None:
            await liar[1].aclose()
            await liar[0].aclose()
