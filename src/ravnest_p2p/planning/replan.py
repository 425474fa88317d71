"""Re-plans that keep the clusters still whole: a change in one cluster does not move the others.

Problem. `make_plan` clusters from scratch with a generator seeded by the epoch, so a re-plan after one
kill or one join reshuffled nearly every cluster (simulated: a cluster survived a kill among 8 peers in
2 of 20 trials, a join in 1 of 20), and every reshuffled cluster stops, hands its state over and warms
up again. A cluster whose ordered peers and layer ranges are unchanged keeps training in place instead
(`training.continuity`), so the planner should leave such clusters alone.

Input. ``previous``: for each live peer that ran a stage, where it sat in its active agreed plan
(epoch, cluster, stage, layer range), from its own signed record. Every member reads the same records,
so a newcomer that never saw the previous plan computes the same re-plan, bit for bit; the membership
passes only placements from epochs before the one being planned and for the same workload.

Rule.

1. *Whole clusters.* Placements are grouped by (epoch, cluster). A group is kept when its stages are
   exactly ``0 .. S-1`` with ``S >= min_stages``, its ranges tile the model's layers, every one of its
   peers is in ``peers`` (alive, eligible) and not already in a kept group, and every stage still fits
   its peer's memory. It keeps its order and ranges; its stage times are recomputed with today's
   figures. A group with a dead or missing peer (a *broken* cluster) is dissolved: its survivors are
   free again.
2. *The rest.* The free peers (survivors of broken clusters, newcomers, previous spares) are clustered
   on their own by the fresh path (`cluster_plans.fresh_clusters`, same epoch seed): a broken cluster is
   re-planned from its survivors plus any free peers; peers that form no cluster are *leftovers*.
3. *Absorption.* Leftovers join one kept cluster (re-planned with them: that one cluster moves), the
   one that leaves the plan's estimated throughput highest (of the `ABSORB_MAX_TRIALS` slowest), as a
   fresh plan would have placed them (the fresh path uses every peer but laggards, and a joining peer
   is meant to get a stage), unless the plan would lose more than `ABSORB_MAX_LOSS` (half) of its
   estimated throughput. Why a loss is accepted at all: an idle peer is certain waste, while the
   estimate is crude (compute plus transfer per stage, no overlap): it calls the lab's 4 + 4 digits
   plan a third slower than 4 + 3 and a spare, yet that plan, which the fresh path chooses, trains
   fine. Why not any loss: for that model it calls a third stage six times slower than two, and
   turning a kept 2-stage cluster into a 3-stage one for a lone survivor would stall that cluster for
   such a loss. Laggards by the fresh path's own rule (compute or link below ``spare_ratio`` times
   the kept peers' median) and peers no kept cluster can take (memory, more stages than layers) wait
   as spares.
4. *Escape.* When the fresh plan of all peers (what `make_plan` returns without ``previous``) is
   estimated more than `REPLAN_MIN_GAIN` (25 %) faster than the kept layout, the fresh plan wins: the
   swarm is not stuck in a layout that churn has made poor. Moving every cluster costs each one a
   hand-over and a warm-up (seconds to tens of seconds, docs/elastic.md); a quarter more throughput
   repays that within minutes, while estimates within a quarter are inside the cost model's error
   (compute-only estimates, bucketed figures).

Throughput is the sum of the clusters' pipeline rates (one micro-batch per bottleneck: the clusters run
side by side and average in the background). Clusters are numbered in order of their smallest peer id,
as in a fresh plan; a kept cluster's index may change (continuity allows it).

Determinism. Groups are visited in (epoch, cluster) order, peers sorted by id, ties broken by index;
the only randomness is the fresh path's epoch-seeded generator.

Limits. A peer could lie about its placement; the worst it can do is break a group (a duplicate or
out-of-place stage makes the group not whole), so the cluster is re-planned as before. Absorption
puts all leftovers into one cluster; it does not spread them.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence

from ravnest_p2p.planning.cluster_plans import (
    cluster_plan,
    fixed_cluster_plan,
    fresh_clusters,
    plan_throughput,
)
from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.types import (
    ClusterPlan,
    InfeasiblePlan,
    JobParams,
    PeerCapacity,
    PlacedStage,
    Plan,
)
from ravnest_p2p.types import LayerProfile

__all__ = [
    "ABSORB_MAX_LOSS",
    "ABSORB_MAX_TRIALS",
    "REPLAN_MIN_GAIN",
    "keep_whole_clusters",
    "placed_stages",
    "whole_clusters",
]

ABSORB_MAX_LOSS = 0.5
"""Leftovers join a kept cluster unless the plan's estimated throughput would drop by more than this."""
ABSORB_MAX_TRIALS = 8
"""How many kept clusters (slowest first) absorption tries."""
REPLAN_MIN_GAIN = 0.25
"""A fresh plan replaces the kept layout only if its throughput is higher by more than this fraction."""


def placed_stages(plan: Plan) -> list[PlacedStage]:
    """Every stage of ``plan`` as a placement (what each of its peers announces in its record)."""
    return [
        PlacedStage(
            peer_id=s.peer_id,
            epoch=plan.epoch,
            cluster=cluster.index,
            stage=j,
            first_layer=s.first_layer,
            last_layer_exclusive=s.last_layer_exclusive,
        )
        for cluster in plan.clusters
        for j, s in enumerate(cluster.stages)
    ]


def whole_clusters(
    previous: Sequence[PlacedStage],
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None = None,
) -> list[ClusterPlan]:
    """The previous clusters still whole (rule 1 of the module doc), priced with today's figures.

    Returned in (epoch, cluster) order with index 0; the caller numbers them.
    """
    by_id = {p.peer_id: p for p in peers}
    groups: dict[tuple[int, int], list[PlacedStage]] = defaultdict(list)
    for placed in previous:
        groups[placed.epoch, placed.cluster].append(placed)
    used: set[str] = set()
    kept: list[ClusterPlan] = []
    for key in sorted(groups):
        stages = sorted(groups[key], key=lambda s: (s.stage, s.peer_id))
        ids = [s.peer_id for s in stages]
        if [s.stage for s in stages] != list(range(len(stages))) or len(stages) < job.min_stages:
            continue
        if any(pid not in by_id or pid in used for pid in ids) or len(set(ids)) != len(ids):
            continue
        bounds = [stages[0].first_layer, *(s.last_layer_exclusive for s in stages)]
        tiles = bounds[0] == 0 and bounds[-1] == len(layers)
        if not tiles or any(s.first_layer != bounds[j] for j, s in enumerate(stages)):
            continue
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            continue
        order = [by_id[pid] for pid in ids]
        plan = fixed_cluster_plan(0, order, bounds[1:-1], layers, job, links)
        if any(s.memory_bytes > by_id[s.peer_id].memory_bytes for s in plan.stages):
            continue
        used.update(ids)
        kept.append(plan)
    return kept


def _numbered(clusters: Sequence[ClusterPlan]) -> tuple[ClusterPlan, ...]:
    ordered = sorted(clusters, key=lambda c: min(c.peer_ids))
    return tuple(c.model_copy(update={"index": i}) for i, c in enumerate(ordered))


def _absorb(
    kept: list[ClusterPlan],
    formed: list[ClusterPlan],
    leftovers: list[PeerCapacity],
    by_id: dict[str, PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None,
) -> tuple[list[ClusterPlan], list[PeerCapacity]]:
    """Rule 3: the kept clusters after absorbing ``leftovers`` into one of them, and what is left."""
    if not leftovers or not kept:
        return kept, leftovers
    members_now = [by_id[pid] for c in kept for pid in c.peer_ids]
    median_flops = statistics.median(p.flops_per_s for p in members_now)
    median_link = statistics.median(p.link_bytes_per_s for p in members_now)
    ratio = job.spare_ratio
    laggards = [
        p
        for p in leftovers
        if p.flops_per_s < ratio * median_flops or p.link_bytes_per_s < ratio * median_link
    ]
    joining = [p for p in leftovers if p not in laggards]
    if not joining:
        return kept, leftovers
    base = plan_throughput([*kept, *formed])
    slowest_first = sorted(range(len(kept)), key=lambda i: (-kept[i].bottleneck_s, i))
    best: tuple[float, int, ClusterPlan] | None = None
    for i in slowest_first[:ABSORB_MAX_TRIALS]:
        members = [by_id[pid] for pid in kept[i].peer_ids] + joining
        if len(members) > len(layers):
            continue
        try:
            merged = cluster_plan(0, members, layers, job, links)
        except InfeasiblePlan:
            continue
        total = base - kept[i].throughput_samples_per_s + merged.throughput_samples_per_s
        if best is None or total > best[0]:
            best = (total, i, merged)
    if best is None or best[0] < base * (1 - ABSORB_MAX_LOSS):
        return kept, leftovers
    _, i, merged = best
    return [*kept[:i], merged, *kept[i + 1 :]], laggards


def keep_whole_clusters(
    fresh: Plan,
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    *,
    previous: Sequence[PlacedStage],
    links: LinkMatrix | None = None,
) -> Plan:
    """The re-plan of ``peers`` that keeps ``previous``'s whole clusters, or ``fresh`` (module doc).

    Args:
        fresh: the plan of ``peers`` from scratch for this epoch (the escape, and the answer when no
            previous cluster is whole).
        peers, layers, job, links: as for `make_plan`.
        previous: the live peers' placements in the previous agreed plan.
    """
    kept = whole_clusters(previous, peers, layers, job, links)
    if not kept:
        return fresh
    by_id = {p.peer_id: p for p in peers}
    taken = {pid for c in kept for pid in c.peer_ids}
    free = [p for p in sorted(peers, key=lambda p: p.peer_id) if p.peer_id not in taken]
    formed: list[ClusterPlan] = []
    leftovers: list[PeerCapacity] = []
    if free:
        formed, leftovers = fresh_clusters(free, layers, job, epoch=fresh.epoch, links=links)
    leftovers = sorted(leftovers, key=lambda p: p.peer_id)
    kept, leftovers = _absorb(kept, formed, leftovers, by_id, layers, job, links)
    clusters = [*kept, *formed]
    if plan_throughput(fresh.clusters) > plan_throughput(clusters) * (1 + REPLAN_MIN_GAIN):
        return fresh
    return Plan(
        epoch=fresh.epoch,
        clusters=_numbered(clusters),
        spare_peer_ids=tuple(sorted(p.peer_id for p in leftovers)),
    )
