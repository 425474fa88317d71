"""Swarm profiles: the shipped files parse, bad fields are rejected with a message naming file and field."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ravnest_p2p.errors import ConfigError
from ravnest_p2p.lab.profiles import ShapingMode, SwarmProfile, load_profile, parse_profile

PEERS_DIR = Path(__file__).resolve().parents[3] / "peers"
GOOD = """
run_id = "t"
shaping = "htb"

[[peers]]
name = "a"
upload_mbps = 20
download_mbps = 40.5
compute_slowdown = 2.0
memory_gb = 4

[peers.upload_to_mbps]
b = 5

[[peers]]
name = "b"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "swarm.toml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("path", sorted(PEERS_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_profile_parses(path: Path) -> None:
    profile = load_profile(path)
    assert profile.peers


def test_required_profiles_exist() -> None:
    names = {p.name for p in PEERS_DIR.glob("*.toml")}
    assert {"hetero8.toml", "hetero16.toml", "uniform4.toml", "lab4.toml"} <= names
    assert len([n for n in names if n.startswith("scenario_")]) == 5


def test_hetero8_shape() -> None:
    profile = load_profile(PEERS_DIR / "hetero8.toml")
    kinds = [p.name.split("-")[0] for p in profile.peers]
    assert (kinds.count("fast"), kinds.count("medium"), kinds.count("slow")) == (2, 3, 3)
    uploads = [p.upload_mbps for p in profile.peers if p.upload_mbps is not None]
    assert max(uploads) / min(uploads) >= 10


def test_lab4_rates() -> None:
    profile = load_profile(PEERS_DIR / "lab4.toml")
    assert [p.upload_mbps for p in profile.peers] == [20, 50, 100, 200]
    assert len(load_profile(PEERS_DIR / "hetero16.toml").peers) == 16


def test_scenarios_scale_bandwidth_and_messages_together() -> None:
    profile = load_profile(PEERS_DIR / "scenario_regional.toml")
    assert profile.scale == pytest.approx(0.1)
    assert profile.workload is not None
    assert profile.workload.dp_message_bytes == round(650_000_000 * 0.1)
    assert profile.peers[0].upload_mbps == pytest.approx(2000 * 0.1)


def test_good_profile(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, GOOD))
    assert isinstance(profile, SwarmProfile)
    a, b = profile.peers
    assert (a.upload_mbps, a.download_mbps, a.compute_slowdown, a.memory_gb) == (20, 40.5, 2.0, 4)
    assert a.upload_to_mbps == {"b": 5}
    assert (b.upload_mbps, b.download_mbps, b.compute_slowdown, b.memory_gb) == (None, None, 1.0, None)
    assert profile.shaping is ShapingMode.HTB
    assert profile.index_of("b") == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("upload_mbps = 20", "upload_mbps = -1"), "peers.0.upload_mbps"),
        (("upload_mbps = 20", "upload_mbps = nan"), "peers.0.upload_mbps"),
        (("upload_mbps = 20", "uplaod_mbps = 20"), "peers.0.uplaod_mbps"),
        (("compute_slowdown = 2.0", "compute_slowdown = 0.5"), "peers.0.compute_slowdown"),
        (("memory_gb = 4", "memory_gb = 0"), "peers.0.memory_gb"),
        (('shaping = "htb"', 'shaping = "hfsc"'), "shaping"),
        (('run_id = "t"', 'run_id = "t"\ncolour = "red"'), "colour"),
        (("b = 5", "zz = 5"), "unknown peers ['zz']"),
        (("b = 5", "a = 5"), "names the peer itself"),
        (('name = "b"', 'name = "a"'), "repeated: ['a']"),
        (('name = "b"', 'name = "has space"'), "peers.1.name"),
        (('shaping = "htb"', 'shaping = "tbf"'), "shaping='tbf' cannot shape per destination"),
    ],
)
def test_bad_field_rejected_naming_file_and_field(
    tmp_path: Path, change: tuple[str, str], field: str
) -> None:
    path = _write(tmp_path, GOOD.replace(*change, 1))
    with pytest.raises(ValueError) as info:
        load_profile(path)
    assert isinstance(info.value, ConfigError)
    assert str(path) in str(info.value)
    assert field in str(info.value)


def test_no_peers_rejected() -> None:
    with pytest.raises(ConfigError, match=r"mem.toml: .*peers"):
        parse_profile({"run_id": "x", "peers": []}, source="mem.toml")


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_profile(_write(tmp_path, "run_id = "))
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "absent.toml")
