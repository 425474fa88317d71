"""Sites: split the swarm into groups of well-connected peers, then cluster inside each group.

Problem. `clustering.cluster_peers` groups peers by their own compute and access-link figures. Two
cities of identical machines, fast inside each city and slow between them, look alike to it, and a
pipeline it forms may straddle the slow link on every micro-batch. With a measured `links.LinkMatrix`
we first find the *sites*, groups of peers whose measured links are about as good as their best ones,
and cluster each site on its own: a pipeline then crosses a slow link only when no single site can
hold the model.

Method (single linkage, Kruskal order, O(E log E) for E measured pairs, ``E <= 2 K n``):

1. A pair's *quality* is its worse direction's measured rate over its estimate
   ``min(upload(a), download(b))`` (at most 1: `LinkMatrix` caps measurements at the estimate). The
   ratio takes the peers' own access links out: a laptop's slow link to its neighbour is a good pair
   for a laptop, a datacenter card's 10x slower path to another continent is not. Raw rates were
   tried first and chained every city into one site on the benchmark swarm (a far pair between two
   fast peers beat a near pair with a slow one).
2. A measured pair is *close* when its quality is at least `CLOSE_RATIO` and its latency is at most
   `CLOSE_FACTOR` times the smaller of its two peers' best (lowest) measured latencies, plus
   `LATENCY_SLACK_S`. Close pairs are united (union-find).
3. Peers with no measured pair at all (newcomers) form one pool: nothing tells them apart.
4. A site that cannot hold the model (memory, or fewer than ``min_stages`` peers) is merged along the
   best measured pair leading out of it (pairs in order of quality, then latency); what is still
   infeasible after that joins the other infeasible groups, and then the largest feasible site, or
   everything becomes one group when no site is feasible.

Each group is then clustered by `cluster_peers` with the same epoch; with no measured pair (or all of
them close) there is one group and the clustering is exactly the one without a matrix.

Determinism: peers sorted by id, pairs sorted by (cost, ids), union by smallest index, groups ordered
by their first peer id. Limits: single linkage chains, so two cities joined by one pair that measured
close are one site; a site's clusters are balanced against each other, not against other sites'.
"""

from __future__ import annotations

from collections.abc import Sequence

from ravnest_p2p.planning.clustering import Clustering, cluster_peers
from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.partition import model_memory_bytes
from ravnest_p2p.planning.types import JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["CLOSE_FACTOR", "CLOSE_RATIO", "LATENCY_SLACK_S", "cluster_by_site", "split_sites"]

CLOSE_RATIO = 0.5
"""A close pair carries at least this share of its estimated rate (two half-octave buckets)."""
CLOSE_FACTOR = 2.0
"""A close pair's latency is at most this times its peers' best latency (plus `LATENCY_SLACK_S`)."""
LATENCY_SLACK_S = 0.002
"""Absolute slack on latency: sub-millisecond paths differ by scheduling noise, not distance."""


class _Sets:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            ra, rb = min(ra, rb), max(ra, rb)
            self.parent[rb] = ra
        return ra


def split_sites(
    peers: Sequence[PeerCapacity],
    links: LinkMatrix,
    *,
    need_bytes: float,
    min_size: int,
) -> list[list[PeerCapacity]]:
    """Groups of well-connected peers, each feasible when possible (see module doc), by first id."""
    ordered = sorted(peers, key=lambda p: p.peer_id)
    index = {p.peer_id: i for i, p in enumerate(ordered)}
    n = len(ordered)
    quality: dict[tuple[int, int], tuple[float, float]] = {}  # (a, b) -> (worse rate share, latency)
    for sender, receiver, _, _ in links.measured_pairs():
        if sender in index and receiver in index:
            a, b = sorted((index[sender], index[receiver]))
            if (a, b) not in quality:
                pa, pb = ordered[a].peer_id, ordered[b].peer_id
                share = min(
                    links.rate(pa, pb) / links.estimated_rate(pa, pb),
                    links.rate(pb, pa) / links.estimated_rate(pb, pa),
                )
                quality[(a, b)] = (share, max(links.latency_s(pa, pb), links.latency_s(pb, pa)))
    best_latency = [float("inf")] * n
    for (a, b), (_, latency) in quality.items():
        best_latency[a] = min(best_latency[a], latency)
        best_latency[b] = min(best_latency[b], latency)
    pairs = sorted(quality.items(), key=lambda item: (-item[1][0], item[1][1], item[0]))
    sets = _Sets(n)
    for (a, b), (share, latency) in pairs:
        near = latency <= CLOSE_FACTOR * min(best_latency[a], best_latency[b]) + LATENCY_SLACK_S
        if share >= CLOSE_RATIO and near:
            sets.union(a, b)
    pool = [i for i in range(n) if best_latency[i] == float("inf")]
    for i in pool[1:]:
        sets.union(pool[0], i)

    memory = [0.0] * n
    size = [0] * n
    for i, peer in enumerate(ordered):
        root = sets.find(i)
        memory[root] += peer.memory_bytes
        size[root] += 1

    def feasible(root: int) -> bool:
        return memory[root] >= need_bytes and size[root] >= min_size

    def merge(a: int, b: int) -> None:
        ra, rb = sets.find(a), sets.find(b)
        if ra != rb:
            total_memory, total_size = memory[ra] + memory[rb], size[ra] + size[rb]
            root = sets.union(ra, rb)
            memory[root], size[root] = total_memory, total_size

    for (a, b), _ in pairs:  # best bridges first, only out of a site that cannot train alone
        ra, rb = sets.find(a), sets.find(b)
        if ra != rb and not (feasible(ra) and feasible(rb)):
            merge(ra, rb)
    roots = sorted({sets.find(i) for i in range(n)})
    stuck = [r for r in roots if not feasible(r)]
    for r in stuck[1:]:
        merge(stuck[0], r)
    if stuck and not feasible(sets.find(stuck[0])):
        able = [r for r in roots if feasible(r)]
        if able:
            merge(max(able, key=lambda r: (memory[r], -r)), stuck[0])
        else:
            for r in roots:
                merge(roots[0], r)
    groups: dict[int, list[PeerCapacity]] = {}
    for i, peer in enumerate(ordered):
        groups.setdefault(sets.find(i), []).append(peer)
    return sorted(groups.values(), key=lambda members: members[0].peer_id)


def cluster_by_site(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix,
    *,
    epoch: int,
) -> Clustering:
    """`cluster_peers` inside each site of `split_sites`; clusters by first peer id, spares by id."""
    if len({p.peer_id for p in peers}) != len(peers):
        raise ValueError("duplicate peer ids in the view")
    sites = split_sites(
        peers,
        links,
        need_bytes=float(model_memory_bytes(layers, job)),
        min_size=job.min_stages,
    )
    clusters: list[tuple[PeerCapacity, ...]] = []
    spares: list[PeerCapacity] = []
    for site in sites:
        site_clusters, site_spares = cluster_peers(site, layers, job, epoch=epoch)
        clusters += site_clusters
        spares += site_spares
    clusters.sort(key=lambda members: members[0].peer_id)
    return tuple(clusters), tuple(sorted(spares, key=lambda p: p.peer_id))
