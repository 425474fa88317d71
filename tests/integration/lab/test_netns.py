"""The namespaced lab: shaped rates hold, cleanup is complete even after a crash."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ravnest_p2p.lab.netns import NetnsLab
from ravnest_p2p.lab.profiles import load_profile, parse_profile
from tests.integration.lab._support import assert_no_leftovers, measure_mbps, requires_netns, unique_prefix

pytestmark = requires_netns

PEERS_DIR = Path(__file__).resolve().parents[3] / "peers"
TOLERANCE = 0.15


def test_lab4_rates_follow_slower_end_and_down_cleans_up() -> None:
    profile = load_profile(PEERS_DIR / "lab4.toml")  # 20 / 50 / 100 / 200 Mbit/s
    prefix = unique_prefix()
    netlab = NetnsLab(profile, prefix=prefix)
    try:
        netlab.up()
        # 200 -> 50: bound by the receiver's download; 20 -> 200: bound by the sender's upload.
        for src, dst in [(3, 1), (0, 3)]:
            expected = min(profile.peers[src].upload_mbps or 0, profile.peers[dst].download_mbps or 0)
            measured = measure_mbps(netlab, src, dst, expected_mbps=expected)
            assert measured == pytest.approx(expected, rel=TOLERANCE), (src, dst, measured)
        pids = netlab.pids
        assert pids
    finally:
        netlab.down()
    assert_no_leftovers(prefix, pids)
    netlab.down()  # idempotent


def test_per_destination_matrix_and_tbf() -> None:
    profile = parse_profile(
        {
            "run_id": "matrix",
            "peers": [
                {"name": "a", "upload_mbps": 100, "upload_to_mbps": {"c": 25}},
                {"name": "b"},
                {"name": "c"},
            ],
        }
    )
    with NetnsLab(profile, prefix=unique_prefix()) as netlab:
        assert measure_mbps(netlab, 0, 2, expected_mbps=25, seconds=1.5) == pytest.approx(25, rel=TOLERANCE)
        assert measure_mbps(netlab, 0, 1, expected_mbps=100, seconds=1.5) == pytest.approx(100, rel=TOLERANCE)
    tbf = parse_profile(
        {"run_id": "tbf", "shaping": "tbf", "peers": [{"name": "a", "upload_mbps": 40}, {"name": "b"}]}
    )
    with NetnsLab(tbf, prefix=unique_prefix()) as netlab:
        assert measure_mbps(netlab, 0, 1, expected_mbps=40, seconds=1.5) == pytest.approx(40, rel=TOLERANCE)


def test_down_after_simulated_crash_cleans_up() -> None:
    profile = parse_profile(
        {"run_id": "crash", "peers": [{"name": "a"}, {"name": "b", "compute_slowdown": 2.0, "memory_gb": 1}]}
    )
    prefix = unique_prefix()
    crashed = NetnsLab(profile, prefix=prefix)
    crashed.up()
    throttle = crashed.throttle_for("b", base_cpus=1.0)
    throttle.create()
    # Processes the crashed owner never reaps, in sessions of their own, as launched peers would be.
    orphans = [
        crashed.run_in_ns("a", ["sleep", "60"], stdout=subprocess.DEVNULL),
        crashed.run_in_ns("b", ["sleep", "60"], stdout=subprocess.DEVNULL, throttle=throttle),
    ]
    with pytest.raises(RuntimeError, match="in use"):
        NetnsLab(profile, prefix=prefix).up()
    NetnsLab(profile, prefix=prefix).down()  # fresh object: knows nothing but the prefix
    for orphan in orphans:
        assert orphan.wait(timeout=10) != 0
    assert_no_leftovers(prefix, [o.pid for o in orphans])
    cgroups = [p for p in Path("/sys/fs/cgroup").rglob(f"ravnest-{prefix}-*") if p.is_dir()]
    assert not cgroups


def test_run_in_ns_env_and_log(tmp_path: Path) -> None:
    profile = parse_profile({"run_id": "env", "peers": [{"name": "a"}, {"name": "b"}]})
    log = tmp_path / "logs" / "a.log"
    with NetnsLab(profile, prefix=unique_prefix()) as netlab:
        proc = netlab.run_in_ns(
            "b",
            ["sh", "-c", 'echo "$RVT_VALUE"; ip -o -4 addr show scope global'],
            env={"RVT_VALUE": "42"},
            log_path=log,
        )
        assert proc.wait(timeout=10) == 0
    text = log.read_text()
    assert text.startswith("42\n")
    assert f"{netlab.address_of(1)}/15" in text


@pytest.mark.parametrize("path", sorted(PEERS_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_profile_builds(path: Path) -> None:
    profile = load_profile(path)
    prefix = unique_prefix()
    with NetnsLab(profile, prefix=prefix) as netlab:
        for i, peer in enumerate(profile.peers):
            qdiscs = subprocess.run(
                ["tc", "-n", netlab.namespace_of(i), "class", "show", "dev", netlab.interface_of(i)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            expected_classes = 0 if peer.upload_mbps is None and not peer.upload_to_mbps else 1
            if peer.upload_to_mbps:
                expected_classes = 2 + len(peer.upload_to_mbps)
            assert qdiscs.count("class htb") == expected_classes, (peer.name, qdiscs)
    assert_no_leftovers(prefix, [])


def _congestion_control(namespace: str) -> str:
    cmd = ["ip", "netns", "exec", namespace, "sysctl", "-n", "net.ipv4.tcp_congestion_control"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def test_peers_run_the_profiles_tcp_congestion_control_or_the_hosts() -> None:
    host = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    default = parse_profile({"run_id": "cc", "peers": [{"name": "a"}]})
    with NetnsLab(default, prefix=unique_prefix()) as lab:
        assert _congestion_control(lab.namespace_of(0)) == "reno"
    inherit = parse_profile({"run_id": "cc", "tcp_congestion_control": None, "peers": [{"name": "a"}]})
    with NetnsLab(inherit, prefix=unique_prefix()) as lab:
        assert _congestion_control(lab.namespace_of(0)) == host
