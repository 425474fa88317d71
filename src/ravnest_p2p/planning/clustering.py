"""Clustering: group peers of similar compute and bandwidth into data-parallel pipelines.

Problem. Each cluster is one replica of the model run as an asynchronous pipeline; clusters average
their parameters in the background. A pipeline runs at its slowest member's pace, and averaging waits
for the slowest cluster, so we want clusters that are (a) feasible, (b) internally homogeneous and
(c) of balanced throughput. Objective, in priority order:

1. Feasibility: every cluster's memory holds the whole model -- parameters, optimizer state,
   ``max_in_flight`` stashed weight versions and ``max_in_flight`` micro-batches of activations, times
   the headroom (`partition.model_memory_bytes`) -- and has at least ``min_stages`` peers.
2. As many clusters ``k`` as feasible: more replicas means more samples per second; averaging is
   overlapped with training, so it does not grow the step time.
3. Minimise ``J = H + imbalance`` where ``H`` is the mean squared distance of each peer to its cluster's
   centroid in feature space (homogeneity) and ``imbalance`` is the coefficient of variation of the
   clusters' estimated throughputs (sum of members' FLOP/s / model FLOPs per sample).

Similarity. A peer's features are ``(log flops_per_s, log min(upload, download))``, each divided by
its standard deviation over the population. Logs make similarity a matter of *ratios* (a 2x gap hurts
a pipeline the same at 10 and at 100 Mbit/s); the scaling stops whichever feature has the wider spread
from drowning the other. The slower link direction is used because a stage both receives and sends.

Method. ``k`` is searched, not scanned: ``k_max = min(total memory // need, n // min_stages)`` is tried
first (it is feasible whenever the model fits on most peers), then the feasibility boundary is found
by bisection on ``[1, k_max]`` (``k = 1`` is always feasible here): O(log k_max) trials instead of up
to ``k_max``. A trial ``k`` is feasible when one of two candidate groupings is:

* `rcb.bisect_clusters` + `kmeans.repair`: memory-weighted recursive coordinate bisection of the 2-D
  features, feasible by construction when its cuts can be, else repaired; O(n log n log k) plus O(n)
  per repair move, so it serves any ``k`` up to ``n``;
* `kmeans.kmeans_runs` + `kmeans.repair`: seeded k-means++ / Lloyd runs (O(n k) per pass, running
  min-distance seeding) plus one Lloyd run started from the bisection's centroids, each followed by
  greedy memory repair, the repaired run of lowest ``J`` kept; only when ``n k <= KMEANS_MAX_CELLS``,
  where it is cheap.

At the chosen ``k`` each feasible candidate is balanced (`balance.balance`: move a peer from the
fastest to the slowest cluster while ``J`` drops, O(1) objective updates) and the one with the lower
``J`` is kept (bisection on ties). Peers whose compute or link is below ``spare_ratio`` times their
cluster's median are set aside as spares when the cluster still fits without them (a laggard would set
the pace), and so are all members of a cluster whose throughput is below ``spare_ratio`` times the
median cluster's (averaging would wait on it). Cost at 10,000 peers: seconds (see
``benchmarks/results/planner.md``); the old linear scan of ``k`` with O(n k^2) seeding took minutes at
1,000.

Determinism. Peers are sorted by id before anything else; every reduction runs in a fixed order on
arrays in that order (`cumsum`, `bincount`, `lexsort` with the peer index as the last key, argmin's
lowest index on ties); the only randomness is a numpy generator seeded by ``(epoch, k)``, so the trials
do not depend on the search path. Every peer with the same view computes the same clusters, bit for
bit, whatever the order of its inputs. Clusters are returned sorted by their smallest peer id.

Alternatives rejected. Ravnest's genetic algorithm over hand-typed RAM/bandwidth: slow to converge and
not reproducible across peers without shared seeds and identical float paths; a 1-D sort on a combined
score: loses the 2-D structure (fast compute on a slow link is not "similar" to the reverse); a linear
scan of ``k`` from ``k_max`` down (the previous method): up to ``k_max`` k-means runs, minutes at 1,000
peers; golden-section search on ``J`` over ``k``: ``k`` has priority over ``J``, so the boundary of
feasibility, not a minimum of ``J``, is what must be found.
Limits: k-means and the bisection are heuristics (no optimality proof); feasibility is not strictly
monotone in ``k``, so bisection finds *a* feasible ``k`` next to an infeasible ``k + 1``, not always the
largest feasible one; throughput is a compute-only estimate (the exact pipeline period is computed
afterwards by `partition` and reported in the plan).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.balance import balance, objective
from ravnest_p2p.planning.kmeans import centroids, kmeans_runs, repair
from ravnest_p2p.planning.partition import model_memory_bytes
from ravnest_p2p.planning.rcb import bisect_clusters
from ravnest_p2p.planning.types import JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["KMEANS_MAX_CELLS", "Clustering", "cluster_peers", "homogeneity", "peer_features"]

KMEANS_MAX_CELLS = 200_000
"""k-means runs as a second candidate only when ``n * k`` is at most this (its distance table)."""

Clustering = tuple[tuple[tuple[PeerCapacity, ...], ...], tuple[PeerCapacity, ...]]
"""``(clusters, spares)``; each cluster a tuple of peers sorted by id."""


def peer_features(peers: Sequence[PeerCapacity]) -> np.ndarray:
    """Standardised log features ``(compute, link)`` of ``peers``, shape ``(n, 2)`` (see module doc)."""
    raw = np.array([[np.log(p.flops_per_s), np.log(p.link_bytes_per_s)] for p in peers], dtype=float)
    raw = raw.reshape(len(peers), 2)
    scale = raw.std(axis=0) if len(peers) > 1 else np.ones(2)
    scale = np.where(scale > 1e-12, scale, 1.0)
    return raw / scale


def homogeneity(features: np.ndarray, labels: np.ndarray) -> float:
    """Mean squared distance of each row to its cluster's centroid (lower = more homogeneous)."""
    total = 0.0
    for label in np.unique(labels):
        members = features[labels == label]
        total += float(((members - members.mean(axis=0)) ** 2).sum())
    return total / max(len(features), 1)


class _Trials:
    """Feasible candidate groupings for one ``k`` (cached: the search may ask twice)."""

    def __init__(
        self,
        features: np.ndarray,
        memory: np.ndarray,
        flops: np.ndarray,
        *,
        need_bytes: float,
        min_size: int,
        epoch: int,
    ):
        self.features, self.memory, self.flops = features, memory, flops
        self.need_bytes, self.min_size, self.epoch = need_bytes, min_size, epoch
        self._cache: dict[int, list[np.ndarray]] = {}

    def __call__(self, k: int) -> list[np.ndarray]:
        if k not in self._cache:
            self._cache[k] = self._candidates(k)
        return self._cache[k]

    def _candidates(self, k: int) -> list[np.ndarray]:
        found: list[np.ndarray] = []
        bisected = bisect_clusters(self.features, self.memory, k, self.need_bytes, self.min_size)
        bisected_feasible = repair(self.features, self.memory, bisected, k, self.need_bytes, self.min_size)
        if bisected_feasible:
            found.append(bisected)
        if len(self.features) * k <= KMEANS_MAX_CELLS:
            rng = np.random.default_rng([self.epoch, k])
            init = centroids(self.features, bisected, k) if bisected_feasible else None
            best, best_j = None, np.inf
            for labels in kmeans_runs(self.features, k, rng, init=init):
                if repair(self.features, self.memory, labels, k, self.need_bytes, self.min_size):
                    value = objective(self.features, self.flops, labels, k)
                    if value < best_j - 1e-12:
                        best, best_j = labels, value
            if best is not None:
                found.append(best)
        return found


def _largest_feasible_k(trials: _Trials, k_max: int) -> int:
    """``k_max`` if feasible, else bisection for ``lo`` feasible next to ``lo + 1`` infeasible."""
    if trials(k_max):
        return k_max
    lo, hi = 1, k_max  # invariant: lo feasible (one cluster of everyone), hi infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trials(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _split_spares(
    cluster: list[PeerCapacity], need_bytes: float, min_size: int, ratio: float
) -> tuple[list[PeerCapacity], list[PeerCapacity]]:
    if ratio <= 0:
        return cluster, []
    median_flops = float(np.median([p.flops_per_s for p in cluster]))
    median_link = float(np.median([p.link_bytes_per_s for p in cluster]))
    spares: list[PeerCapacity] = []
    kept_memory, kept_count = sum(p.memory_bytes for p in cluster), len(cluster)
    for peer in sorted(cluster, key=lambda p: (p.flops_per_s, p.peer_id)):
        laggard = peer.flops_per_s < ratio * median_flops or peer.link_bytes_per_s < ratio * median_link
        if laggard and kept_memory - peer.memory_bytes >= need_bytes and kept_count - 1 >= min_size:
            kept_memory -= peer.memory_bytes
            kept_count -= 1
            spares.append(peer)
    set_aside = {p.peer_id for p in spares}
    return [p for p in cluster if p.peer_id not in set_aside], spares


def cluster_peers(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    *,
    epoch: int,
) -> Clustering:
    """Group ``peers`` into feasible, homogeneous, throughput-balanced clusters (see module doc).

    Args:
        peers: the agreed membership view, any order; peer ids must be unique.
        layers: the model's layer profile (sets the memory a cluster needs).
        job: memory and spare knobs.
        epoch: the plan epoch; seeds the only randomness.

    Returns:
        ``(clusters, spares)``: clusters sorted by their first peer id, peers inside sorted by id.

    Raises:
        ValueError: duplicate peer ids.
    """
    ordered = sorted(peers, key=lambda p: p.peer_id)
    if len({p.peer_id for p in ordered}) != len(ordered):
        raise ValueError("duplicate peer ids in the view")
    need_bytes = float(model_memory_bytes(layers, job))
    total_memory = float(sum(p.memory_bytes for p in ordered))
    if not ordered or total_memory < need_bytes or len(ordered) < job.min_stages:
        return (), tuple(ordered)
    features = peer_features(ordered)
    memory = np.array([float(p.memory_bytes) for p in ordered])
    flops = np.array([p.flops_per_s for p in ordered])
    k_max = max(min(int(total_memory // max(need_bytes, 1.0)), len(ordered) // job.min_stages), 1)
    trials = _Trials(features, memory, flops, need_bytes=need_bytes, min_size=job.min_stages, epoch=epoch)
    k = _largest_feasible_k(trials, k_max)
    best_labels, best_j = None, np.inf
    for candidate in trials(k):
        labels = candidate.copy()
        balance(features, flops, memory, labels, k, need_bytes, job.min_stages)
        value = objective(features, flops, labels, k)
        if value < best_j - 1e-12:
            best_labels, best_j = labels, value
    if best_labels is None:  # only if even one cluster of everyone failed, which the guard above rules out
        return (), tuple(ordered)
    members_of: list[list[int]] = [[] for _ in range(k)]
    for i, label in enumerate(best_labels.tolist()):
        members_of[label].append(i)
    clusters: list[tuple[PeerCapacity, ...]] = []
    spares: list[PeerCapacity] = []
    for members in members_of:
        kept, set_aside = _split_spares(
            [ordered[i] for i in members], need_bytes, job.min_stages, job.spare_ratio
        )
        clusters.append(tuple(kept))
        spares += set_aside
    # A whole cluster far slower than the median one would hold back averaging: its peers wait.
    throughput = [sum(p.flops_per_s for p in members) for members in clusters]
    cutoff = job.spare_ratio * float(np.median(throughput))
    spares += [p for members, t in zip(clusters, throughput, strict=True) if t < cutoff for p in members]
    clusters = [members for members, t in zip(clusters, throughput, strict=True) if t >= cutoff]
    clusters.sort(key=lambda members: members[0].peer_id)
    return tuple(clusters), tuple(sorted(spares, key=lambda p: p.peer_id))
