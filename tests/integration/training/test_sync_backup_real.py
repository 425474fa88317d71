"""sync_backup over real peers (real p2p daemons on loopback, in this process), from `RunClient` to done.

Three workers (N = 2, b = 1) train the digits MLP and reach a learned held-out accuracy; in the second
test one of four workers (N = 2, b = 2), a shard owner, is closed mid-run and the others finish without
it (its shards move to the next owners of the layout).
"""

from __future__ import annotations

import asyncio
import os

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.node import Peer
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import SyncBackupConfig
from ravnest_p2p.training.sync_runner import SyncBackupRunner
from ravnest_p2p.utils import wait_until
from tests.integration.foundation.conftest import close_all, start_swarm

pytestmark = pytest.mark.timeout(300)

MODEL = {"in_features": 64, "hidden_features": [64], "out_features": 10}


def _job(peers: list[Peer], *, n: int, b: int, epochs: int, ping_s: float = 4.0) -> JobSpec:
    end = len(build_model("mlp", MODEL))
    return JobSpec(
        job_id="sync-real",
        model="mlp",
        model_params=MODEL,
        dataset="digits",
        batch_size=32,
        num_epochs=epochs,
        seed=0,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
        mode="sync_backup",
        sync_backup=SyncBackupConfig(
            num_required=n, num_backup=b, step_timeout_s=60, owner_ping_timeout_s=ping_s
        ),
        assignment=tuple((StagePlacement(peer_id=p.peer_id, first_layer=0, end_layer=end),) for p in peers),
    )


def _runner(peer: Peer) -> SyncBackupRunner | None:
    runner = peer.supervisor.runner
    return runner if isinstance(runner, SyncBackupRunner) else None


async def test_sync_backup_trains_from_the_client_to_done() -> None:
    run_id = f"sync-{os.getpid()}"
    peers = await start_swarm(3, run_id, job_poll_s=0.5)
    try:
        async with await RunClient.connect(peers[0].maddrs, run_id) as client:
            await client.wait_for_peers(3, timeout_s=60, measured=False)
            job = _job(peers, n=2, b=1, epochs=8)
            await client.publish_job(job)
            metrics = await client.wait_for_job(job, timeout_s=200, poll_s=0.5)
        done = [m for m in metrics if m.done]
        assert len(done) >= 2
        assert all(m.mode == "sync_backup" for m in metrics)
        assert max(m.eval_accuracy or 0.0 for m in done) >= 0.85, [(m.step, m.eval_accuracy) for m in done]
        runners = [r for r in (_runner(p) for p in peers) if r is not None]
        assert len(runners) == 3
        owners = [o for r in runners for o in r.owners.owned.values()]
        assert owners
        assert all(len(c) == 2 for o in owners for c in o.contributors)  # N gradients per step
    finally:
        await close_all(peers)


@pytest.mark.slow  # 65-85 s on a busy 2-core host
async def test_sync_backup_goes_on_without_a_closed_owner() -> None:
    run_id = f"sync-kill-{os.getpid()}"
    peers = await start_swarm(4, run_id, job_poll_s=0.5)
    try:
        async with await RunClient.connect(peers[0].maddrs, run_id) as client:
            await client.wait_for_peers(4, timeout_s=60, measured=False)
            # a generous ping deadline: a busy host must not make a live owner look dead
            job = _job(peers, n=2, b=2, epochs=7, ping_s=10.0)
            await client.publish_job(job)
            waiting = asyncio.create_task(client.wait_for_job(job, timeout_s=200, poll_s=0.5))
            await wait_until(lambda: all(_runner(p) is not None for p in peers), 60)
            victim = next(p for p in peers if _runner(p).layout.shards_of(p.peer_id))  # type: ignore[union-attr]
            victim_runner = _runner(victim)
            assert victim_runner is not None
            await wait_until(lambda: victim_runner.step >= 5 or waiting.done(), 120)
            assert not waiting.done(), "the job ended before the kill: make it longer"
            await victim.aclose(drain=False)
            metrics = await waiting
        survivors = [p for p in peers if p is not victim]
        done = [m for m in metrics if m.done]
        assert {m.peer_id for m in done} >= {p.peer_id for p in survivors[:2]} or len(done) >= 2
        assert max(m.eval_accuracy or 0.0 for m in done) >= 0.8
        runners = [r for r in (_runner(p) for p in survivors) if r is not None]
        assert all(victim.peer_id in r.owners.dead for r in runners)
        assert sum(r.owners.takeovers for r in runners) >= 1
        assert all(r.step == r.final_step for r in runners)
    finally:
        await close_all(peers)
