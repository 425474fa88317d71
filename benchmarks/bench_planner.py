"""Planner at scale: `make_plan` CPU seconds at 100 / 300 / 1,000 / 10,000 peers, objective vs. the old code.

Swarms come from `planner_swarms` (seeded device classes with lognormal spreads); two models, one that
fits on every peer (up to one cluster per peer: the clustering's worst case) and one that needs a
several-stage pipeline. CPU time is `time.process_time` (robust to a busy host, which this one is).
At 100 and 300 peers the same swarm is also planned with the clustering this project shipped before
(`planner_baseline`, vendored unchanged) and both plans are scored the same way:

* ``k``: clusters in the final plan (more replicas = more samples/s; the clustering's 2nd priority),
* ``J``: homogeneity + throughput imbalance of those clusters (its 3rd priority; lower is better),
* ``plan_mb_per_s``: the plan's estimated micro-batches per second, summed over its pipelines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from benchmarks.harness import RESULTS_DIR, record
from benchmarks.planner_baseline import baseline_cluster_peers
from benchmarks.planner_swarms import JOB, model_layers, synthetic_swarm
from ravnest_p2p.planning import PeerCapacity, Plan, cluster_peers, homogeneity, make_plan, peer_features
from ravnest_p2p.planning.clustering import Clustering

SEED = 2026
BASELINE_MAX_PEERS = 300


def plan_objective(peers: Sequence[PeerCapacity], plan: Plan) -> dict[str, float]:
    """Score a plan as the clustering does: ``J = H + CV(cluster FLOP/s)`` over the planned clusters."""
    ordered = sorted(peers, key=lambda p: p.peer_id)
    index = {p.peer_id: i for i, p in enumerate(ordered)}
    features = peer_features(ordered)
    rows, labels, throughput = [], [], []
    for c, cluster in enumerate(plan.clusters):
        members = [index[pid] for pid in cluster.peer_ids]
        rows += members
        labels += [c] * len(members)
        throughput.append(sum(ordered[i].flops_per_s for i in members))
    if not rows:
        return {"k": 0, "J": float("nan"), "mb_per_s": 0.0}
    h = homogeneity(features[rows], np.array(labels))
    t = np.array(throughput)
    imbalance = float(t.std() / t.mean()) if len(t) > 1 else 0.0
    rate = sum(c.throughput_samples_per_s for c in plan.clusters)
    return {"k": len(plan.clusters), "J": h + imbalance, "mb_per_s": rate}


def clustering_objective(
    peers: Sequence[PeerCapacity], kind: str, cluster: Callable[..., Clustering]
) -> dict[str, float]:
    """The clustering's own objective before the spare rule: ``k`` and ``J`` over every peer."""
    job = JOB.model_copy(update={"spare_ratio": 0.0})
    clusters, _ = cluster(peers, model_layers(kind), job, epoch=1)
    ordered = sorted(peers, key=lambda p: p.peer_id)
    index = {p.peer_id: i for i, p in enumerate(ordered)}
    labels = np.full(len(ordered), -1)
    for c, members in enumerate(clusters):
        labels[[index[p.peer_id] for p in members]] = c
    placed = labels >= 0
    features = peer_features(ordered)[placed]
    flops = np.array([p.flops_per_s for p in ordered])
    throughput = np.bincount(labels[placed], weights=flops[placed])
    imbalance = float(throughput.std() / throughput.mean()) if len(throughput) > 1 else 0.0
    return {"k": len(clusters), "J": homogeneity(features, labels[placed]) + imbalance}


def _timed(fn: Callable[[], Plan]) -> tuple[Plan, float]:
    started = time.process_time()
    plan = fn()
    return plan, time.process_time() - started


def _baseline_plan(peers: Sequence[PeerCapacity], kind: str) -> Plan:
    with mock.patch("ravnest_p2p.planning.cluster_plans.cluster_peers", baseline_cluster_peers):
        return make_plan(peers, model_layers(kind), JOB, epoch=1)


def _plot(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for color, kind in zip(("tab:blue", "tab:green"), sorted({r["model"] for r in rows}), strict=False):
        for impl, style in (("new", "o-"), ("baseline", "s--")):
            points = [
                (r["peers"], r[f"{impl}_cpu_s"]) for r in rows if r["model"] == kind and f"{impl}_cpu_s" in r
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, color=color, label=f"{impl}, {kind} model")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peers")
    ax.set_ylabel("make_plan CPU seconds")
    ax.set_title("Planner cost vs. swarm size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(quick: bool) -> None:
    sizes = [100, 300, 1000] if quick else [100, 300, 1000, 10_000]
    rows: list[dict[str, Any]] = []
    for kind in ("small", "medium"):
        layers = model_layers(kind)
        for num_peers in sizes:
            peers = synthetic_swarm(num_peers, SEED)
            plan, cpu_s = _timed(lambda: make_plan(peers, layers, JOB, epoch=1))  # noqa: B023
            row: dict[str, Any] = {"model": kind, "peers": num_peers, "new_cpu_s": cpu_s}
            row.update(
                {f"new_cl_{k}": v for k, v in clustering_objective(peers, kind, cluster_peers).items()}
            )
            row.update({f"new_plan_{k}": v for k, v in plan_objective(peers, plan).items()})
            if num_peers <= BASELINE_MAX_PEERS:
                base, base_s = _timed(lambda: _baseline_plan(peers, kind))  # noqa: B023
                row["baseline_cpu_s"] = base_s
                baseline_cl = clustering_objective(peers, kind, baseline_cluster_peers)
                row.update({f"baseline_cl_{k}": v for k, v in baseline_cl.items()})
                row.update({f"baseline_plan_{k}": v for k, v in plan_objective(peers, base).items()})
            rows.append(row)
            print(row, flush=True)
    plotted = _plot(rows, RESULTS_DIR / "planner.png")
    notes = (
        "`make_plan` CPU seconds (time.process_time, one run each) on seeded synthetic swarms "
        "(benchmarks/planner_swarms.py: laptops, gaming GPUs, workstations, datacenter cards; lognormal "
        "FLOP/s, memory and links). Models: `small` fits on every peer (k up to n), `medium` needs ~2-8 "
        "peers. `baseline_*` = the clustering shipped before the rewrite (benchmarks/planner_baseline.py, "
        "vendored) inside the same make_plan, run at <= 300 peers only (it takes minutes at 1,000). "
        "`*_cl_k`, `*_cl_J`: the clustering's own objective with the spare rule off (spare_ratio 0): "
        "clusters (priority 2, higher is better) and J = homogeneity + CV of cluster FLOP/s over every "
        "peer (priority 3, lower is better). `*_plan_*`: the same scores on the final plan "
        "(spare_ratio 0.25: laggards and slow clusters wait as spares) and plan_mb_per_s = sum over "
        "pipelines of micro-batches/s (higher is better)."
        + (" Plot: planner.png." if plotted else " (matplotlib missing: no plot.)")
        + (" Quick mode: no 10,000-peer case." if quick else "")
    )
    record("planner", rows, notes=notes)
