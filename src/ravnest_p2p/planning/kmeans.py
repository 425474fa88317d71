"""Seeded k-means on the planner's 2-D peer features, in O(n k) per pass, plus memory repair.

Problem. `clustering` needs, for a given ``k``, a grouping of peers that is homogeneous in feature space
and then feasible (every cluster holds the model and has ``min_size`` peers). This module gives one such
candidate: k-means (Lloyd 1982) seeded by k-means++ (Arthur & Vassilvitskii 2007), then a greedy repair
that moves the nearest spare-able peer into each memory-short cluster.

Method and cost. Seeding keeps a running array of every peer's squared distance to its nearest chosen
centre and updates it with one O(n) pass per new centre (O(n k) in all; the old code recomputed the
distance to every centre for each new one, O(n k^2)). A centre is drawn by inverting the cumulative sum
of that array with one seeded uniform draw. Assignment is a dense argmin over an ``(n, k)`` distance
table built per feature (never an ``(n, k, d)`` tensor) in row chunks of at most `_CHUNK_CELLS`
entries; centroids are `numpy.bincount` sums. Repair scans all peers once per move, vectorised
(O(n) per move); `clustering` also applies it to the clusters of `rcb`.
The caller only runs this when ``n k`` is small (see `clustering`): with ``k ~ n`` the table is
quadratic, and the recursive bisection of `rcb` is used instead.

Determinism. Every reduction runs in a fixed order on arrays in peer-id order (`cumsum`, `bincount`,
argmin taking the lowest index on ties), and the only randomness is the generator passed in.

Alternatives rejected. A k-d tree or grid for the assignment (exact, O(n log k)) would let k-means run
at ``k ~ n``, but when ``k ~ n`` the clusters are a handful of peers whose grouping is dominated by the
memory constraint, which the bisection handles directly; scipy's tree would also be a new dependency.
Limits: k-means is a heuristic; the repair is greedy (nearest spare-able peer first, the lowest-numbered
short cluster first) and can fail where a feasible grouping exists; it makes at most ``n`` moves.
"""

from __future__ import annotations

import numpy as np

__all__ = ["assign_nearest", "centroids", "kmeans_pp_seeds", "kmeans_runs", "repair", "sse"]

_CHUNK_CELLS = 1 << 20
_RESTARTS = 4
_LLOYD_ITERATIONS = 25


def kmeans_pp_seeds(features: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding with a running min-distance array: ``k`` centres, shape ``(k, d)``, O(n k)."""
    n = len(features)
    first = int(rng.integers(n))
    chosen = [first]
    d2 = ((features - features[first]) ** 2).sum(axis=1)
    for _ in range(1, k):
        cdf = np.cumsum(d2)
        total = float(cdf[-1])
        if total > 0:
            pick = min(int(np.searchsorted(cdf, rng.random() * total, side="right")), n - 1)
        else:  # every peer sits on a centre already: any choice is as good
            pick = int(rng.integers(n))
        chosen.append(pick)
        d2 = np.minimum(d2, ((features - features[pick]) ** 2).sum(axis=1))
    return np.asarray(features[chosen], dtype=float)


def assign_nearest(features: np.ndarray, centers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each row's nearest centre (lowest index on ties) and the squared distance to it."""
    n, k = len(features), len(centers)
    labels = np.empty(n, dtype=np.intp)
    best = np.empty(n, dtype=float)
    rows = max(1, _CHUNK_CELLS // max(k, 1))
    for start in range(0, n, rows):
        block = features[start : start + rows]
        dist = np.zeros((len(block), k))
        for j in range(features.shape[1]):
            dist += (block[:, j, None] - centers[None, :, j]) ** 2
        chunk_labels = np.argmin(dist, axis=1)
        labels[start : start + rows] = chunk_labels
        best[start : start + rows] = dist[np.arange(len(block)), chunk_labels]
    return labels, best


def _centroids(features: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    counts = np.bincount(labels, minlength=k).astype(float)
    sums = np.stack(
        [np.bincount(labels, weights=features[:, j], minlength=k) for j in range(features.shape[1])]
    )
    return np.asarray(sums.T / np.maximum(counts, 1.0)[:, None])


def sse(features: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Sum of squared distances of rows to their cluster's centroid."""
    centers = _centroids(features, labels, k)
    return float(((features - centers[labels]) ** 2).sum())


def _lloyd(features: np.ndarray, centers: np.ndarray) -> np.ndarray:
    k = len(centers)
    labels = np.full(len(features), -1, dtype=np.intp)
    for _ in range(_LLOYD_ITERATIONS):
        new_labels, served = assign_nearest(features, centers)
        counts = np.bincount(new_labels, minlength=k)
        for c in np.flatnonzero(counts == 0):  # re-seed an empty cluster at the worst-served point
            far = int(np.argmax(np.where(counts[new_labels] > 1, served, -1.0)))
            counts[new_labels[far]] -= 1
            new_labels[far] = c
            counts[c] = 1
            served[far] = 0.0
        centers = _centroids(features, new_labels, k)
        if np.array_equal(new_labels, labels):
            break
        labels = new_labels
    return labels


def kmeans_runs(
    features: np.ndarray, k: int, rng: np.random.Generator, *, init: np.ndarray | None = None
) -> list[np.ndarray]:
    """Labels of `_RESTARTS` k-means++-seeded Lloyd runs, plus one from ``init`` centres if given."""
    runs = [_lloyd(features, kmeans_pp_seeds(features, k, rng)) for _ in range(_RESTARTS)]
    if init is not None:
        runs.append(_lloyd(features, np.asarray(init, dtype=float)))
    return runs


def centroids(features: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Per-cluster mean feature vectors, shape ``(k, d)`` (zero rows for empty clusters)."""
    return _centroids(features, labels, k)


def repair(
    features: np.ndarray, memory: np.ndarray, labels: np.ndarray, k: int, need_bytes: float, min_size: int
) -> bool:
    """Move peers into memory-short or too-small clusters, in place; True if every cluster then fits.

    Each move takes, for the lowest-numbered short cluster, the peer nearest its centroid among the
    peers whose own (non-short) cluster still fits and keeps ``min_size`` peers without them.
    """
    cluster_memory = np.bincount(labels, weights=memory, minlength=k)
    size = np.bincount(labels, minlength=k)
    for _ in range(len(labels)):
        short = (cluster_memory < need_bytes) | (size < min_size)
        if not short.any():
            return True
        target = int(np.flatnonzero(short)[0])
        members = labels == target
        center = features[members].mean(axis=0) if members.any() else features.mean(axis=0)
        spare_able = (
            ~short[labels] & (cluster_memory[labels] - memory >= need_bytes) & (size[labels] - 1 >= min_size)
        )
        if not spare_able.any():
            return False
        dist = np.where(spare_able, ((features - center) ** 2).sum(axis=1), np.inf)
        peer = int(np.argmin(dist))
        donor = int(labels[peer])
        cluster_memory[donor] -= memory[peer]
        cluster_memory[target] += memory[peer]
        size[donor] -= 1
        size[target] += 1
        labels[peer] = target
    return False
