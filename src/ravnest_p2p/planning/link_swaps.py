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
than a relative 1e-9. The swaps are visited in a fixed cyclic order (cluster pair, then member positions
by peer id) until a full round brings no gain, so every peer computes the same result from the same
view. Clusters keep their sizes and indices. Only with measured pairs (an empty matrix keeps the
clustering's split, as before).

Cost. Each swap re-plans two clusters (~1.4 ms each for 4-stage clusters on this 2-core host), so the
search runs only when at most `MAX_PEERS` peers are planned, between clusters of at most `MAX_STAGES`
stages, and stops after `MAX_EVALUATIONS` cluster plans. Measured (`benchmarks.bench_planner_links`'
city swarms, medium model, up to 32 reported links per peer, modelled samples/s on the *true* links):
40 peers (32 planned, 8 clusters) 71.8 -> 111.2 in 1.1 s CPU; 34 peers 17.2 -> 18.1 in 0.2 s; 33 peers
in clusters of up to 9 stages 0.4-0.9 s. With 400 evaluations the 40-peer swarm gained nothing, and at
64 peers (half of the pairs unmeasured, estimated optimistically from up/down) the swaps chased the
estimates: 296 -> 292 true. Larger swarms keep the clustering's split; their sites carry the city
structure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from ravnest_p2p.planning.types import ClusterPlan, InfeasiblePlan, PeerCapacity

__all__ = ["MAX_EVALUATIONS", "MAX_PEERS", "MAX_STAGES", "swap_between_clusters"]

MAX_PEERS = 32
"""Largest number of planned peers the swap search runs on."""
MAX_EVALUATIONS = 1_500
"""Cluster plans the search may compute (two per swap tried)."""
MAX_STAGES = 6
"""Only clusters of at most this many stages swap (their stage order is exact and cheap, `ordering`):
33 peers in clusters of up to 9 stages took 3.1 s CPU without this bound, 1,500 plans."""


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
    small = [i for i, m in enumerate(members) if len(m) <= MAX_STAGES]
    slots = [
        (i, j, a, b)
        for i, j in itertools.combinations(small, 2)
        for a in range(len(members[i]))
        for b in range(len(members[j]))
    ]
    evaluations = since_gain = 0
    for i, j, a, b in itertools.cycle(slots):  # until a full round without a gain, or the budget
        if since_gain >= len(slots) or evaluations >= MAX_EVALUATIONS:
            break
        since_gain += 1
        p, q = members[i][a], members[j][b]
        new_i = sorted([q if m is p else m for m in members[i]], key=lambda m: m.peer_id)
        new_j = sorted([p if m is q else m for m in members[j]], key=lambda m: m.peer_id)
        evaluations += 2
        try:
            plan_i = plan_cluster(current[i].index, new_i)
            plan_j = plan_cluster(current[j].index, new_j)
        except InfeasiblePlan:
            continue
        before = current[i].throughput_samples_per_s + current[j].throughput_samples_per_s
        after = plan_i.throughput_samples_per_s + plan_j.throughput_samples_per_s
        if after > before * (1.0 + 1e-9):
            current[i], current[j], members[i], members[j] = plan_i, plan_j, new_i, new_j
            since_gain = 0
    return current
