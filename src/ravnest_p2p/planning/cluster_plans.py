"""Cluster plans from groups of peers: the fresh clustering path of `make_plan` and a fixed layout.

`fresh_clusters` is what `make_plan` always did (cluster -> order -> partition, with spares taken back
when a contiguous split needs their memory); `fixed_cluster_plan` prices a cluster whose stage order and
layer ranges are given (a cluster kept from the previous plan, `replan`) with today's figures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ravnest_p2p.planning.clustering import cluster_peers
from ravnest_p2p.planning.link_swaps import swap_between_clusters
from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.ordering import order_stages
from ravnest_p2p.planning.partition import evaluate_partition
from ravnest_p2p.planning.sites import cluster_by_site
from ravnest_p2p.planning.types import (
    ClusterPlan,
    InfeasiblePlan,
    JobParams,
    PeerCapacity,
    StageAssignment,
)
from ravnest_p2p.types import LayerProfile

__all__ = ["cluster_plan", "fixed_cluster_plan", "fresh_clusters", "plan_throughput"]

logger = logging.getLogger(__name__)


def plan_throughput(clusters: Sequence[ClusterPlan]) -> float:
    """Micro-batches per second of the whole swarm: the clusters' pipelines run side by side."""
    return sum(c.throughput_samples_per_s for c in clusters)


def fixed_cluster_plan(
    index: int,
    order: Sequence[PeerCapacity],
    cuts: Sequence[int],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None,
    *,
    bottleneck_s: float | None = None,
) -> ClusterPlan:
    """The plan of a cluster whose stage order and cut points are given, timed with today's figures.

    ``bottleneck_s``: the slowest stage's time when the caller already has it (`cluster_plan` passes
    the partition DP's figure); None: the largest of the stage times computed here. The two agree
    to a few ulps only (the DP sums FLOPs as prefix differences), and the bottleneck is part of
    `Plan.digest`, so a fresh plan keeps the DP's figure.
    """
    times, memory = evaluate_partition(order, layers, job, cuts, links)
    bounds = [0, *cuts, len(layers)]
    stages = tuple(
        StageAssignment(
            peer_id=peer.peer_id,
            first_layer=bounds[j],
            last_layer_exclusive=bounds[j + 1],
            stage_time_s=times[j],
            memory_bytes=memory[j],
        )
        for j, peer in enumerate(order)
    )
    return ClusterPlan(
        index=index, stages=stages, bottleneck_s=max(times) if bottleneck_s is None else bottleneck_s
    )


def cluster_plan(
    index: int,
    members: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None,
) -> ClusterPlan:
    """The best stage order and partition of ``members`` (raises `InfeasiblePlan`)."""
    order, cuts, bottleneck = order_stages(members, layers, job, links)
    return fixed_cluster_plan(index, order, cuts, layers, job, links, bottleneck_s=bottleneck)


def _plan_or_take_spares_back(
    index: int,
    members: list[PeerCapacity],
    spares: list[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None,
) -> ClusterPlan | None:
    """The cluster's plan; if its layers do not split over ``members``, with spares taken back.

    Spares were set aside against the cluster's *total* memory, but layers are not divisible: the
    contiguous split may need a spare's memory back. Spares are taken back most memory first (id on
    ties, so every peer decides alike) and removed from ``spares`` when used. None: the cluster
    dissolves (its members are the caller's to set aside).
    """
    try:
        return cluster_plan(index, members, layers, job, links)
    except InfeasiblePlan as exc:
        failure = exc
    taken: list[PeerCapacity] = []
    for extra in sorted(spares, key=lambda p: (-p.memory_bytes, p.peer_id)):
        if len(members) + len(taken) >= len(layers):
            break
        taken.append(extra)
        try:
            plan = cluster_plan(index, [*members, *taken], layers, job, links)
        except InfeasiblePlan as exc:
            failure = exc
            continue
        for peer in taken:
            spares.remove(peer)
        return plan
    logger.debug("cluster of %d peers dissolved: %s", len(members), failure)
    return None


def fresh_clusters(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    *,
    epoch: int,
    links: LinkMatrix | None,
) -> tuple[list[ClusterPlan], list[PeerCapacity]]:
    """Cluster ``peers`` from scratch (seeded by ``epoch``): cluster plans numbered from 0, and spares."""
    if links is None:
        clusters, spares = cluster_peers(peers, layers, job, epoch=epoch)
    else:
        clusters, spares = cluster_by_site(peers, layers, job, links, epoch=epoch)
    spare_list = list(spares)
    plans: list[ClusterPlan] = []
    for members in clusters:
        members_list = list(members)
        if len(members_list) > len(layers):
            by_speed = sorted(members_list, key=lambda p: (-p.flops_per_s, p.peer_id))
            members_list, extra = by_speed[: len(layers)], by_speed[len(layers) :]
            spare_list += extra
        plan = _plan_or_take_spares_back(len(plans), members_list, spare_list, layers, job, links)
        if plan is None:
            spare_list += members_list
        else:
            plans.append(plan)
    if links is not None and len(links) > 0:  # the split inside a site was blind to the measured pairs
        plans = swap_between_clusters(
            plans, peers, lambda index, members: cluster_plan(index, members, layers, job, links)
        )
    return plans, spare_list
