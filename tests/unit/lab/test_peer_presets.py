"""The fast-membership preset is a config every peer accepts, and it really is fast."""

from pathlib import Path

from ravnest_p2p.lab.peer_presets import FAST_MEMBERSHIP_PEER_CONFIG
from ravnest_p2p.peer import config_from_args


def test_fast_membership_preset_parses_into_a_peer_config(tmp_path: Path) -> None:
    path = tmp_path / "peer.toml"
    path.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    config, _ = config_from_args(["--config", str(path), "--run-id", "preset-test"])
    assert config.record_ttl_s == 6.0
    assert config.membership.grace_s == 3.0
    assert config.probe.period_s == 300.0
