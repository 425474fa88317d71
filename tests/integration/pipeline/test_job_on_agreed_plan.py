"""A job published without an assignment runs on the plan the peers agreed on by gossip."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.measurement import ProbeConfig
from ravnest_p2p.membership import MembershipConfig
from ravnest_p2p.node import EmulationConfig, Peer, PeerConfig
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.utils import wait_until

pytestmark = pytest.mark.timeout(300)

FAST = {
    "run_id": "agreed",
    "record_ttl_s": 8.0,
    "directory_refresh_s": 0.5,
    "check_identity_free": False,
    "job_poll_s": 0.5,
    # compute pinned, not measured: a busy host's figures (seen: 5.5 vs 0.1 GFLOP/s) only slow the start
    "emulate": EmulationConfig(flops_per_s=4e9),
    # figures that do not move during agreement (see the closing note on capacity drift)
    "probe": ProbeConfig(period_s=300.0, initial_probe_bytes=64 * 1024, max_probe_bytes=128 * 1024),
    "membership": MembershipConfig(
        gossip_period_s=0.5,
        stable_rounds=3,
        hysteresis_s=1.0,
        join_delay_s=1.0,
        grace_s=4.0,
        agreement_timeout_s=20.0,
    ),
}


def _firsts_done(metrics: list[StageMetrics], steps: int | None) -> bool:
    firsts = [m for m in metrics if m.stage == 0]
    return all(m.done and m.step == steps and m.eval_accuracy is not None for m in firsts)


async def test_job_without_assignment_trains_on_the_agreed_plan():
    peers: list[Peer] = []
    try:
        peers.append(await Peer.start(PeerConfig(**FAST)))
        joined = PeerConfig(**FAST, initial_peers=tuple(peers[0].maddrs))
        peers += list(await asyncio.gather(*(Peer.start(joined) for _ in range(3))))
        async with await RunClient.connect(peers[0].maddrs, "agreed") as client:
            await client.wait_for_peers(4, timeout_s=60, measured=False)
            job = JobSpec(
                job_id="on-plan",
                model="digits_cnn",
                dataset="digits",
                batch_size=32,
                max_steps=30,
                num_epochs=2,
                min_stages=2,
                optimizer=OptimizerConfig(name="adam", lr=3e-3),
            )
            await client.publish_job(job)
            final = await client.wait_for_job(job, timeout_s=180, poll_s=0.5)

            # the job is done once one cluster's first stage is; another cluster may still be finishing
            # its last steps (seen on a busy host: a first stage's metrics short of done when the
            # progress record said done), so its final metrics are read again under a deadline
            async def settled() -> bool:
                nonlocal final
                if not _firsts_done(final, job.max_steps):
                    final = newest_epoch(await client.metrics(job_id=job.job_id))
                return _firsts_done(final, job.max_steps)

            with contextlib.suppress(TimeoutError):  # the assertions below say what is missing
                await wait_until(settled, 60, interval_s=0.5, message="every first stage done")
        # every peer that trained did so on a plan made for this job (a peer still re-agreeing after a
        # split vote may lag behind; it is not part of what ran)
        trainers = {m.peer_id for m in final}
        for peer in peers:
            if peer.peer_id in trainers:
                assert peer.membership is not None
                assert peer.membership.active_workload == "on-plan"
                assert peer.membership.active_plan is not None
                assert peer.membership.active_plan.epoch >= 1  # the job's workload opened a new epoch
        firsts = [m for m in final if m.stage == 0]
        assert firsts
        assert _firsts_done(final, 30)
        assert all(m.num_stages >= 2 for m in final)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*(p.aclose() for p in peers), return_exceptions=True), 60)
