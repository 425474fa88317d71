"""The world-wide lab profile is DT-FM's table x scale on every pair, and the generator rewrites it as is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.scenario_profile import inter_link, render_profile

from ravnest_p2p.lab import load_profile

REPO = Path(__file__).resolve().parents[3]
DATA = json.loads((REPO / "benchmarks" / "data" / "networks.json").read_text())
PROFILE = REPO / "peers" / "scenario_world_wide.toml"


def test_world_wide_rates_are_the_inter_region_table_times_scale_on_every_pair():
    scenario = DATA["scenarios"]["world_wide"]
    profile = load_profile(PROFILE)
    regions = [g for g, _ in scenario["groups"]]
    assert [p.name for p in profile.peers] == [f"{g}-0" for g in regions]
    assert profile.scale == pytest.approx(0.17)
    checked = 0
    for peer in profile.peers:
        src = peer.name.removesuffix("-0")
        assert peer.upload_mbps == peer.download_mbps == pytest.approx(2000 * profile.scale)
        assert set(peer.upload_to_mbps) == {p.name for p in profile.peers} - {peer.name}
        for dst_name, rate in peer.upload_to_mbps.items():
            gbps = inter_link(scenario, src, dst_name.removesuffix("-0"))[1]
            assert rate == pytest.approx(gbps * 1000 * profile.scale, abs=1e-3)
            checked += 1
    assert checked == 8 * 7
    fastest = max(r for p in profile.peers for r in p.upload_to_mbps.values())
    assert 190 <= fastest <= 210  # the fastest link in use is ~200 Mbit/s, as in the other profiles
    assert profile.workload is not None
    assert profile.workload.dp_message_bytes == round(DATA["workload"]["c_dp_bytes"] * profile.scale)
    assert profile.workload.pp_message_bytes == round(DATA["workload"]["c_pp_bytes"] * profile.scale)


def test_generator_reproduces_the_shipped_file():
    text = render_profile(
        "world_wide", DATA["scenarios"]["world_wide"], DATA["workload"], peers_per_group=1, scale=0.17
    )
    assert text == PROFILE.read_text()


def test_inter_link_reads_either_order_and_rejects_unknown_pairs():
    scenario = DATA["scenarios"]["world_wide"]
    assert (
        inter_link(scenario, "oregon", "virginia")
        == inter_link(scenario, "virginia", "oregon")
        == (67.0, 0.79)
    )
    with pytest.raises(KeyError):
        inter_link(scenario, "oregon", "mars")
