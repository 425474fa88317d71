"""Stage ordering: which peer of a cluster runs stage 0, stage 1, ... of the pipeline.

Problem. The partition DP (`partition`) is exact for a *given* peer order; the order decides which link
each cut's activations cross and how much compute each position gets. We want the order whose optimal
partition has the smallest bottleneck: keep slow links off heavy boundaries (a peer with a slow uplink
is best placed last -- the last stage sends nothing forward -- or before a cut where activations are
small) and give the compute-heavy parts to fast peers.

Method. Clusters of up to `EXACT_LIMIT` peers: enumerate every permutation (in sorted peer-id order)
and run the exact DP on each -- the joint optimum of order and partition. Larger clusters: start from
the peers sorted by link speed, fastest first (so the slowest uplink sits last) and improve by
pairwise swaps evaluated with the exact DP until no swap helps (a 2-exchange local optimum).

Alternatives rejected. Ordering by a bottleneck path over link speeds alone (a bottleneck TSP) ignores
where cuts land and the peers' compute; enumerating is cheap up to 6 peers (720 DP runs of ~50 us).
Limits: above `EXACT_LIMIT` the answer is a local optimum, not proven optimal.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ravnest_p2p.planning.partition import partition_layers
from ravnest_p2p.planning.types import InfeasiblePlan, JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["EXACT_LIMIT", "order_stages"]

EXACT_LIMIT = 6
_MAX_SWAP_ROUNDS = 50


def _score(
    order: Sequence[PeerCapacity], layers: Sequence[LayerProfile], job: JobParams
) -> tuple[float, tuple[int, ...]] | None:
    try:
        cuts, bottleneck = partition_layers(order, layers, job)
    except InfeasiblePlan:
        return None
    return bottleneck, cuts


def order_stages(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
) -> tuple[tuple[PeerCapacity, ...], tuple[int, ...], float]:
    """Choose the pipeline order of ``peers`` and the matching optimal partition.

    Args:
        peers: the cluster's peers, any order (they are sorted by id first for determinism).
        layers: the model's layers in forward order.
        job: micro-batch size and memory knobs.

    Returns:
        ``(ordered_peers, cuts, bottleneck_s)`` as in `partition.partition_layers`.

    Raises:
        InfeasiblePlan: no order admits a split that fits every peer's memory.
    """
    ordered = sorted(peers, key=lambda p: p.peer_id)
    if not ordered:
        raise InfeasiblePlan("empty cluster")
    best: tuple[float, tuple[int, ...]] | None = None
    best_order: tuple[PeerCapacity, ...] = ()
    if len(ordered) <= EXACT_LIMIT:
        for perm in itertools.permutations(ordered):
            scored = _score(perm, layers, job)
            if scored is not None and (best is None or scored[0] < best[0]):
                best, best_order = scored, perm
    else:
        current = sorted(ordered, key=lambda p: (-p.link_bytes_per_s, p.peer_id))
        best = _score(current, layers, job)
        best_order = tuple(current)
        for _ in range(_MAX_SWAP_ROUNDS):
            improved = False
            for i, j in itertools.combinations(range(len(current)), 2):
                trial = list(best_order)
                trial[i], trial[j] = trial[j], trial[i]
                scored = _score(trial, layers, job)
                if scored is not None and (best is None or scored[0] < best[0]):
                    best, best_order, improved = scored, tuple(trial), True
            if not improved:
                break
    if best is None:
        raise InfeasiblePlan("no stage order fits the model in the cluster's memory")
    return best_order, best[1], best[0]
