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
Limits: a cut only checks that both sides have enough memory *in total*; with lumpy memories (one
card holding more than a model next to laptops) a side can have enough in total but no contiguous way
to split it, or no feasible cut at all. The cut is then made anyway, at the memory share, and the
caller repairs the short clusters by moving the nearest peers that others can spare (`kmeans.repair`),
or tries a smaller ``k`` if that fails.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bisect_clusters"]


def _cut(
    memory_cum: np.ndarray, k_low: int, k_high: int, need_bytes: float, min_size: int
) -> tuple[int, bool]:
    """Peers for the lower side, and whether both sides are then feasible in total.

    The cut nearest the lower side's memory share, clipped to the interval of cuts that leave both sides
    enough memory and peers; if that interval is empty, clipped only so that no cluster is left empty
    (the caller's repair then moves peers).
    """
    count = len(memory_cum)
    total = float(memory_cum[-1])
    # Lower side = the first s peers (s >= 1): memory memory_cum[s - 1].
    lowest = max(int(np.searchsorted(memory_cum, k_low * need_bytes, side="left")) + 1, k_low * min_size)
    # Upper side keeps total - memory_cum[s - 1] >= k_high * need_bytes.
    highest = min(
        int(np.searchsorted(memory_cum, total - k_high * need_bytes, side="right")),
        count - k_high * min_size,
    )
    feasible = lowest <= highest
    if not feasible:
        lowest, highest = k_low, count - k_high
    target = total * k_low / (k_low + k_high)
    s = int(np.searchsorted(memory_cum, target, side="left")) + 1  # first prefix reaching the share
    if s > 1 and target - float(memory_cum[s - 2]) < float(memory_cum[min(s, count) - 1]) - target:
        s -= 1  # the prefix one shorter is nearer the share
    return min(max(s, lowest), highest), feasible


def _split_sse(points: np.ndarray, s: int) -> float:
    """Within-side sum of squared deviations if ``points`` (sorted) are cut after the first ``s``."""
    total = 0.0
    for side in (points[:s], points[s:]):
        total += float(((side - side.mean(axis=0)) ** 2).sum())
    return total


def bisect_clusters(
    features: np.ndarray, memory: np.ndarray, k: int, need_bytes: float, min_size: int
) -> np.ndarray:
    """Labels ``0 .. k-1`` of ``k`` non-empty, compact clusters by memory-weighted recursive bisection.

    Args:
        features: ``(n, d)`` peer features in peer-id order.
        memory: ``(n,)`` memory bytes per peer (float64, exact below 2**53).
        k: clusters wanted, ``1 <= k <= n``.
        need_bytes: memory a cluster needs to hold the model.
        min_size: peers a cluster needs.

    Returns:
        One label per peer. Every cluster is non-empty; it holds ``need_bytes`` and ``min_size`` peers
        whenever every cut on its way could be made feasible in total, otherwise the caller repairs it
        (`kmeans.repair`) or tries a smaller ``k``.
    """
    n = len(features)
    if not 1 <= k <= n:
        raise ValueError(f"cannot make {k} non-empty clusters of {n} peers")
    labels = np.empty(n, dtype=np.intp)
    stack: list[tuple[np.ndarray, int, int]] = [(np.arange(n), k, 0)]
    while stack:
        index, clusters, first_label = stack.pop()
        if clusters == 1:
            labels[index] = first_label
            continue
        k_low = clusters // 2
        best: tuple[bool, float, np.ndarray, int] | None = None
        for axis in range(features.shape[1]):
            order = index[np.lexsort((index, features[index, axis]))]
            s, feasible = _cut(np.cumsum(memory[order]), k_low, clusters - k_low, need_bytes, min_size)
            cost = _split_sse(features[order], s)
            if best is None or (not feasible, cost) < (not best[0], best[1]):
                best = (feasible, cost, order, s)
        assert best is not None
        _, _, order, s = best
        stack.append((order[s:], clusters - k_low, first_label + k_low))
        stack.append((order[:s], k_low, first_label))
    return labels
