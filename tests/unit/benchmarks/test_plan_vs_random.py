"""The plan-vs-random benchmark's pure parts: random placements keep the planned shape; rates; samples/s."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_plan_vs_random import merge, samples_per_s, slowed, true_rate_mbps
from benchmarks.plan_vs_random_driver import random_assignment

from ravnest_p2p.lab import load_profile
from ravnest_p2p.training.job import StagePlacement

PEERS = [f"Qm{i}" for i in range(8)]


def _planned() -> tuple[tuple[StagePlacement, ...], ...]:
    ranges = [(0, 1), (1, 2), (2, 3), (3, 4)]
    return tuple(
        tuple(
            StagePlacement(peer_id=PEERS[c * 4 + s], first_layer=a, end_layer=b)
            for s, (a, b) in enumerate(ranges)
        )
        for c in range(2)
    )


def test_random_placement_keeps_the_shape_uses_every_peer_once_and_is_seeded():
    planned = _planned()
    drawn = random_assignment(planned, list(reversed(PEERS)), seed=11)
    assert [[(s.first_layer, s.end_layer) for s in c] for c in drawn] == [
        [(s.first_layer, s.end_layer) for s in c] for c in planned
    ]
    assert sorted(s.peer_id for c in drawn for s in c) == sorted(PEERS)
    assert drawn == random_assignment(planned, PEERS, seed=11)  # input order does not matter
    assert drawn != random_assignment(planned, PEERS, seed=12)


def test_true_rates_read_the_profiles_per_destination_caps():
    profile = load_profile(Path(__file__).parents[3] / "peers" / "scenario_multi_datacenter.toml")
    assert true_rate_mbps(profile, "ohio-0", "ohio-1") == 200
    assert true_rate_mbps(profile, "ohio-0", "virginia-0") == 22.4


def test_samples_per_s_sums_the_clusters_first_stages():
    run = {
        "metrics": [
            {"stage": 0, "step": 10, "train_wall_s": 2.0},
            {"stage": 1, "step": 10, "train_wall_s": 0.0},
            {"stage": 0, "step": 10, "train_wall_s": 4.0},
        ]
    }
    assert samples_per_s(run, batch=100) == 500 + 250


def test_merge_keeps_the_other_profiles_rows_and_replaces_the_rerun_ones():
    old = {
        "machine": {"time_utc": "T0"},
        "rows": [{"profile": "multi_datacenter", "x": 1}, {"profile": "regional", "x": 2}],
        "runs": [{"profile": "multi_datacenter"}, {"profile": "regional", "old": True}],
    }
    rows, runs = merge(old, [{"profile": "regional", "x": 3, "run_utc": "T1"}], [{"profile": "regional"}])
    assert rows == [
        {"profile": "multi_datacenter", "x": 1, "run_utc": "T0"},
        {"profile": "regional", "x": 3, "run_utc": "T1"},
    ]
    assert runs == [{"profile": "multi_datacenter"}, {"profile": "regional"}]
    assert merge(None, rows, runs) == (rows, runs)


def test_slowed_profile_multiplies_every_rate_and_the_scale():
    profile = load_profile(Path(__file__).parents[3] / "peers" / "scenario_world_wide.toml")
    slow = slowed(profile, 0.25)
    assert slow.scale == profile.scale * 0.25
    assert true_rate_mbps(slow, "oregon-0", "ohio-0") == true_rate_mbps(profile, "oregon-0", "ohio-0") * 0.25
    assert slow.peers[0].upload_mbps == profile.peers[0].upload_mbps * 0.25
    assert slowed(profile, 1.0) == profile
