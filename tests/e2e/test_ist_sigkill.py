"""End to end, a fault: SIGKILL one of four IST workers (peer CLI processes) mid-run.

Four peer processes (and a stock hivemind-dht bootstrap) run an IST job published by `RunClient`
with an explicit assignment (one worker per peer). Once the victim has trained a few rounds, its
process group (peer and daemon) is SIGKILLed. The survivors find it unreachable within
`ist.peer_timeout_s`, finish that round without it (its part keeps its previous values), deal the
following rounds among the three of them, and end with a learned model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm, PeerProcess
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import IstConfig
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

RUN_ID = "istkill"
MODEL = {"in_features": 64, "hidden_features": [256, 256], "out_features": 10}


async def test_sigkill_an_ist_worker_mid_run(tmp_path: Path) -> None:
    config = tmp_path / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    with LocalSwarm(
        4, run_id=RUN_ID, bootstrap="hivemind-dht", peer_args=["--config", str(config)], workdir=tmp_path
    ) as swarm:
        by_id: dict[str, PeerProcess] = {p.peer_id: p for p in swarm.peers if p.peer_id}
        assert len(by_id) == 4
        workers = sorted(by_id)
        end = len(build_model("wide_mlp", MODEL))
        job = JobSpec(
            job_id="istkill",
            model="wide_mlp",
            model_params=MODEL,
            dataset="digits",
            batch_size=32,
            num_epochs=24,
            seed=0,
            optimizer=OptimizerConfig(name="sgd", lr=0.05),
            mode="ist",
            ist=IstConfig(num_workers=4, local_steps=4, peer_timeout_s=10.0),
            assignment=tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers),
        )
        victim = by_id[workers[-1]]
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(4, timeout_s=90, measured=False)
            await client.publish_job(job)
            deadline = time.monotonic() + 150
            while "IST round 5 committed" not in victim.log():  # polling its log, bounded by the deadline
                assert time.monotonic() < deadline, "the victim never trained 6 rounds"
                assert victim.popen.poll() is None, victim.log()[-2000:]
                await asyncio.sleep(0.2)
            assert "done after" not in victim.log(), "the job ended before the kill: make it longer"
            os.killpg(victim.popen.pid, signal.SIGKILL)
            victim.popen.wait(10)
            killed_at = time.monotonic()
            await client.wait_for_job(job, timeout_s=240, poll_s=1.0)
            survivors = [w for w in workers if w != victim.peer_id]
            final = []
            deadline = time.monotonic() + 60
            while len(final) < 3:  # every survivor publishes done within seconds of the first
                assert time.monotonic() < deadline, final
                final = [m for m in await client.metrics(job_id=job.job_id) if m.done]
                await asyncio.sleep(0.5)
        print(f"done {time.monotonic() - killed_at:.1f}s after the kill: {[m.eval_accuracy for m in final]}")
        assert {m.peer_id for m in final} == set(survivors)
        assert all((m.eval_accuracy or 0.0) >= 0.85 for m in final), final
        assert len({m.eval_accuracy for m in final}) == 1  # one gathered model
        for peer in survivors:
            assert "are gone" in by_id[peer].log(), by_id[peer].log()[-2000:]
