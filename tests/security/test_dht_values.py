"""Holes found by the hostile-input evaluation, reproduced against real peers (real p2pd, loopback).

An attacker with a stock hivemind `DHTNode` and its own identity (no special position) stores, at every
honest peer directly and in its own storage (a replica readers may ask):
- an unsigned plain value with a far expiry under ``peers``, ``job``, ``plan`` and ``metrics`` (it used
  to replace the whole dictionary of signed records: status showed 0 peers, every announce was refused);
- its own signed peer record with an expiry 10^9 s ahead, or an ``updated_at`` from the future or the past
  (it used to be kept and planned with long after the peer was gone).
Every such store must be refused, and readers (the peers' directories, status, `RunClient`, the job
reader, the plan board) must not see a single forged value.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest
from hivemind.dht.routing import DHTID

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import dht_time
from ravnest_p2p.membership import DhtPlanBoard, MembershipConfig
from ravnest_p2p.status import fetch_run
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.runner import read_job
from ravnest_p2p.utils import wait_until
from tests.security._dht_attack import announces, attacker, peer_value, swarm

DIGEST = "ab" * 32


async def _honest_values(peers, name: str) -> None:
    """Each peer publishes a signed value under `name` (the run's normal traffic).

    A store is retried under a deadline: on a busy host one store can miss every replica's 3 s RPC
    deadline; a store that keeps failing fails the test."""
    for i, peer in enumerate(peers):
        if name == "plan":
            await _stored(lambda peer=peer: DhtPlanBoard(peer.dht).publish(0, DIGEST, ttl_s=60))
        elif name == "metrics":
            m = StageMetrics(
                job_id="j", peer_id=peer.peer_id, cluster=0, stage=i, num_stages=len(peers), step=1,
                optimizer_steps=1, updated_at=dht_time(),
            )  # fmt: skip
            value = m.model_dump(mode="json")
            await _stored(lambda peer=peer, value=value: peer.dht.store_own(METRICS_KEY, value, ttl_s=60))


async def _stored(store, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await store():
        assert time.monotonic() < deadline, "an honest value could not be stored"
        await asyncio.sleep(1.0)


async def _read_until(read, expected, timeout_s: float = 30.0):
    """What `read` returns once it equals `expected`, or its last answer after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (got := await read()) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    return got


def _plain_values_held(peers, key_id: DHTID) -> int:
    """How many honest peers hold a plain (unsigned) value under `key_id` in their own storage."""
    held = 0
    for peer in peers:
        stored = peer.dht.node.protocol.storage.get(key_id)
        if stored is not None and isinstance(stored.value, bytes):
            held += 1
    return held


@pytest.mark.parametrize("name", ["peers", "job", "plan", "metrics"])
async def test_a_plain_value_with_a_far_expiry_replaces_nothing(hostile, tmp_path, name):
    hostile.surface = f"dht:{name}"
    run_id = f"plain-{name}"
    # under `plan` the peers' own membership publishes its agreed digest whenever it agrees: on a busy
    # host that raced the test's DIGEST (seen: the test's store refused for 60 s, a board that did not
    # read DIGEST), so this swarm runs without membership
    overrides = {"membership": MembershipConfig(enabled=False)} if name == "plan" else {}
    async with swarm(2, run_id, **overrides) as peers:
        owner_key = tmp_path / "owner.key"
        async with await RunClient.connect(peers[0].maddrs, run_id, identity_path=owner_key) as owner:
            job = JobSpec(job_id="owners-job")
            if name == "job":
                await owner.publish_job(job, ttl_s=600)
            await _honest_values(peers, name)
            async with attacker(peers[0].maddrs, run_id) as evil:
                now = dht_time()
                garbage = {"schema_version": 1, "peer_id": evil.peer_id, "job_id": "evil", "epoch": 0}
                for expiry in (now + 1e6, now + 1e9):
                    for peer in peers:
                        hostile.sent += 1
                        stored = await evil.send_plain(peer.peer_id, name, garbage, expiry)
                        hostile.refused += not stored
                evil.store_locally(name, garbage, now + 1e9)  # a poisoned replica readers may ask
                hostile.forged_accepted += _plain_values_held(peers, evil.key_id(name))

                # readers (status, the client, the plan board, metrics, the job reader), then announcing.
                # A read that misses an honest value is read again (on a busy host one replica's answer
                # can come too late); a forged value, or honest ones still hidden after that, count.
                honest = sorted(p.peer_id for p in peers)

                async def status_ids() -> list[str]:  # the honest peers that status lists
                    records, _, _ = await fetch_run(peers[0].maddrs, run_id)
                    return sorted({r.peer_id for r in records} & set(honest))

                async def client_ids() -> list[str]:
                    return sorted(r.peer_id for r in await owner.peers())

                async def plan_boards() -> list[tuple[str, str]]:
                    boards = await DhtPlanBoard(peers[1].dht).read_all()
                    return sorted((p, r.digest) for p, r in boards.items())

                async def metrics_ids() -> list[str]:
                    return sorted(m.peer_id for m in await owner.metrics(job_id="j"))

                async def job_id() -> str | None:
                    seen = await read_job(peers[1].dht)
                    return None if seen is None else seen.job_id

                checks: list[tuple[Callable[[], Awaitable[object]], object]] = [
                    (status_ids, honest),
                    (client_ids, honest),
                ]
                if name == "plan":
                    checks.append((plan_boards, sorted((p, DIGEST) for p in honest)))
                if name == "metrics":
                    checks.append((metrics_ids, honest))
                if name == "job":
                    checks.append((job_id, job.job_id))
                for read, expected in checks:
                    hostile.forged_accepted += await _read_until(read, expected) != expected
                for peer in peers:
                    hostile.state_changes += not await announces(peer)
    assert hostile.refused == hostile.sent == 2 * len(peers)
    assert hostile.forged_accepted == 0
    assert hostile.state_changes == 0


async def test_a_record_with_a_far_expiry_or_a_false_clock_is_refused_and_never_planned_with(hostile):
    hostile.surface = "dht:peers"
    run_id = "far-expiry"
    async with swarm(2, run_id) as peers, attacker(peers[0].maddrs, run_id) as evil:
        now = dht_time()
        cases = [
            (peer_value(evil.peer_id), now + 1e9),  # the original hole: kept for 30 years
            (peer_value(evil.peer_id), now + 3600),  # past the peers key's 600 s cap
            (peer_value(evil.peer_id, updated_at=now + 3600), now + 60),  # written "in the future"
            (peer_value(evil.peer_id, updated_at=now - 3600), now + 60),  # written an hour ago
            (peer_value(evil.peer_id, updated_at=now - 500), now + 590),  # 1090 s past its writing
        ]
        for value, expiry in cases:
            for peer in peers:
                hostile.sent += 1
                hostile.refused += not await evil.send_signed(peer.peer_id, "peers", value, expiry)
        # a sane record is accepted (the refusals above are not a broken attacker) and read...
        assert await evil.send_signed(peers[0].peer_id, "peers", peer_value(evil.peer_id), dht_time() + 5)
        await wait_until(lambda: evil.peer_id in peers[1].directory.peers, 30, message="sane record read")
        # ...and once the attacker leaves, its record expires within its TTL: nobody plans with it
        await wait_until(lambda: evil.peer_id not in peers[1].directory.peers, 30, message="record expired")
        records, _, _ = await fetch_run(peers[0].maddrs, run_id)
        hostile.forged_accepted += any(r.peer_id == evil.peer_id for r in records)
    assert hostile.refused == hostile.sent == 5 * 2
    assert hostile.forged_accepted == 0
