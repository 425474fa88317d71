"""Sites: split the swarm into groups of well-connected peers, then cluster inside each group.

Problem. `clustering.cluster_peers` groups peers by their own compute and access-link figures. Two
cities of identical machines, fast inside each city and slow between them, look alike to it, and a
pipeline it forms may straddle the slow link on every micro-batch. With a measured `links.LinkMatrix`
we first find the *sites*, groups of peers whose measured links are about as good as their best ones,
and cluster each site on its own: a pipeline then crosses a slow link only when no single site can
hold the model.

Method (single linkage, Kruskal order, O(E log E) for E measured pairs, ``E <= 2 K n``):

1. Cost of a pair: the time to send a reference message (a micro-batch of the model's median
   activation) both ways' worse direction, ``max over directions of latency + bytes / rate``.
2. Each peer's *best* cost is its cheapest measured pair. A measured pair is *close* when its cost is
   at most `CLOSE_FACTOR` times the larger best cost of its two peers; close pairs are united
   (union-find). A city's internal links are close; a link to another city, several times slower, is
   not.
3. Peers with no measured pair at all (newcomers) form one pool: nothing tells them apart.
4. A site that cannot hold the model (memory, or fewer than ``min_stages`` peers) is merged along the
   cheapest measured pair leading out of it (continuing the Kruskal order over the pairs that were not
   close); what is still infeasible after that joins the other infeasible groups, and then the largest
   feasible site, or everything becomes one group when no site is feasible.

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

__all__ = ["CLOSE_FACTOR", "cluster_by_site", "split_sites"]

CLOSE_FACTOR = 2.0
"""A pair is close when it costs at most this times its peers' best pair (two half-octave buckets)."""


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


def reference_bytes(layers: Sequence[LayerProfile], job: JobParams) -> float:
    """A micro-batch of the model's median activation: the message a typical stage boundary carries."""
    sizes = sorted(float(layer.activation_bytes_per_sample) for layer in layers)
    return job.micro_batch_size * sizes[len(sizes) // 2] if sizes else 0.0


def split_sites(
    peers: Sequence[PeerCapacity],
    links: LinkMatrix,
    *,
    message_bytes: float,
    need_bytes: float,
    min_size: int,
) -> list[list[PeerCapacity]]:
    """Groups of well-connected peers, each feasible when possible (see module doc), by first id."""
    ordered = sorted(peers, key=lambda p: p.peer_id)
    index = {p.peer_id: i for i, p in enumerate(ordered)}
    n = len(ordered)
    costs: dict[tuple[int, int], float] = {}
    for sender, receiver, _, _ in links.measured_pairs():
        if sender in index and receiver in index:
            a, b = sorted((index[sender], index[receiver]))
            if (a, b) not in costs:
                pa, pb = ordered[a].peer_id, ordered[b].peer_id
                costs[(a, b)] = max(
                    links.send_time_s(pa, pb, message_bytes), links.send_time_s(pb, pa, message_bytes)
                )
    best = [float("inf")] * n
    for (a, b), cost in costs.items():
        best[a], best[b] = min(best[a], cost), min(best[b], cost)
    pairs = sorted(costs.items(), key=lambda item: (item[1], item[0]))
    sets = _Sets(n)
    for (a, b), cost in pairs:
        if cost <= CLOSE_FACTOR * max(best[a], best[b]):
            sets.union(a, b)
    pool = [i for i in range(n) if best[i] == float("inf")]
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

    for (a, b), _ in pairs:  # cheapest bridges first, only out of a site that cannot train alone
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
        message_bytes=reference_bytes(layers, job),
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
