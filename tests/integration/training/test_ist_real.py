"""IST over real peers (real p2p daemons on loopback, in this process), from `RunClient` to done.

Three workers train a `wide_mlp` on digits; the gathered model equals the in-process IST on the same
batches (`strategies.train_ist_round`), so its held-out accuracy does too, and each round's traffic,
counted on the wire by the endpoints, is about one sub-network per worker.
"""

from __future__ import annotations

import os

import pytest
import torch

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.node import Peer
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.strategies import ist_bytes_per_worker, train_ist_round
from ravnest_p2p.training.ist_runner import IstRunner
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import IstConfig
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_shard import SyncBatches
from tests.integration.foundation.conftest import close_all, start_swarm

pytestmark = pytest.mark.timeout(300)

MODEL = {"in_features": 64, "hidden_features": [240, 240], "out_features": 10}


def _job(peers: list[Peer]) -> JobSpec:
    end = len(build_model("wide_mlp", MODEL))
    return JobSpec(
        job_id="ist-real",
        model="wide_mlp",
        model_params=MODEL,
        dataset="digits",
        batch_size=32,
        num_epochs=4,
        seed=0,
        optimizer=OptimizerConfig(name="sgd", lr=0.05),
        mode="ist",
        # generous deadlines: on a busy host a live worker must not look dead (that is another test)
        ist=IstConfig(num_workers=len(peers), local_steps=4, peer_timeout_s=60, round_timeout_s=200),
        assignment=tuple((StagePlacement(peer_id=p.peer_id, first_layer=0, end_layer=end),) for p in peers),
    )


def _in_process_accuracy(job: JobSpec, num_workers: int, steps: int) -> float:
    train, held_out = load_dataset(job)
    layers = build_model(job.model, job.model_params, seed=job.seed)
    batches = SyncBatches(train, batch_size=job.batch_size, seed=job.seed, num_workers=num_workers)
    k = job.ist.local_steps
    for r in range(-(-steps // k)):
        worker_batches = [
            [batches.batch(s, w) for s in range(r * k, min(steps, (r + 1) * k))] for w in range(num_workers)
        ]
        train_ist_round(
            layers,
            worker_batches,
            round_index=r,
            seed=job.seed,
            lr=job.optimizer.lr,
            loss_fn=make_loss("cross_entropy"),
        )
    model = torch.nn.Sequential(*layers).eval()
    with torch.no_grad():
        return float((model(held_out.inputs).argmax(-1) == held_out.labels).float().mean())


def _runner(peer: Peer) -> IstRunner | None:
    runner = peer.supervisor.runner
    return runner if isinstance(runner, IstRunner) else None


@pytest.mark.slow  # 24-30 s on a busy 2-core host (most of it starting the swarm)
async def test_ist_trains_from_the_client_to_done_like_the_in_process_ist() -> None:
    run_id = f"ist-{os.getpid()}"
    peers = await start_swarm(3, run_id, job_poll_s=0.5)
    try:
        async with await RunClient.connect(peers[0].maddrs, run_id) as client:
            await client.wait_for_peers(3, timeout_s=60, measured=False)
            job = _job(peers)
            await client.publish_job(job)
            metrics = await client.wait_for_job(job, timeout_s=200, poll_s=0.5)
        assert all(m.mode == "ist" for m in metrics)
        runners = [r for r in (_runner(p) for p in peers) if r is not None]
        assert len(runners) == 3
        assert not any(e["gone"] for r in runners for e in r.round_log), [r.round_log for r in runners]
        accuracy = _in_process_accuracy(job, 3, runners[0].steps)
        done = [m for m in metrics if m.done]
        assert done
        assert all(abs((m.eval_accuracy or 0.0) - accuracy) <= 0.01 for m in done), (accuracy, done)
        assert accuracy >= 0.85
        traffic = ist_bytes_per_worker(64, (240, 240), 10, 3)
        for runner in runners:
            pulled = [entry["bytes_pulled"] for entry in runner.round_log[1:]]
            mean = sum(pulled) / len(pulled)
            # (n - 1)/n of a sub-network comes from the others; the rest this worker trained itself
            assert 0.4 * traffic.total_bytes < mean < 1.1 * traffic.total_bytes, (mean, traffic)
            assert mean < traffic.full_model_bytes / 4
    finally:
        await close_all(peers)
