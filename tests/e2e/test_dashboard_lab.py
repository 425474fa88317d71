"""End to end on the lab: the dashboard in headless Chromium against a swarm in network namespaces.

Four peer processes, each in its own namespace behind a 100 Mbit/s link, agree on a plan and train a
digits job that a researcher (a fifth namespace) published. In the researcher's namespace run the
dashboard (`python -m ravnest_p2p.status --serve 127.0.0.1:PORT`, loopback of that namespace) and
Chromium (Debian's package), headless: the test asserts on the rendered DOM and keeps a screenshot (in
the test's tmp dir; also `benchmarks/results/dashboard.png` when RAVNEST_WRITE_RESULTS=1). The root
namespace cannot reach the lab, so the snapshot is polled from inside it too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.throttle import thread_env
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.transport import load_or_create_identity
from tests.e2e._browser import (
    CHROMIUM,
    SKIP_REASON,
    assert_swarm_page,
    chromium_argv,
    parse_dom,
    shows_training,
)
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG
from tests.integration.lab._support import assert_no_leftovers, requires_netns, unique_prefix

pytestmark = [
    pytest.mark.slow,
    *requires_netns,
    pytest.mark.timeout(600),
    pytest.mark.skipif(CHROMIUM is None, reason=SKIP_REASON),
]

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
RUN_ID = "dashlab"
NUM_PEERS = 4
PEER_PORT = 31451
DASHBOARD_PORT = 8089
LINK_MBPS = 100.0
_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


def job() -> JobSpec:
    return JobSpec(
        job_id="dashlab-digits",
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


def run_out(lab: NetnsLab, ns: int, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run `argv` in namespace `ns` to completion; its output as text."""
    proc = lab.run_in_ns(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())


def test_dashboard_in_headless_chromium_against_a_lab_swarm(tmp_path: Path):
    ids = [load_or_create_identity(tmp_path / f"id{i}.key") for i in range(NUM_PEERS)]
    config = tmp_path / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    link = {"upload_mbps": LINK_MBPS, "download_mbps": LINK_MBPS}
    peers = [{"name": f"s{i}", **link} for i in range(NUM_PEERS)]
    profile = parse_profile(
        {"run_id": RUN_ID, "shaping": "htb", "peers": [*peers, {"name": "researcher", **link}]}, source="test"
    )
    researcher = NUM_PEERS
    prefix = unique_prefix()
    url = f"http://127.0.0.1:{DASHBOARD_PORT}/"
    shot = tmp_path / "dashboard.png"
    with NetnsLab(profile, prefix=prefix) as lab:
        maddrs = [f"/ip4/{lab.address_of(i)}/tcp/{PEER_PORT}/p2p/{ids[i].peer_id}" for i in range(NUM_PEERS)]
        for i in range(NUM_PEERS):
            addr = f"/ip4/{lab.address_of(i)}/tcp/{PEER_PORT}"
            argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", RUN_ID, "--config", str(config)]
            argv += ["--identity-path", str(ids[i].path), "--host-maddrs", addr, "--announce-maddrs", addr]
            if i > 0:
                argv += ["--initial-peers", maddrs[0]]
            log = tmp_path / f"peer{i}.log"
            lab.run_in_ns(i, argv, env=thread_env(1), log_path=log)
            if i == 0:
                poll_until(lambda p=log: "join with" in p.read_text(errors="replace"), 90, what="peer 0")
        driver = [sys.executable, "-m", "tests.e2e._dashboard_lab_driver", "--initial-peers", *maddrs]
        driver += ["--run-id", RUN_ID, "--peers", str(NUM_PEERS), "--job", job().model_dump_json()]
        publisher = lab.run_in_ns(researcher, driver, log_path=tmp_path / "driver.log", cwd=REPO)
        dashboard_log = tmp_path / "dashboard.log"
        dashboard = [sys.executable, "-m", "ravnest_p2p.status", "--initial-peers", *maddrs]
        dashboard += ["--run-id", RUN_ID, "--serve", f"127.0.0.1:{DASHBOARD_PORT}"]
        lab.run_in_ns(researcher, dashboard, env={"PYTHONUNBUFFERED": "1"}, log_path=dashboard_log)
        poll_until(lambda: "dashboard of run" in dashboard_log.read_text(), 90, what="the dashboard")
        poll_until(lambda: publisher.poll() is not None, 240, what="the job's publisher")
        assert publisher.returncode == 0, (tmp_path / "driver.log").read_text()[-2000:]

        state: dict[str, Any] = {}

        def training() -> bool:
            nonlocal state
            got = run_out(lab, researcher, [sys.executable, "-c", _GET, url + "api/state"], 30)
            state = json.loads(got.stdout) if got.returncode == 0 else {}
            return shows_training(state, num_peers=NUM_PEERS)

        started = time.monotonic()
        poll_until(training, 300, what="the dashboard to show the job training", interval_s=2)
        print(f"the dashboard showed the job training {time.monotonic() - started:.0f} s after publishing")

        dumped = run_out(lab, researcher, chromium_argv("--dump-dom", url, profile=tmp_path / "p1"), 120)
        assert dumped.returncode == 0, dumped.stderr[-2000:]
        shoot = chromium_argv(f"--screenshot={shot}", "--window-size=1280,1100", url, profile=tmp_path / "p2")
        taken = run_out(lab, researcher, shoot, 120)
        assert taken.returncode == 0, taken.stderr[-2000:]
        assert shot.stat().st_size > 10_000
        started_pids = lab.pids
    assert_no_leftovers(prefix, started_pids)
    if os.environ.get("RAVNEST_WRITE_RESULTS") == "1":
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, RESULTS / "dashboard.png")

    num_clusters = len(state["plan"]["clusters"])
    dom = parse_dom(dumped.stdout)
    assert_swarm_page(dom, run_id=RUN_ID, job_id=job().job_id, num_peers=NUM_PEERS, num_clusters=num_clusters)
    assert "Traceback" not in dashboard_log.read_text()
