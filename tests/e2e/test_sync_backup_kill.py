"""End to end, sync_backup: SIGKILL of workers mid-run, on real peer processes, from `RunClient` to done.

Five peer CLI processes (and a stock hivemind-dht bootstrap) run a sync_backup job (N = 2, b = 3, three
parameter shards, so two workers own none). Mid-run the test SIGKILLs the process group of a worker that
owns no shard: the steps go on without it (the owners count the first N of the others), and at the end the
owners, finding it silent, declare it dead instead of waiting for it. Later it SIGKILLs a shard owner: the
workers that cannot reach it declare it dead and its shards move to the next owners of the layout (a
re-plan of ownership, not a hang). The job finishes with the accuracy bar of the in-process real test
(tests/integration/training/test_sync_backup_real.py) and neither victim reports done.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from torch import nn

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.strategies.sync_layout import SyncLayout
from ravnest_p2p.swarm import LocalSwarm, PeerProcess, poll_until
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import SyncBackupConfig
from ravnest_p2p.training.sync_compute import piece_views
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "sync-kill-e2e"
MODEL = {"in_features": 64, "hidden_features": [64], "out_features": 10}


def kill_job(workers: list[str]) -> JobSpec:
    model = nn.Sequential(*build_model("mlp", MODEL))
    return JobSpec(
        job_id="sync-kill",
        model="mlp",
        model_params=MODEL,
        dataset="digits",
        batch_size=32,
        num_epochs=30,  # ~260 steps: the polled kills land mid-run even when a loaded host lags the metrics
        seed=0,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
        mode="sync_backup",
        sync_backup=SyncBackupConfig(
            num_required=2, num_backup=3, num_shards=3, step_timeout_s=90, owner_ping_timeout_s=6
        ),
        assignment=tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=len(model)),) for w in workers),
    )


def layout_of(job: JobSpec, workers: list[str]) -> SyncLayout:
    model = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    num_shards = job.sync_backup.num_shards
    pieces = piece_views(dict(model.named_parameters()), num_shards or len(workers))  # as the runner
    sizes = {name: p.numel() * p.element_size() for name, p in pieces.items()}
    return SyncLayout.build(job.job_id, workers, sizes, num_shards)


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float, *, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.5)


def sigkill(peer: PeerProcess) -> None:
    os.killpg(peer.popen.pid, signal.SIGKILL)  # the peer and its p2p daemon, by the peer's pid
    peer.popen.wait(10)


async def test_sigkill_of_a_worker_and_of_a_shard_owner_mid_run(tmp_path: Path) -> None:
    config = tmp_path / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    # the peers run in tmp_path: import this checkout's package there too (a relative PYTHONPATH would
    # not resolve, and the peers would run whatever the environment has installed)
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    with LocalSwarm(
        5,
        run_id=RUN_ID,
        bootstrap="hivemind-dht",
        peer_args=["--config", str(config)],
        workdir=tmp_path,
        env={"PYTHONPATH": path},
        startup_timeout_s=180,
    ) as swarm:
        by_id: dict[str, PeerProcess] = {p.peer_id: p for p in swarm.peers if p.peer_id}
        workers = list(by_id)
        assert len(workers) == 5
        job = kill_job(workers)
        layout = layout_of(job, workers)
        non_owner = next(w for w in workers if not layout.shards_of(w))
        owner = next(w for w in workers if layout.shards_of(w))
        survivors = [by_id[w] for w in workers if w not in (non_owner, owner)]
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(5, timeout_s=180, measured=False)
            await client.publish_job(job)

            async def step_reached(step: int) -> bool:
                metrics = await client.metrics(job_id=job.job_id)
                return any(m.step >= step for m in metrics if m.peer_id in (non_owner, owner))

            await wait_for(lambda: step_reached(5), 180, what="step 5")
            sigkill(by_id[non_owner])
            await wait_for(lambda: step_reached(25), 120, what="step 25 without the killed worker")
            sigkill(by_id[owner])
            killed_owner_at = time.monotonic()
            final = await client.wait_for_job(job, timeout_s=240, poll_s=0.5)
            finished_after_s = time.monotonic() - killed_owner_at

        logs = {p.peer_id: p.log() for p in survivors}
        done = [m for m in final if m.done]
        print(
            f"sync_backup SIGKILL e2e: done {len(done)} workers {[(m.step, m.eval_accuracy) for m in done]}, "
            f"finished {finished_after_s:.1f}s after the owner's kill"
        )
        assert {m.peer_id for m in done} <= {p.peer_id for p in survivors}
        assert len(done) >= 2
        assert all(m.mode == "sync_backup" for m in final)
        assert max(m.eval_accuracy or 0.0 for m in done) >= 0.85, [(m.step, m.eval_accuracy) for m in done]
        assert not any(m.failed for m in final if m.peer_id in logs), [m.failed for m in final]
        # the owner's shards moved: a survivor took each over, and every survivor knows the owner is dead
        assert sum(text.count("taking shard") for text in logs.values()) >= len(layout.shards_of(owner))
        assert all(f"worker {owner} gives no answer" in text for text in logs.values())
        # the worker without shards was found silent (at the latest when the owners waited for it to fetch
        # the final parameters) rather than waited for. The survivors report done before that linger
        # ends (a ping every 3 s, silent for owner_ping_timeout_s): poll their logs, bounded by the
        # linger's 30 s
        poll_until(
            lambda: any(f"worker {non_owner} gives no answer" in p.log() for p in survivors),
            60,
            what="an owner to declare the killed non-owner dead",
            interval_s=0.5,
        )
