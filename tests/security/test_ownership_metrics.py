"""Whose metrics count, against real peers: a `done` from outside the job's assignment or plan does not.

The hole: any identity could publish a signed ``done`` record for a job it is not part of, and
`RunClient.wait_for_job` accepted it (the researcher got "finished" for a job that never ran).
"""

from __future__ import annotations

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import dht_time
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from tests.security._dht_attack import attacker, swarm


def done(peer_id: str, job_id: str, *, stage: int = 0, epoch: int = 0) -> dict:
    metrics = StageMetrics(
        job_id=job_id, peer_id=peer_id, cluster=0, stage=stage, num_stages=1, step=10, optimizer_steps=10,
        epoch=epoch, done=True, updated_at=dht_time(),
    )  # fmt: skip
    return metrics.model_dump(mode="json")


async def test_done_from_outside_the_job_is_not_counted(hostile):
    hostile.surface = "dht:metrics"
    run_id = "metrics-members"
    async with swarm(1, run_id, job_poll_s=3600.0) as peers:
        initial = peers[0].maddrs
        async with (
            await RunClient.connect(initial, run_id) as researcher,
            await RunClient.connect(initial, run_id) as member,
            await RunClient.connect(initial, run_id) as stranger,
            attacker(initial, run_id) as evil,
        ):
            job = JobSpec(
                job_id="j1",
                assignment=((StagePlacement(peer_id=member.peer_id, first_layer=0, end_layer=4),),),
            )
            on_plan = JobSpec(job_id="j2")  # no assignment: runs on the agreed plan, which names nobody here
            for j in (job, on_plan):
                # a stranger's own signed `done`, at the first stage of cluster 0
                hostile.sent += 1
                assert await stranger.dht.store_own(METRICS_KEY, done(stranger.peer_id, j.job_id), ttl_s=60)
                # a record that claims to be the member's, under the attacker's key: refused at the DHT
                hostile.sent += 1
                refused = not await evil.send_signed(
                    peers[0].peer_id, METRICS_KEY, done(member.peer_id, j.job_id), dht_time() + 60
                )
                hostile.refused += refused
                with pytest.raises(TimeoutError):
                    await researcher.wait_for_job(j, timeout_s=1.0, poll_s=0.2)
            seen = await researcher.metrics(job_id="j2")  # one value per signer: its newest
            assert [m.peer_id for m in seen] == [stranger.peer_id]  # read, but not counted
            # the member's own `done` finishes the job
            assert await member.dht.store_own(METRICS_KEY, done(member.peer_id, "j1"), ttl_s=60)
            final = await researcher.wait_for_job(job, timeout_s=20.0, poll_s=0.2)
            hostile.forged_accepted += any(m.peer_id != member.peer_id for m in final)
    assert hostile.refused == 2
    assert hostile.forged_accepted == 0
