"""The planner benchmark's baseline arm still reaches the clustering it replaces (a moved symbol once
made `python -m benchmarks bench_planner` fail after every other row was computed)."""

from __future__ import annotations

from unittest import mock

from benchmarks import bench_planner
from benchmarks.planner_swarms import synthetic_swarm


def test_the_baseline_plan_runs_the_vendored_clustering() -> None:
    peers = synthetic_swarm(30, 1)
    with mock.patch.object(
        bench_planner, "baseline_cluster_peers", wraps=bench_planner.baseline_cluster_peers
    ) as baseline:
        plan = bench_planner._baseline_plan(peers, "medium")
    assert baseline.called
    assert plan.clusters
