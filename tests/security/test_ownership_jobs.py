"""Run ownership against real peers: only the owner's (or its listed keys') jobs are read as the run's job.

The hole: any identity in the run could publish a job, and the one with the latest expiry won, so a
stranger's job with a long TTL silently replaced the researcher's. `read_job` is what every peer's job
loop calls; a stranger's job that it returned would be trained.
"""

from __future__ import annotations

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import dht_time
from ravnest_p2p.status import fetch_run, format_owner
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.runner import JOB_KEY, pick_job, read_job
from ravnest_p2p.transport import load_or_create_identity
from tests.security._dht_attack import attacker, swarm


def placed_on(peers, job_id: str) -> JobSpec:
    stages = (
        StagePlacement(peer_id=peers[0].peer_id, first_layer=0, end_layer=2),
        StagePlacement(peer_id=peers[1].peer_id, first_layer=2, end_layer=4),
    )
    return JobSpec(job_id=job_id, assignment=(stages,))


async def test_a_strangers_job_never_replaces_the_owners(hostile, tmp_path):
    hostile.surface = "dht:job"
    run_id = "owned-jobs"
    owner_key = tmp_path / "owner.key"
    owner_id = load_or_create_identity(owner_key).peer_id
    # job_poll_s: the peers do not pick the job up during the test (training is not what is tested)
    async with swarm(2, run_id, run_owner=owner_id, job_poll_s=3600.0) as peers:
        initial = peers[0].maddrs
        async with (
            await RunClient.connect(initial, run_id, identity_path=owner_key) as owner,
            attacker(initial, run_id) as stranger,
        ):
            assert owner.peer_id == owner_id  # the same key file is the same owner
            await owner.publish_job(placed_on(peers, "owners"), ttl_s=300)
            # a stranger in the run: a well-formed job with the longest TTL a job may have (stored: it
            # is signed and valid), one far beyond it, and a fake owners list naming itself
            now = dht_time()
            forged_owners = {"schema_version": 1, "owner": stranger.peer_id, "keys": [stranger.peer_id]}
            for peer in peers:
                hostile.sent += 3
                job = placed_on(peers, "strangers").to_wire()
                assert await stranger.send_signed(peer.peer_id, JOB_KEY, job, now + 86_000)
                evil_job = placed_on(peers, "evil").to_wire()
                stored = await stranger.send_signed(peer.peer_id, JOB_KEY, evil_job, now + 1e9)
                stored_owners = await stranger.send_signed(
                    peer.peer_id, "owners", forged_owners | {"updated_at": now}, now + 60
                )
                hostile.refused += (not stored) + (not stored_owners)
            for peer in peers:
                job = await read_job(peer.dht)
                hostile.forged_accepted += job is None or job.job_id != "owners"
            # what an open run would have done with the same records: the stranger's job wins
            found = await peers[0].dht.get_signed(JOB_KEY)
            assert stranger.peer_id in found
            assert pick_job(found).job_id == "strangers"

            records, _, _ = await fetch_run(initial, run_id, run_owner=owner_id)
            assert {r.run_owner for r in records} == {owner_id}
            assert format_owner(records, owner_id).startswith(f"owner: {owner_id} (2/2 peers")
    assert hostile.refused == hostile.sent - len(peers)  # all but the stranger's well-formed jobs
    assert hostile.forged_accepted == 0


async def test_a_listed_key_may_publish_but_not_past_the_owners_say_so(hostile, tmp_path):
    hostile.surface = "dht:owners"
    run_id = "delegated"
    owner_key = tmp_path / "owner.key"
    owner_id = load_or_create_identity(owner_key).peer_id
    async with swarm(2, run_id, run_owner=owner_id, job_poll_s=3600.0) as peers:
        initial = peers[0].maddrs
        async with (
            await RunClient.connect(initial, run_id, identity_path=owner_key) as owner,
            await RunClient.connect(initial, run_id) as delegate,
        ):
            await owner.publish_job(placed_on(peers, "owners"), ttl_s=300)
            await delegate.publish_job(placed_on(peers, "delegates"), ttl_s=3000)
            hostile.sent += 1
            job = await read_job(peers[1].dht)
            hostile.forged_accepted += job.job_id != "owners"  # not listed yet
            # listed for less time than the owner's job lives: the delegate's job is capped below it
            await owner.publish_owners([delegate.peer_id], ttl_s=100)
            assert (await read_job(peers[1].dht)).job_id == "owners"
            # listed for longer: its job (which expires later) is the run's job now
            await owner.publish_owners([delegate.peer_id], ttl_s=1000)
            assert (await read_job(peers[1].dht)).job_id == "delegates"
            with pytest.raises(ValueError, match="at most"):
                await owner.publish_job(placed_on(peers, "forever"), ttl_s=1e9)
    assert hostile.forged_accepted == 0


async def test_an_open_run_still_trains_anyones_job_and_says_so(tmp_path):
    run_id = "open-run"
    async with swarm(2, run_id, job_poll_s=3600.0) as peers:
        async with await RunClient.connect(peers[0].maddrs, run_id) as anyone:
            await anyone.publish_job(placed_on(peers, "anyones"), ttl_s=60)
            assert (await read_job(peers[1].dht)).job_id == "anyones"
        records, _, _ = await fetch_run(peers[0].maddrs, run_id)
        assert format_owner(records).startswith("open run: no owner")
