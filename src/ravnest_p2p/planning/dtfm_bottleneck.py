"""Compiled bottleneck perfect matching (numba), for the annealing kernel (`dtfm_kernel`).

The bottleneck of a square weight block: the least ``t`` such that a perfect matching uses only
entries ``<= t``. `fill` copies the block and returns the largest row or column minimum (every row
and column must be matched, so the answer is at least that: most rejected swap proposals stop
there); `complete` finds the matching from that level: a greedy start, then breadth-first
alternating searches from every free row at once; when none reaches a free column, the threshold
rises to the cheapest entry from a reached row to an unreached column, the least that can extend the
forest. Exact; the unit tests check it against `dtfm.bottleneck_matching` (the Python reference).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["bottleneck", "complete", "fill"]


@njit(cache=True)
def bottleneck(weights: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    """Bottleneck perfect matching of ``weights[rows][:, cols]`` (square): its largest matched weight."""
    size = rows.shape[0]
    sub = np.empty((size, size))
    return complete(sub, fill(weights, rows, cols, sub), np.empty(4 * size, np.int64))


@njit(cache=True)
def fill(weights: np.ndarray, rows: np.ndarray, cols: np.ndarray, sub: np.ndarray) -> float:
    """Copy ``weights[rows][:, cols]`` into ``sub``; return the largest row or column minimum (every row and
    column must be matched, so the bottleneck is at least that)."""
    size = rows.shape[0]
    level = 0.0
    for r in range(size):
        low = np.inf
        for c in range(size):
            value = weights[rows[r], cols[c]]
            sub[r, c] = value
            low = min(low, value)
        level = max(level, low)
    for c in range(size):
        low = sub[0, c]
        for r in range(1, size):
            low = min(low, sub[r, c])
        level = max(level, low)
    return level


@njit(cache=True)
def complete(sub: np.ndarray, level: float, work: np.ndarray) -> float:
    """The bottleneck of ``sub`` from a lower bound ``level``; ``work`` is int64 scratch of 4 x size."""
    size = sub.shape[0]
    col_of_row = work[:size]
    row_of_col = work[size : 2 * size]
    via = work[2 * size : 3 * size]
    queue = work[3 * size : 4 * size]
    for k in range(size):  # loops, not slice fills: `dtfm_kernel._run` compiles without reference counting
        col_of_row[k] = -1
        row_of_col[k] = -1
    matched = 0
    for r in range(size):  # greedy start at the lower bound
        for c in range(size):
            if row_of_col[c] < 0 and sub[r, c] <= level:
                row_of_col[c] = r
                col_of_row[r] = c
                matched += 1
                break
    while matched < size:
        # breadth-first alternating search from every free row at once; a row is reached when it is
        # free or matched to a reached column, so "reached" = free or row_of_col[via-reached column]
        for k in range(size):
            via[k] = -1
        tail = 0
        for r in range(size):
            if col_of_row[r] < 0:
                queue[tail] = r
                tail += 1
        head = 0
        found = -1
        while head < tail and found < 0:
            r = queue[head]
            head += 1
            for c in range(size):
                if via[c] < 0 and sub[r, c] <= level:
                    via[c] = r
                    nxt = row_of_col[c]
                    if nxt < 0:
                        found = c
                        break
                    queue[tail] = nxt  # matched rows are reached once: through their own column
                    tail += 1
        if found >= 0:
            c = found
            while c >= 0:
                r = via[c]
                previous = col_of_row[r]
                col_of_row[r] = c
                row_of_col[c] = r
                c = previous
            matched += 1
        else:  # the least entry that extends the forest: from a reached row to an unreached column
            rise = np.inf
            for q in range(tail):
                r = queue[q]
                for c in range(size):
                    if via[c] < 0 and sub[r, c] < rise:
                        rise = sub[r, c]
            level = rise
    return level
