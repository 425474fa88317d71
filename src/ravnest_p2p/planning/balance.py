"""Throughput balancing of a feasible clustering, with the objective updated in O(1) per move.

Problem. After `rcb` or `kmeans` + repair, clusters are feasible and homogeneous but their throughputs
(sum of members' FLOP/s) can differ a lot; averaging waits for the slowest replica. `clustering`'s
objective ``J = H + imbalance`` (``H`` = mean squared distance to the cluster centroid, ``imbalance`` =
coefficient of variation of cluster throughputs) trades the two.

Method. Greedy, as before the rewrite: repeatedly take the fastest and the slowest cluster, and move
the fastest cluster's member nearest the slowest cluster's centroid whose move keeps the donor feasible
and lowers ``J`` (members tried in order of that distance, the first improving one moves); stop when no
member improves. What changed is the cost: per-cluster counts, feature sums and throughputs are kept,
a move's change of ``H`` is the exact Hartigan update ``n_b/(n_b+1) |x - mu_b|^2 - n_a/(n_a-1) |x -
mu_a|^2`` (over ``n``) and the change of the variance of throughputs follows from the sum of squares
(the total throughput is constant under moves), so each candidate is scored in O(1) and a whole step
is vectorised over the donor's members: O(n + k) per move instead of O(n k).

Determinism. Fixed-order numpy reductions, ties broken by peer index, no randomness.
Limits: greedy (a local optimum); at most ``n`` moves.
"""

from __future__ import annotations

import numpy as np

__all__ = ["balance", "objective"]

_IMPROVEMENT = 1e-9


def objective(features: np.ndarray, flops: np.ndarray, labels: np.ndarray, k: int) -> float:
    """``J = H + CV(cluster throughputs)`` for ``labels`` in ``0 .. k-1`` (see `clustering`)."""
    counts = np.bincount(labels, minlength=k).astype(float)
    sums = np.stack(
        [np.bincount(labels, weights=features[:, j], minlength=k) for j in range(features.shape[1])]
    )
    centers = sums.T / np.maximum(counts, 1.0)[:, None]
    h = float(((features - centers[labels]) ** 2).sum()) / max(len(features), 1)
    throughput = np.bincount(labels, weights=flops, minlength=k)
    imbalance = float(throughput.std() / throughput.mean()) if k > 1 else 0.0
    return h + imbalance


def balance(
    features: np.ndarray,
    flops: np.ndarray,
    memory: np.ndarray,
    labels: np.ndarray,
    k: int,
    need_bytes: float,
    min_size: int,
) -> None:
    """Greedy moves from the fastest to the slowest cluster while ``J`` drops; updates ``labels``."""
    n = len(labels)
    if k < 2 or n == 0:
        return
    counts = np.bincount(labels, minlength=k).astype(float)
    sums = np.stack(
        [np.bincount(labels, weights=features[:, j], minlength=k) for j in range(features.shape[1])]
    ).T
    throughput = np.bincount(labels, weights=flops, minlength=k)
    cluster_memory = np.bincount(labels, weights=memory, minlength=k)
    mean = float(throughput.sum()) / k
    sum_sq = float((throughput**2).sum())
    for _ in range(n):
        fast, slow = int(np.argmax(throughput)), int(np.argmin(throughput))
        if counts[fast] - 1 < min_size or fast == slow:
            return
        members = np.flatnonzero(labels == fast)
        x = features[members]
        mu_slow = sums[slow] / max(counts[slow], 1.0)
        mu_fast = sums[fast] / counts[fast]
        to_slow = ((x - mu_slow) ** 2).sum(axis=1)
        from_fast = ((x - mu_fast) ** 2).sum(axis=1)
        delta_h = (
            counts[slow] / (counts[slow] + 1.0) * to_slow - counts[fast] / (counts[fast] - 1.0) * from_fast
        ) / n
        f = flops[members]
        new_sum_sq = (
            sum_sq
            - throughput[fast] ** 2
            - throughput[slow] ** 2
            + (throughput[fast] - f) ** 2
            + (throughput[slow] + f) ** 2
        )
        old_cv = np.sqrt(max(sum_sq / k - mean**2, 0.0)) / mean
        new_cv = np.sqrt(np.maximum(new_sum_sq / k - mean**2, 0.0)) / mean
        improves = (delta_h + new_cv - old_cv < -_IMPROVEMENT) & (
            cluster_memory[fast] - memory[members] >= need_bytes
        )
        if not improves.any():
            return
        order = np.lexsort((members, to_slow))
        pick = order[np.flatnonzero(improves[order])[0]]
        i = int(members[pick])
        labels[i] = slow
        counts[fast] -= 1.0
        counts[slow] += 1.0
        sums[fast] -= features[i]
        sums[slow] += features[i]
        cluster_memory[fast] -= memory[i]
        cluster_memory[slow] += memory[i]
        throughput[fast] -= flops[i]
        throughput[slow] += flops[i]
        sum_sq = float(new_sum_sq[pick])
