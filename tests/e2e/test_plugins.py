"""End to end, bring your own model and data: a throwaway package registers both through entry points.

Three peer processes have the package on their PYTHONPATH, a fourth does not. A job that names the
plugin model and data set, published without an assignment, is planned over the three only and trains
(held-out accuracy far above chance); the fourth peer's signed record says which job it cannot serve and
why, and `python -m ravnest_p2p.status` prints it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.models.plugins import reload_plugins
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm
from ravnest_p2p.training.datasets import reload_dataset_plugins
from ravnest_p2p.training.job import JobSpec
from tests._plugin_pkg import write_plugin_package
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

RUN_ID = "plugins-e2e"
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = write_plugin_package(tmp_path / "plugin")
    monkeypatch.syspath_prepend(str(root))  # the researcher's client has the package too
    reload_plugins()
    reload_dataset_plugins()
    yield root
    monkeypatch.undo()
    sys.modules.pop("ravnest_demo_plugin", None)
    reload_plugins()
    reload_dataset_plugins()


async def test_peers_with_the_plugin_train_it_and_a_peer_without_says_why(tmp_path: Path, plugin_dir: Path):
    config = tmp_path / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    with_plugin = {"PYTHONPATH": os.pathsep.join([SRC, str(plugin_dir)])}
    without = {"PYTHONPATH": SRC}
    job = JobSpec(
        job_id="plugin-job",
        model="demo_mlp",
        model_params={"hidden": 32},
        dataset="demo_blobs",
        dataset_config={"num_samples": 800},
        batch_size=32,
        num_epochs=20,
        max_steps=60,
        min_stages=2,
        eval_every_steps=20,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
    )
    with LocalSwarm(
        4,
        run_id=RUN_ID,
        bootstrap="hivemind-dht",
        peer_args=["--config", str(config)],
        per_peer_env=[with_plugin, with_plugin, with_plugin, without],
        workdir=tmp_path,
    ) as swarm:
        plain = swarm.peers[3]
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            records = await client.wait_for_peers(4, timeout_s=90, measured=False)
            advertised = {r.peer_id: r.plugin_models for r in records}
            assert advertised[plain.peer_id] == ()
            assert sorted(v for pid, v in advertised.items() if pid != plain.peer_id) == [("demo_mlp",)] * 3
            await client.publish_job(job)
            final = await client.wait_for_job(job, timeout_s=240, poll_s=0.5)
            records = {r.peer_id: r for r in await client.peers()}

        trainers = {m.peer_id for m in final}
        assert trainers
        assert plain.peer_id not in trainers
        firsts = [m for m in final if m.stage == 0]
        assert all(m.done and m.eval_accuracy is not None and m.eval_accuracy > 0.8 for m in firsts), firsts
        assert all(m.num_stages >= 2 for m in final)
        mine = records[plain.peer_id]
        assert mine.unfit_job == "plugin-job"
        assert mine.unfit_reason is not None
        assert "model 'demo_mlp'" in mine.unfit_reason
        assert "data set 'demo_blobs'" in mine.unfit_reason
        assert "cannot serve it" in plain.log()

        status = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "ravnest_p2p.status",
                "--run-id",
                RUN_ID,
                "--initial-peers",
                *swarm.initial_peers,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": SRC},
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert f"…{plain.peer_id[-12:]} cannot serve job plugin-job: model 'demo_mlp'" in status.stdout
        assert "serves plugin models [demo_mlp], data sets [demo_blobs]" in status.stdout
