"""End to end: a stock hivemind-dht bootstrap, three peer CLI processes, the status tool."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import psutil
import pytest

from ravnest_p2p.swarm import LocalSwarm, poll_until
from ravnest_p2p.utils.aio import load_stretch

pytestmark = pytest.mark.timeout(900)  # the waits below grow with the host's load (up to 6x)


def status_json(initial_peers: list[str], run_id: str) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ravnest_p2p.status",
            "--initial-peers",
            *initial_peers,
            "--run-id",
            run_id,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60 * load_stretch(),  # its imports alone took 22 s at load 12 on 2 cores
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def daemons_of(pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(pid).children(recursive=True) if c.name() == "p2pd"]


def test_hivemind_dht_bootstrap_three_peers_status_and_clean_sigterm():
    with LocalSwarm(3, run_id="e2e", bootstrap="hivemind-dht") as swarm:
        measured: dict = {}

        def three_measured_peers() -> bool:
            nonlocal measured
            measured = status_json(swarm.initial_peers, "e2e")
            peers = measured["peers"]
            return len(peers) == 3 and all(
                p["flops"] > 0 and p["upload_mbps"] > 0 and p["download_mbps"] > 0 for p in peers
            )

        poll_until(
            three_measured_peers,
            timeout_s=120 * load_stretch(),
            what="3 measured peers in the status tool",
            interval_s=1,
        )
        assert {p["peer_id"] for p in measured["peers"]} == {p.peer_id for p in swarm.peers}
        assert measured["time"] > 0

        # without --run-id the tool looks at run 'default', where these peers are not: it says so
        text = subprocess.run(
            [sys.executable, "-m", "ravnest_p2p.status", "--initial-peers", *swarm.initial_peers],
            capture_output=True,
            text=True,
            timeout=60 * load_stretch(),
            check=True,
        ).stdout
        assert "0 peers" in text
        assert "pass it here as --run-id" in text
        # the peers' status lines carry the time
        assert re.search(r"^\d\d:\d\d:\d\d status: state=", swarm.peers[0].log(), re.MULTILINE)

        daemons = {p.name: daemons_of(p.popen.pid) for p in swarm.peers}
        assert all(len(d) == 1 for d in daemons.values()), daemons
        for peer in swarm.peers:
            peer.popen.send_signal(15)
        for peer in swarm.peers:
            assert peer.popen.wait(60) == 0, peer.log()[-2000:]
            assert "Traceback" not in peer.log()
        for pids in daemons.values():
            for pid in pids:
                assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_unreachable_bootstrap_is_a_one_line_error():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ravnest_p2p.peer",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/9/p2p/QmVRjtfVd4D7oN4Ca6PPG8GoxuGoYwp47sEk9yYknEHqAj",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
