"""Swap peers between clusters while the measured links say the swarm trains faster.

Problem. With a link matrix, `sites.cluster_by_site` keeps pipelines inside groups of well-connected
peers, and `ordering.order_stages` orders each cluster's stages by its measured pairs. But inside one
site the split into clusters is made from the peers' own figures (compute, memory, access links), blind
to the matrix: on the lab's world-wide profile (8 regions, one peer each, all chained into one site by
single linkage) the planned 2 x 4 split put a 17.9 Mbit/s hop into one pipeline where another split
has none slower than 29.5 (helper ww, session 12).

Method. First-improvement local search over swaps of two peers of different clusters, each swap scored
exactly as the plan would be: both clusters re-planned (`cluster_plans.cluster_plan`: stage order and
partition with the matrix), kept when the swarm's modelled samples/s (`plan_throughput`) grows by more
than a relative 1e-9. Clusters keep their sizes and indices. Peers and clusters are visited in a
fixed order (cluster index, then peer id), so every peer computes the same result from the same view.

Cost. Each swap re-plans two clusters, so the search runs only on small swarms (at most `MAX_PEERS`
planned peers) and stops after `MAX_EVALUATIONS` cluster plans; larger swarms keep the clustering's
split (their sites already carry the link structure).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from ravnest_p2p.planning.types import ClusterPlan, InfeasiblePlan, PeerCapacity

__all__ = ["MAX_EVALUATIONS", "MAX_PEERS", "swap_between_clusters"]

MAX_PEERS = 64
"""Largest number of planned peers the swap search runs on."""
MAX_EVALUATIONS = 4_000
"""Cluster plans the search may compute (two per swap tried)."""


def swap_between_clusters(
    plans: Sequence[ClusterPlan],
    peers: Sequence[PeerCapacity],
    plan_cluster: Callable[[int, list[PeerCapacity]], ClusterPlan],
) -> list[ClusterPlan]:
    """``plans`` after swaps of peers between clusters that raise the modelled samples/s (see module).

    Args:
        plans: the clusters' plans (with the matrix).
        peers: at least every peer the plans name.
        plan_cluster: ``(index, members) -> ClusterPlan`` with the matrix; raises `InfeasiblePlan`.
    """
    current = list(plans)
    if len(current) < 2 or sum(len(p.stages) for p in current) > MAX_PEERS:
        return current
    by_id = {peer.peer_id: peer for peer in peers}
    members = [sorted((by_id[pid] for pid in plan.peer_ids), key=lambda p: p.peer_id) for plan in current]
    evaluations = 0
    improved = True
    while improved and evaluations < MAX_EVALUATIONS:
        improved = False
        for i, j, p, q in _swaps(members):
            if evaluations >= MAX_EVALUATIONS:
                break
            new_i = [q if m.peer_id == p.peer_id else m for m in members[i]]
            new_j = [p if m.peer_id == q.peer_id else m for m in members[j]]
            evaluations += 2
            try:
                plan_i = plan_cluster(current[i].index, new_i)
                plan_j = plan_cluster(current[j].index, new_j)
            except InfeasiblePlan:
                continue
            before = current[i].throughput_samples_per_s + current[j].throughput_samples_per_s
            after = plan_i.throughput_samples_per_s + plan_j.throughput_samples_per_s
            if after > before * (1.0 + 1e-9):
                current[i], current[j] = plan_i, plan_j
                members[i] = sorted(new_i, key=lambda m: m.peer_id)
                members[j] = sorted(new_j, key=lambda m: m.peer_id)
                improved = True
                break
    return current


def _swaps(members: list[list[PeerCapacity]]) -> Iterator[tuple[int, int, PeerCapacity, PeerCapacity]]:
    """Every (cluster i, cluster j > i, peer of i, peer of j), in a fixed order."""
    for i in range(len(members)):
        for j in range(i + 1, len(members)):
            for p in members[i]:
                for q in members[j]:
                    yield i, j, p, q
