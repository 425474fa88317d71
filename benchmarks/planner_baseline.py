"""BASELINE, vendored for the planner benchmark only: the clustering of ravnest_p2p before the
near-linear rewrite (src/ravnest_p2p/planning/clustering.py at commit b70ad8f), unchanged except for
this docstring and its exported names.

It runs k-means++ seeding that recomputes the distance to every chosen centre for each new centre
(O(k^2 n)) and tries k one value at a time downward from the memory bound. `bench_planner` compares
the new clustering's objective against it at 100 and 300 peers. Do not use it anywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.partition import model_memory_bytes
from ravnest_p2p.planning.types import JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["baseline_cluster_peers"]

_RESTARTS = 4
_LLOYD_ITERATIONS = 25

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


def _kmeans(features: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    best_labels = np.zeros(len(features), dtype=int)
    best_inertia = np.inf
    for _ in range(_RESTARTS):
        centers = [features[rng.integers(len(features))]]
        for _c in range(1, k):
            d2 = np.min([((features - c) ** 2).sum(axis=1) for c in centers], axis=0)
            probs = d2 / d2.sum() if d2.sum() > 0 else np.full(len(features), 1.0 / len(features))
            centers.append(features[rng.choice(len(features), p=probs)])
        center_arr = np.array(centers)
        labels = np.zeros(len(features), dtype=int)
        for _it in range(_LLOYD_ITERATIONS):
            dist = ((features[:, None, :] - center_arr[None, :, :]) ** 2).sum(axis=2)
            new_labels = np.argmin(dist, axis=1)
            for c in range(k):
                if not np.any(new_labels == c):  # re-seed an empty cluster at the worst-served point
                    counts = np.bincount(new_labels, minlength=k)
                    served = dist[np.arange(len(features)), new_labels]
                    far = int(np.argmax(np.where(counts[new_labels] > 1, served, -1.0)))
                    new_labels[far] = c
            center_arr = np.array([features[new_labels == c].mean(axis=0) for c in range(k)])
            if np.array_equal(new_labels, labels):
                break
            labels = new_labels
        inertia = homogeneity(features, labels)
        if inertia < best_inertia - 1e-12:
            best_inertia, best_labels = inertia, labels.copy()
    return best_labels


class _State:
    """Labels plus the per-cluster sums the repair and balance steps need."""

    def __init__(self, peers: Sequence[PeerCapacity], features: np.ndarray, labels: np.ndarray, k: int):
        self.features = features
        self.labels = labels
        self.k = k
        self.memory = np.array([float(p.memory_bytes) for p in peers])
        self.flops = np.array([p.flops_per_s for p in peers])

    def members(self, c: int) -> np.ndarray:
        return np.flatnonzero(self.labels == c)

    def cluster_memory(self, c: int) -> float:
        return float(self.memory[self.labels == c].sum())

    def centroid(self, c: int) -> np.ndarray:
        return np.asarray(self.features[self.labels == c].mean(axis=0))

    def objective(self) -> float:
        throughput = np.array([self.flops[self.labels == c].sum() for c in range(self.k)])
        imbalance = float(throughput.std() / throughput.mean()) if self.k > 1 else 0.0
        return homogeneity(self.features, self.labels) + imbalance


def _repair(state: _State, need_bytes: float, min_size: int) -> bool:
    """Move peers into memory-short or too-small clusters from clusters that can spare them."""
    for _ in range(len(state.labels)):
        short = [
            c
            for c in range(state.k)
            if state.cluster_memory(c) < need_bytes or len(state.members(c)) < min_size
        ]
        if not short:
            return True
        target = short[0]
        center = state.centroid(target) if len(state.members(target)) else state.features.mean(axis=0)
        best_peer, best_dist = -1, np.inf
        for donor in range(state.k):
            if donor in short:
                continue
            donor_memory, donor_size = state.cluster_memory(donor), len(state.members(donor))
            for i in state.members(donor):
                if donor_memory - state.memory[i] >= need_bytes and donor_size - 1 >= min_size:
                    dist = float(((state.features[i] - center) ** 2).sum())
                    if dist < best_dist - 1e-12:
                        best_peer, best_dist = int(i), dist
        if best_peer < 0:
            return False
        state.labels[best_peer] = target
    return False


def _balance(state: _State, need_bytes: float, min_size: int) -> None:
    """Greedy moves from the fastest to the slowest cluster while the objective ``J`` drops."""
    if state.k < 2:
        return
    current = state.objective()
    for _ in range(len(state.labels)):
        throughput = [state.flops[state.labels == c].sum() for c in range(state.k)]
        fast, slow = int(np.argmax(throughput)), int(np.argmin(throughput))
        center = state.centroid(slow)
        fast_members = state.members(fast)
        if len(fast_members) - 1 < min_size:
            return
        order = sorted(fast_members, key=lambda i: float(((state.features[i] - center) ** 2).sum()))
        moved = False
        for i in order:
            if state.cluster_memory(fast) - state.memory[i] < need_bytes:
                continue
            state.labels[i] = slow
            trial = state.objective()
            if trial < current - 1e-9:
                current, moved = trial, True
                break
            state.labels[i] = fast
        if not moved:
            return


def _split_spares(
    cluster: list[PeerCapacity], need_bytes: float, min_size: int, ratio: float
) -> tuple[list[PeerCapacity], list[PeerCapacity]]:
    if ratio <= 0:
        return cluster, []
    median_flops = float(np.median([p.flops_per_s for p in cluster]))
    median_link = float(np.median([p.link_bytes_per_s for p in cluster]))
    kept, spares = list(cluster), []
    for peer in sorted(cluster, key=lambda p: (p.flops_per_s, p.peer_id)):
        laggard = peer.flops_per_s < ratio * median_flops or peer.link_bytes_per_s < ratio * median_link
        memory_after = sum(p.memory_bytes for p in kept) - peer.memory_bytes
        if laggard and memory_after >= need_bytes and len(kept) - 1 >= min_size:
            kept.remove(peer)
            spares.append(peer)
    return kept, spares


def baseline_cluster_peers(
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
    k_max = min(int(total_memory // max(need_bytes, 1.0)), len(ordered) // job.min_stages)
    rng = np.random.default_rng(epoch)
    for k in range(max(k_max, 1), 0, -1):
        state = _State(ordered, features, _kmeans(features, k, rng), k)
        if not _repair(state, need_bytes, job.min_stages):
            continue
        _balance(state, need_bytes, job.min_stages)
        clusters: list[tuple[PeerCapacity, ...]] = []
        spares: list[PeerCapacity] = []
        for c in range(k):
            kept, set_aside = _split_spares(
                [ordered[i] for i in state.members(c)], need_bytes, job.min_stages, job.spare_ratio
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
    return (), tuple(ordered)
