"""End to end: the swarm dashboard (`status --serve`) in headless Chromium against a training swarm.

Four peer CLI processes on loopback (and a stock hivemind-dht bootstrap) agree on a plan and train a
short digits job; the dashboard runs as its own process (`python -m ravnest_p2p.status --serve
127.0.0.1:0`). Once its JSON shows the job training with a few points of history, Chromium (Debian's
package) loads the page headless: the test asserts on the rendered DOM (one row per peer, the cluster
table, the job id, a progress number, the plots) and keeps a screenshot. Skipped without Chromium.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.dashboard import DashboardServer
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.utils import StretchedDeadline
from tests.e2e._browser import (
    CHROMIUM,
    SKIP_REASON,
    assert_swarm_page,
    chromium_argv,
    parse_dom,
    shows_training,
)
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG

RUN_ID = "dash"
NUM_PEERS = 4
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


async def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    """Poll a blocking `predicate` off the event loop (the client's DHT keeps running) until truthy."""
    deadline = StretchedDeadline(timeout_s)  # longer on a busy host
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if deadline.expired():
            raise TimeoutError(f"timed out after {deadline.describe()} waiting for {what}")
        await asyncio.sleep(interval_s)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    argv = chromium_argv(*args, profile=profile)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
async def test_dashboard_in_headless_chromium_against_a_training_swarm(tmp_path: Path):
    config = tmp_path / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    (tmp_path / "swarm").mkdir()
    job = JobSpec(
        job_id="dash-digits",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        until_stopped=True,
        max_steps=4000,
        min_stages=2,
        eval_every_steps=16,
        averaging_period_steps=8,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )
    with LocalSwarm(
        NUM_PEERS,
        run_id=RUN_ID,
        bootstrap="hivemind-dht",
        peer_args=["--config", str(config)],
        workdir=tmp_path / "swarm",
    ) as swarm:
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(NUM_PEERS, timeout_s=90, measured=False)
            await client.publish_job(job)

            log_path = tmp_path / "dashboard.log"
            with log_path.open("wb") as log:
                dashboard = subprocess.Popen(
                    [sys.executable, "-m", "ravnest_p2p.status", "--initial-peers", *swarm.initial_peers]
                    + ["--run-id", RUN_ID, "--serve", "127.0.0.1:0"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
            try:
                url = await wait_for(
                    lambda: (m := re.search(r"on (http://\S+)", log_path.read_text())) and m.group(1),
                    60,
                    "the dashboard's URL",
                )

                def training() -> dict | None:
                    state = get_json(url + "api/state")
                    return state if shows_training(state, num_peers=NUM_PEERS) else None

                state = await wait_for(training, 240, "the dashboard to show the job training")

                shot = tmp_path / "dashboard.png"
                dumped = await asyncio.to_thread(
                    chromium, "--dump-dom", url, profile=tmp_path / "profile-dom"
                )
                assert dumped.returncode == 0, dumped.stderr[-2000:]
                taken = await asyncio.to_thread(
                    chromium,
                    f"--screenshot={shot}",
                    "--window-size=1280,1400",
                    url,
                    profile=tmp_path / "profile-shot",
                )
                assert taken.returncode == 0, taken.stderr[-2000:]
                assert shot.stat().st_size > 10_000
                if os.environ.get("RAVNEST_WRITE_RESULTS") == "1":
                    RESULTS.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(shot, RESULTS / "dashboard_loopback.png")
            finally:
                dashboard.terminate()
                assert dashboard.wait(30) == 0, log_path.read_text()[-2000:]
            await client.stop_job(job.job_id)

    dom = parse_dom(dumped.stdout)
    num_clusters = len(state["plan"]["clusters"])
    assert_swarm_page(dom, run_id=RUN_ID, job_id=job.job_id, num_peers=NUM_PEERS, num_clusters=num_clusters)
    assert "Traceback" not in log_path.read_text()


HOSTILE = '<img src=x onerror="document.title=1"><b id="pwned">x</b>'


def hostile_snapshot() -> dict:
    """A snapshot as strangers could shape it: every free-text field carries markup."""
    peer = {
        "peer_id": "QmHostile" + "h" * 20,
        "state": "ready",
        "client": False,
        "device": HOSTILE,
        "version": HOSTILE,
        "gflops": 1.0,
        "mem_gb": 1.0,
        "up_mbps": 1.0,
        "down_mbps": 1.0,
        "rtt_ms": None,
        "epoch": 1,
        "cluster": 0,
        "stage": 0,
        "age_s": 1.0,
        "plugin_models": [HOSTILE, "toy_net"],
        "plugin_datasets": [HOSTILE],
        "unfit_job": HOSTILE,
        "unfit_reason": HOSTILE,
        "unfit": HOSTILE,
    }
    job = {
        "job_id": HOSTILE,
        "model": HOSTILE,
        "dataset": "digits",
        "mode": "pipeline",
        "batch_size": 32,
        "max_steps": None,
        "done": False,
        "ended": True,
        "reason": HOSTILE,
        "micro_batches": 5,
        "optimizer_steps": 1,
        "train_wall_s": 1.0,
        "epoch": 1,
        "clusters": [],
    }
    stage_row = {"cluster": 0, "stage": 0, "peer_id": peer["peer_id"], "averaging_rounds": 1}
    stage_row |= {"last_round": 1, "last_round_s": 0.5, "last_round_participants": 2}
    stage_row |= {"averaging_mb_sent": 0.1, "age_s": 1.0, "done": False, "failed": HOSTILE}
    plan = {"epoch": 1, "digest": HOSTILE, "agree": 1, "published": 1, "clusters": []}
    averaging = {"min_rounds": 0, "max_rounds": 0, "slowest_round_s": None, "min_participants": None}
    return {
        "run_id": HOSTILE,
        "time": 1.0,
        "reads": 1,
        "num_peers": 1,
        "peers": [peer],
        "plan": plan,
        "job": job,
        "stages": [stage_row],
        "averaging": {**averaging, "mb_sent": 0.0},
        "history": {"0": [{"t": 0, "step": 1, "loss_step": 1, "loss": 1.0, "samples_per_s": 1.0}]},
        "error": HOSTILE,
    }


@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON)
async def test_markup_from_the_dht_is_shown_as_text_in_chromium(tmp_path: Path):
    async with DashboardServer(hostile_snapshot, "127.0.0.1", 0) as server:
        dumped = await asyncio.to_thread(chromium, "--dump-dom", server.url, profile=tmp_path / "profile")
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = parse_dom(dumped.stdout)
    assert dom.text_by_id["job-id"] == HOSTILE  # rendered, as text
    assert dom.text_by_id["run-id"] == HOSTILE
    assert "pwned" not in dom.text_by_id  # no element was made from the strings
    assert "<img" not in dumped.stdout
    assert "&lt;img" in dumped.stdout
    assert dom.row_classes.count("peer-row") == 1
    assert dom.row_classes.count("averaging-row") == 1
    assert f"failed: {HOSTILE}" in dom.text_by_id["averaging"]
    # plugins and why a peer is unfit for the active job: shown, as text
    assert f"models: {HOSTILE}, toy_net; data: {HOSTILE}" in dom.text_by_id["peers"]
    assert f"unfit: {HOSTILE}" in dom.text_by_id["peers"]
    assert dom.text_by_id["job-unfit"] == "1 peer unfit for it (see Peers)"
    assert dom.text_by_id["job-mode"] == "pipeline"
