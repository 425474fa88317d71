"""Open-path TSP for the DT-FM pipeline cost: exact when small, 2-opt + Or-opt beyond.

Problem. The pipeline term of the DT-FM cost (`dtfm`) is the shortest Hamiltonian path (any start, any
end) over the stage groups, with bottleneck-matching costs as distances. Held-Karp (`dtfm.open_loop_tsp`)
is exact but ``O(2^n n^2)``: measured 0.5 ms at 8 groups, 2.8 ms at 12 and 52 ms at 16 (numpy,
vectorised over subsets). A placement search evaluating thousands of swaps cannot pay 52 ms per swap.

Method. `shortest_path` runs Held-Karp up to ``exact_limit`` groups; above it, `improve_path` runs
first-improvement 2-opt (reverse a segment) and Or-opt (move a segment of 1-3 groups, either way round)
on the open path until neither helps. A swap changes two groups only, so the previous order is an
excellent warm start: the search passes it as ``hint``; without a hint we start from the identity
order and from greedy nearest-neighbour paths out of every group and keep the best. The result is never
worse than any start (so never worse than the identity order). Distances must be symmetric (the DT-FM
pipeline edges are).

Alternatives rejected. A cached Held-Karp (reuse the subset table for the unchanged groups) still needs
``O(2^n)`` memory per state and all rows change meaning when two groups change; Lin-Kernighan is more
code for paths of at most a few dozen nodes where 2-opt + Or-opt already matches the exact answer on
the instances the unit tests enumerate. Limits: above ``exact_limit`` the result is a local optimum
(an upper bound of the exact pipeline cost); the search re-scores its final answer exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.dtfm import open_loop_tsp

__all__ = ["EXACT_TSP_LIMIT", "improve_path", "path_length", "shortest_path"]

EXACT_TSP_LIMIT = 12


def path_length(distances: np.ndarray, order: Sequence[int]) -> float:
    """Length of the open path visiting ``order``."""
    return float(sum(distances[order[i], order[i + 1]] for i in range(len(order) - 1)))


def _nearest_neighbour(d: list[list[float]], start: int) -> list[int]:
    n = len(d)
    order = [start]
    left = set(range(n)) - {start}
    while left:
        last = order[-1]
        nxt = min(left, key=lambda j: (d[last][j], j))
        order.append(nxt)
        left.remove(nxt)
    return order


def _length(d: list[list[float]], order: list[int]) -> float:
    return sum(d[order[i]][order[i + 1]] for i in range(len(order) - 1))


def _two_opt_pass(d: list[list[float]], order: list[int]) -> bool:
    """One first-improvement 2-opt move on an open path (segment reversal, ends included)."""
    n = len(order)
    for i in range(n - 1):
        a_prev = order[i - 1] if i > 0 else -1
        a = order[i]
        for j in range(i + 1, n):
            b = order[j]
            b_next = order[j + 1] if j + 1 < n else -1
            before = (d[a_prev][a] if a_prev >= 0 else 0.0) + (d[b][b_next] if b_next >= 0 else 0.0)
            after = (d[a_prev][b] if a_prev >= 0 else 0.0) + (d[a][b_next] if b_next >= 0 else 0.0)
            if after < before - 1e-12 * max(1.0, before):
                order[i : j + 1] = order[i : j + 1][::-1]
                return True
    return False


def _or_opt_pass(d: list[list[float]], order: list[int]) -> bool:
    """One first-improvement Or-opt move: a segment of 1-3 nodes moved elsewhere, either way round."""
    n = len(order)

    def link(x: int, y: int) -> float:
        return d[x][y] if x >= 0 and y >= 0 else 0.0

    for size in (1, 2, 3):
        if size >= n:
            break
        for i in range(n - size + 1):
            segment = order[i : i + size]
            p = order[i - 1] if i > 0 else -1
            q = order[i + size] if i + size < n else -1
            gain = link(p, segment[0]) + link(segment[-1], q) - link(p, q)
            rest = order[:i] + order[i + size :]
            for piece in (segment, segment[::-1]):
                first, last = piece[0], piece[-1]
                for k in range(len(rest) + 1):
                    if k == i and piece is segment:
                        continue
                    x = rest[k - 1] if k > 0 else -1
                    y = rest[k] if k < len(rest) else -1
                    added = link(x, first) + link(last, y) - link(x, y)
                    if added < gain - 1e-12 * max(1.0, gain):
                        order[:] = rest[:k] + piece + rest[k:]
                        return True
    return False


def improve_path(distances: np.ndarray, order: Sequence[int]) -> tuple[float, tuple[int, ...]]:
    """2-opt + Or-opt local search on an open path from ``order``; never returns a longer path."""
    d = distances.tolist()
    work = list(order)
    while _two_opt_pass(d, work) or _or_opt_pass(d, work):
        pass
    return _length(d, work), tuple(work)


def shortest_path(
    distances: np.ndarray, hint: Sequence[int] | None = None, exact_limit: int = EXACT_TSP_LIMIT
) -> tuple[float, tuple[int, ...]]:
    """Shortest open path: exact (Held-Karp) up to ``exact_limit`` nodes, local search beyond.

    Args:
        distances: symmetric ``(n, n)`` matrix.
        hint: a warm-start order (e.g. the previous placement's); without it, identity and
            nearest-neighbour starts are all tried.
        exact_limit: largest ``n`` solved exactly.

    Returns:
        ``(length, order)``.
    """
    n = distances.shape[0]
    if n <= exact_limit:
        return open_loop_tsp(distances)
    if hint is not None:
        return improve_path(distances, hint)
    d = distances.tolist()
    starts = [list(range(n))] + [_nearest_neighbour(d, s) for s in range(n)]
    best: tuple[float, tuple[int, ...]] | None = None
    for start in starts:
        found = improve_path(distances, start)
        if best is None or found[0] < best[0]:
            best = found
    assert best is not None
    return best
