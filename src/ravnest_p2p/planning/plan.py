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

Re-plans. Given the previous agreed plan's placements (``previous``, read from the members' signed
records), `replan.keep_whole_clusters` keeps every previous cluster that is still whole and plans only
the other peers, unless a fresh plan is much faster (the rule and its thresholds are in `replan`).

Fallbacks. A cluster with more peers than layers keeps its fastest peers (one layer each at least);
the rest wait as spares. A cluster that fits the model in total but cannot be split contiguously within
every peer's memory (fragmentation) is dissolved into spares rather than failing the whole plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from ravnest_p2p.planning.cluster_plans import fresh_clusters
from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.replan import keep_whole_clusters
from ravnest_p2p.planning.types import JobParams, PeerCapacity, PeerLinkRate, PlacedStage, Plan
from ravnest_p2p.types import LayerProfile

__all__ = ["make_plan", "with_link_rates"]


def make_plan(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    *,
    epoch: int,
    links: LinkMatrix | None = None,
    previous: Sequence[PlacedStage] = (),
) -> Plan:
    """Plan clusters, stage order and layer split for ``peers`` (pure and deterministic).

    Args:
        peers: the agreed membership (any order; sorted by id inside).
        layers: the model's layer profile in forward order.
        job: micro-batch size, in-flight depth, memory headroom, spare policy.
        epoch: the plan's epoch (seeds clustering; recorded in the plan).
        links: measured pairwise rates/latencies of ``peers`` (None: per-peer figures only). It must be
            built from data every peer reads alike (the agreed view), or plans will differ.
        previous: where peers sat in the previous agreed plan (any order); clusters still whole are
            kept (`replan`). Empty: a plan from scratch. Like ``links``, every peer must read it alike.

    Returns:
        A `Plan`; clusters are numbered in order of their smallest peer id. With too little memory in
        the swarm the plan has no clusters and every peer is a spare.
    """
    if not layers:
        raise ValueError("the model has no layers")
    plans, spares = fresh_clusters(peers, layers, job, epoch=epoch, links=links)
    fresh = Plan(
        epoch=epoch,
        clusters=tuple(plans),
        spare_peer_ids=tuple(sorted(p.peer_id for p in spares)),
    )
    if previous:
        fresh = keep_whole_clusters(fresh, peers, layers, job, previous=previous, links=links)
    return with_link_rates(fresh, peers)


def with_link_rates(plan: Plan, peers: Sequence[PeerCapacity]) -> Plan:
    """`plan` carrying its cluster members' link rates (from ``peers``, the agreed view), by peer id."""
    planned = {p for cluster in plan.clusters for p in cluster.peer_ids}
    rates = tuple(
        PeerLinkRate(
            peer_id=p.peer_id,
            upload_bytes_per_s=p.upload_bytes_per_s,
            download_bytes_per_s=p.download_bytes_per_s,
        )
        for p in sorted(peers, key=lambda p: p.peer_id)
        if p.peer_id in planned
    )
    return plan.model_copy(update={"link_rates": rates})
