"""Memory-weighted recursive coordinate bisection: ``k`` compact, feasible clusters in O(n log n log k).

Problem. `clustering` wants, for a given ``k``, clusters that each hold the model (memory at least
``need_bytes``, at least ``min_size`` peers) and are compact in the 2-D feature space. When ``k`` is
close to its memory bound most clusters only just fit, so feasibility, not the shape k-means would
find, decides the grouping; and ``k`` can be as large as ``n`` (a small model fits on every peer).

Method. Recursive coordinate bisection (Berger & Bokhari 1987, the classic load-balancing partitioner):
a node owning ``k`` clusters sorts its peers along each feature axis (ties by peer-id order), gives
``floor(k / 2)`` clusters to the lower side and the rest to the upper side, and cuts where the lower
side's memory is nearest its share ``k_low / k`` of the node's memory, clipped to the interval of cuts
where both sides can still hold ``k_low`` and ``k - k_low`` models and peers; of the two axes' cuts it
keeps the one with the smaller within-side squared deviation (ties: the first axis). Every leaf is one
cluster. Each of the ``log2 k`` levels sorts at most ``n`` peers twice, so the cost is O(n log n log k);
leaves are axis-aligned boxes of similar peers (compact, hence homogeneous).

Determinism. Sorting uses `numpy.lexsort` on (coordinate, peer index), a total order; memory sums are
sequential `cumsum`s in that order; there is no randomness.

Alternatives rejected. A single sort along a space-filling curve (Hilbert) is one pass but cuts
across the data's real 2-D spread; k-means with repair (`kmeans`) is kept as a second candidate when
``n k`` is small but costs O(n k) per pass and its greedy repair fails near the memory bound.
Limits: a cut only checks that both sides have enough memory *in total*; with lumpy memories a side
can have enough in total but no way to split it, and the caller then tries a smaller ``k``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bisect_clusters"]


def _cut(memory_cum: np.ndarray, k_low: int, k_high: int, need_bytes: float, min_size: int) -> int | None:
    """Number of peers for the lower side, or None when no cut leaves both sides feasible in total."""
    count = len(memory_cum)
    total = float(memory_cum[-1])
    # Lower side = the first s peers (s >= 1): memory memory_cum[s - 1].
    lowest = max(int(np.searchsorted(memory_cum, k_low * need_bytes, side="left")) + 1, k_low * min_size)
    # Upper side keeps total - memory_cum[s - 1] >= k_high * need_bytes.
    highest = min(
        int(np.searchsorted(memory_cum, total - k_high * need_bytes, side="right")),
        count - k_high * min_size,
    )
    if lowest > highest:
        return None
    target = total * k_low / (k_low + k_high)
    s = int(np.searchsorted(memory_cum, target, side="left")) + 1  # first prefix reaching the share
    if s > 1 and target - float(memory_cum[s - 2]) < float(memory_cum[min(s, count) - 1]) - target:
        s -= 1  # the prefix one shorter is nearer the share
    return min(max(s, lowest), highest)


def _split_sse(points: np.ndarray, s: int) -> float:
    """Within-side sum of squared deviations if ``points`` (sorted) are cut after the first ``s``."""
    total = 0.0
    for side in (points[:s], points[s:]):
        total += float(((side - side.mean(axis=0)) ** 2).sum())
    return total


def bisect_clusters(
    features: np.ndarray, memory: np.ndarray, k: int, need_bytes: float, min_size: int
) -> np.ndarray | None:
    """Labels ``0 .. k-1`` of ``k`` feasible clusters by recursive bisection, or None if a cut fails.

    Args:
        features: ``(n, d)`` peer features in peer-id order.
        memory: ``(n,)`` memory bytes per peer (float64, exact below 2**53).
        k: clusters wanted, ``1 <= k``.
        need_bytes: memory a cluster needs to hold the model.
        min_size: peers a cluster needs.

    Returns:
        One label per peer; every cluster holds ``need_bytes`` and ``min_size`` peers. None when some
        node cannot be cut into two sides that are feasible in total.
    """
    n = len(features)
    labels = np.empty(n, dtype=np.intp)
    stack: list[tuple[np.ndarray, int, int]] = [(np.arange(n), k, 0)]
    while stack:
        index, clusters, first_label = stack.pop()
        if clusters == 1:
            if float(memory[index].sum()) < need_bytes or len(index) < min_size:
                return None
            labels[index] = first_label
            continue
        k_low = clusters // 2
        best: tuple[float, np.ndarray, int] | None = None
        for axis in range(features.shape[1]):
            order = index[np.lexsort((index, features[index, axis]))]
            s = _cut(np.cumsum(memory[order]), k_low, clusters - k_low, need_bytes, min_size)
            if s is not None:
                cost = _split_sse(features[order], s)
                if best is None or cost < best[0]:
                    best = (cost, order, s)
        if best is None:
            return None
        _, order, s = best
        stack.append((order[s:], clusters - k_low, first_label + k_low))
        stack.append((order[:s], k_low, first_label))
    return labels
