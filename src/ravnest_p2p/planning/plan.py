"""`make_plan`: the one function every peer runs on the agreed view to get the same plan.

Composition: `clustering.cluster_peers` (who trains together) -> per cluster `ordering.order_stages`
(who runs which stage, jointly with the exact `partition` of layers) -> a frozen `Plan` whose
`digest()` peers publish under ``plan/<epoch>``.

Why this split and not one global optimiser (e.g. DT-FM over all peers, see `dtfm`): the volunteer
setting measures per-peer bandwidth, not a full latency/bandwidth matrix, and each cluster trains a full
replica; DT-FM's placement is available for swarms that do have a matrix.

Measured links. With a `links.LinkMatrix` (built from the peers' signed link reports, see
`links`), clusters are formed inside sites of well-connected peers (`sites.cluster_by_site`) and every
cluster's stage order and partition use the pairwise rates and latencies. Without one (the default),
the plan is the per-peer-figures plan, bit for bit.

Fallbacks. A cluster with more peers than layers keeps its fastest peers (one layer each at least);
the rest wait as spares. A cluster that fits the model in total but cannot be split contiguously within
every peer's memory (fragmentation) is dissolved into spares rather than failing the whole plan.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ravnest_p2p.planning.clustering import cluster_peers
from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.ordering import order_stages
from ravnest_p2p.planning.partition import evaluate_partition, layer_memory_bytes
from ravnest_p2p.planning.sites import cluster_by_site
from ravnest_p2p.planning.types import (
    ClusterPlan,
    InfeasiblePlan,
    JobParams,
    PeerCapacity,
    Plan,
    StageAssignment,
)
from ravnest_p2p.types import LayerProfile

__all__ = ["make_plan"]

logger = logging.getLogger(__name__)


def _cluster_plan(
    index: int,
    members: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None,
) -> ClusterPlan:
    order, cuts, bottleneck = order_stages(members, layers, job, links)
    times, _ = evaluate_partition(order, layers, job, cuts, links)
    bounds = [0, *cuts, len(layers)]
    stages = tuple(
        StageAssignment(
            peer_id=peer.peer_id,
            first_layer=bounds[j],
            last_layer_exclusive=bounds[j + 1],
            stage_time_s=times[j],
            memory_bytes=sum(layer_memory_bytes(layer, job) for layer in layers[bounds[j] : bounds[j + 1]]),
        )
        for j, peer in enumerate(order)
    )
    return ClusterPlan(index=index, stages=stages, bottleneck_s=bottleneck)


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
        return _cluster_plan(index, members, layers, job, links)
    except InfeasiblePlan as exc:
        failure = exc
    taken: list[PeerCapacity] = []
    for extra in sorted(spares, key=lambda p: (-p.memory_bytes, p.peer_id)):
        if len(members) + len(taken) >= len(layers):
            break
        taken.append(extra)
        try:
            plan = _cluster_plan(index, [*members, *taken], layers, job, links)
        except InfeasiblePlan as exc:
            failure = exc
            continue
        for peer in taken:
            spares.remove(peer)
        return plan
    logger.debug("cluster of %d peers dissolved: %s", len(members), failure)
    return None


def make_plan(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    *,
    epoch: int,
    links: LinkMatrix | None = None,
) -> Plan:
    """Plan clusters, stage order and layer split for ``peers`` (pure and deterministic).

    Args:
        peers: the agreed membership (any order; sorted by id inside).
        layers: the model's layer profile in forward order.
        job: micro-batch size, in-flight depth, memory headroom, spare policy.
        epoch: the plan's epoch (seeds clustering; recorded in the plan).
        links: measured pairwise rates/latencies of ``peers`` (None: per-peer figures only). It must be
            built from data every peer reads alike (the agreed view), or plans will differ.

    Returns:
        A `Plan`; clusters are numbered in order of their smallest peer id. With too little memory in
        the swarm the plan has no clusters and every peer is a spare.
    """
    if not layers:
        raise ValueError("the model has no layers")
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
    return Plan(
        epoch=epoch,
        clusters=tuple(plans),
        spare_peer_ids=tuple(sorted(p.peer_id for p in spare_list)),
    )
