"""The swarm launcher without processes: argv, state file round trip, status rows in profile order."""

from __future__ import annotations

from pathlib import Path

import pytest

import ravnest_p2p.swarm as swarm_cli
from ravnest_p2p.lab.launcher import Swarm, SwarmMember, SwarmState
from ravnest_p2p.lab.profiles import parse_profile

PROFILE = parse_profile(
    {
        "run_id": "u",
        "peers": [
            {"name": "bootstrap", "upload_mbps": 10, "memory_gb": 2},
            {"name": "b", "upload_mbps": 100, "compute_slowdown": 2},
        ],
    }
)


def test_bootstrap_name_avoids_profile_names_and_loopback_argv() -> None:
    swarm = Swarm(PROFILE, netns=False, prefix="rvu1", peer_config=None)
    assert swarm.bootstrap_name == "bootstrap-x"
    swarm._members.append(
        SwarmMember(name="boot", pid=1, log_path="x", maddrs=["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    )
    argv = swarm._peer_argv(0, PROFILE.peers[0])
    assert argv[argv.index("--host-maddrs") + 1] == "/ip4/127.0.0.1/tcp/0"
    assert argv[argv.index("--max-memory-gb") + 1] == "2.0"
    assert "--announce-maddrs" not in argv
    assert argv[argv.index("--initial-peers") + 1] == "/ip4/127.0.0.1/tcp/1/p2p/Qm"
    boot = swarm._bootstrap_argv(2)
    assert "--host_maddrs" in boot


def test_status_rows_follow_the_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    members = [
        SwarmMember(name=spec.name, pid=10 + i, log_path="x", peer_id=f"id{i}", profile=spec)
        for i, spec in enumerate(PROFILE.peers)
    ]
    state = SwarmState(
        prefix="rvu1",
        run_id="u",
        profile_path=None,
        netns=True,
        workdir=str(tmp_path),
        bootstrap=SwarmMember(name="boot", pid=1, log_path="x", namespace="rvu1-2", maddrs=["/ip4/x"]),
        peers=members,
    )
    assert SwarmState.model_validate_json(state.model_dump_json()) == state
    record = {"peer_id": "id1", "upload_mbps": 90.0, "download_mbps": 80.0, "flops": 1e9, "rtt_ms": 1.0}
    monkeypatch.setattr(swarm_cli, "_status_json", lambda s, t: {"peers": [record | {"state": "ready"}]})
    rows = swarm_cli.swarm_status(state)
    assert [r["name"] for r in rows] == ["bootstrap", "b"]
    assert not rows[0]["found"]
    assert rows[1]["found"]
    assert rows[1]["upload_mbps"] == 90.0
    assert rows[1]["configured_upload_mbps"] == 100.0
    table = swarm_cli._format_rows(rows)
    assert "1 of 2 peers live" in table
    assert "missing" in table


def test_status_without_a_swarm_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert swarm_cli.main(["status", "--prefix", "rvnone9"]) == 1
    assert "no swarm" in capsys.readouterr().err


def test_the_run_owner_reaches_every_peer_and_the_state() -> None:
    swarm = Swarm(PROFILE, netns=False, prefix="rvu2", peer_config=None, run_owner="QmOwnerKey")
    swarm._members.append(
        SwarmMember(name="boot", pid=1, log_path="x", maddrs=["/ip4/127.0.0.1/tcp/1/p2p/Qm"])
    )
    argv = swarm._peer_argv(0, PROFILE.peers[0])
    assert argv[argv.index("--run-owner") + 1] == "QmOwnerKey"
    assert swarm.state().run_owner == "QmOwnerKey"
    swarm.run_owner = None
    assert "--run-owner" not in swarm._peer_argv(0, PROFILE.peers[0])
