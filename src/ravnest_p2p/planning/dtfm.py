"""DT-FM communication cost model (Yuan et al., NeurIPS 2022, arXiv 2206.01288, eqs. 1-4).

Problem. ``N = D_PP * D_DP`` devices train a model cut into ``D_PP`` pipeline stages, each stage
replicated ``D_DP`` times (tasklets = stage x replica). A *placement* partitions the devices into
``D_PP`` groups of ``D_DP`` devices; every device of a group holds the same stage. Given the symmetric
latency matrix ``alpha`` (seconds) and bandwidth matrix ``beta`` (bytes/s), its cost per iteration is

* data parallel (eq. 2): each group all-reduces ``c_dp`` bytes with a scatter-gather all-reduce where
  every device exchanges a ``c_dp / D_DP`` shard with every other device of its group, twice::

      DP(group) = max_{d in group} sum_{d' in group, d' != d} 2 (alpha[d,d'] + c_dp / (D_DP beta[d,d']))
      DP = max over groups                     (groups run concurrently)

* pipeline parallel (eqs. 3-4): consecutive stages exchange ``c_pp`` bytes of activations forward and
  as many gradients backward, each device of one group paired with one of the next; the pairing is the
  *bottleneck perfect matching* of the weights ``2 (alpha + c_pp / beta)`` and the stage order is the
  *open-loop travelling-salesman path* over the groups with those bottleneck values as distances::

      PP = min over paths g_1 .. g_{D_PP} of sum_i bottleneck_matching(g_i, g_{i+1})

* total = DP + PP (the paper's communication cost; computation is the same in every placement).

Methods. Bottleneck matching: binary search over the distinct weights above an easy lower bound (the
largest row or column minimum), each step a Kuhn augmenting-path test on bitmask adjacency, warm-started
from the matching of the previous step (a matching stays valid at a higher threshold; a perfect one
keeps its cheap pairs at a lower one): exact, ~3x fewer augmentations than cold starts on 16x16 noisy
matrices. Open-loop TSP: Held-Karp over (visited set, last group), one vectorised step per subset size;
exact, O(2^n n^2): 0.19 ms at 8 groups, 3 ms at 12, ~90 ms at 16 (`dtfm_paths` takes over in the search
loop beyond 12). Both are checked against brute force in the unit tests.

Alternatives rejected: Hungarian (min-sum) matching answers a different question (the slowest pair
sets the pace, not the average); nearest-neighbour TSP is not exact and the exact one is cheap at the
stage counts pipelines use. Limits: the model ignores contention on shared links and overlap of
communication with compute, exactly as the paper does.

The search over placements lives in `dtfm_search`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = [
    "CostModel",
    "Placement",
    "Workload",
    "bottleneck_matching",
    "open_loop_tsp",
    "random_placement",
]

Placement = tuple[tuple[int, ...], ...]
"""``D_PP`` groups of ``D_DP`` device indices each; a group's stage position is chosen by the TSP."""


@dataclass(frozen=True)
class Workload:
    """Sizes of the tasklet grid and of what crosses the links per iteration.

    Attributes:
        num_stages: ``D_PP``, pipeline stages.
        num_replicas: ``D_DP``, data-parallel replicas of each stage.
        c_dp_bytes: parameter (gradient) bytes of one stage, all-reduced per iteration.
        c_pp_bytes: activation bytes one device sends to the next stage per iteration (and as many
            gradient bytes back).
    """

    num_stages: int
    num_replicas: int
    c_dp_bytes: float
    c_pp_bytes: float


def _row_masks(allowed: np.ndarray) -> list[int]:
    """Each row of a boolean matrix as an int bitmask of its allowed columns."""
    size = allowed.shape[1]
    if size <= 62:
        powers = np.left_shift(np.int64(1), np.arange(size, dtype=np.int64))
        return [int(m) for m in (allowed.astype(np.int64) * powers).sum(axis=1)]
    return [int(sum(1 << int(c) for c in np.flatnonzero(row))) for row in allowed]


def _kuhn(
    adjacency: Sequence[int], size: int, *, perfect: bool, start: Sequence[int] | None = None
) -> tuple[int, list[int]]:
    """Kuhn's augmenting paths on bitmask rows, optionally warm-started.

    Args:
        adjacency: row ``r`` may match column ``c`` iff bit ``c`` of ``adjacency[r]`` is set.
        size: number of columns.
        perfect: stop at the first row that cannot be matched.
        start: a ``row_of_col`` to start from; pairs no longer allowed by ``adjacency`` are dropped.

    Returns:
        ``(matched, row_of_col)``; with ``perfect=True`` it stops at the first unmatched row.
    """
    row_of_col = [-1] * size
    matched = 0
    is_matched = [False] * len(adjacency)
    if start is not None:
        for col, row in enumerate(start):
            if row >= 0 and (adjacency[row] >> col) & 1:
                row_of_col[col] = row
                is_matched[row] = True
                matched += 1

    def augment(row: int, visited: list[int]) -> bool:
        candidates = adjacency[row] & ~visited[0]
        while candidates:
            low = candidates & -candidates
            candidates ^= low
            if visited[0] & low:
                continue
            visited[0] |= low
            col = low.bit_length() - 1
            if row_of_col[col] < 0 or augment(row_of_col[col], visited):
                row_of_col[col] = row
                return True
        return False

    for row in range(len(adjacency)):
        if is_matched[row]:
            continue
        if augment(row, [0]):
            matched += 1
        elif perfect:
            return matched, row_of_col
    return matched, row_of_col


def max_matching_size(weights: np.ndarray, threshold: float) -> int:
    """Size of a maximum matching using only entries ``<= threshold`` (a search tie-breaker)."""
    return _kuhn(_row_masks(weights <= threshold), weights.shape[1], perfect=False)[0]


def bottleneck_matching(weights: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """Perfect matching of rows to columns minimising the largest matched weight.

    Args:
        weights: square matrix, ``weights[i, j]`` = cost of pairing row ``i`` with column ``j``.

    Returns:
        ``(bottleneck, col_of_row)``.
    """
    size = weights.shape[0]
    if size == 0:
        return 0.0, ()
    # Every row and every column must be matched: the largest row/column minimum is a lower bound,
    # and on structured networks it is usually the answer (one Kuhn run instead of a search).
    lower = max(float(weights.min(axis=1).max()), float(weights.min(axis=0).max()))
    levels = np.unique(weights[weights >= lower])

    # Warm starts keep the search cheap: a matching found at a lower threshold stays valid at any
    # higher one, and a perfect matching at a higher threshold keeps its pairs below a lower one.
    below: list[int] | None = None  # largest partial matching seen at an infeasible level
    above: list[int] | None = None  # perfect matching at the lowest feasible level so far

    def feasible(index: int) -> list[int] | None:
        nonlocal below
        masks = _row_masks(weights <= levels[index])
        matched, row_of_col = _kuhn(masks, size, perfect=True, start=below or above)
        if matched == size:
            return row_of_col
        below = row_of_col
        return None

    best = feasible(0)
    lo = 0
    if best is None:
        lo, hi = 1, len(levels) - 1  # the last level allows every pair: always feasible
        best = feasible(hi)
        assert best is not None
        above = best
        while lo < hi:
            mid = (lo + hi) // 2
            found = feasible(mid)
            if found is None:
                lo = mid + 1
            else:
                hi, best, above = mid, found, found
    col_of_row = [0] * size
    for col, row in enumerate(best):
        col_of_row[row] = col
    return float(levels[lo]), tuple(col_of_row)


@lru_cache(maxsize=32)
def _held_karp_layers(n: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per subset size ``k >= 2``: (subsets, last node, subset without it) of every (subset, last) pair."""
    masks = np.arange(1 << n)
    counts = np.array([bin(m).count("1") for m in range(1 << n)])
    layers = []
    for k in range(2, n + 1):
        sel_all, last_all = [], []
        for j in range(n):
            sel = masks[(counts == k) & ((masks >> j) & 1 == 1)]
            sel_all.append(sel)
            last_all.append(np.full(len(sel), j))
        sel_cat, last_cat = np.concatenate(sel_all), np.concatenate(last_all)
        layers.append((sel_cat, last_cat, sel_cat ^ (1 << last_cat)))
    return tuple(layers)


def open_loop_tsp(distances: np.ndarray) -> tuple[float, tuple[int, ...]]:
    """Shortest Hamiltonian path (any start, any end) through a symmetric or asymmetric matrix.

    Returns:
        ``(length, order)``; exact (Held-Karp, one vectorised step per subset size). Ties go to the
        lowest indices.
    """
    n = distances.shape[0]
    if n <= 1:
        return 0.0, tuple(range(n))
    full = (1 << n) - 1
    cost = np.full((1 << n, n), np.inf)
    parent = np.full((1 << n, n), -1, dtype=np.int64)
    for j in range(n):
        cost[1 << j, j] = 0.0
    columns = distances.T  # columns[j, i] = distances[i, j]
    for sel, last, prev in _held_karp_layers(n):
        options = cost[prev] + columns[last]
        arg = np.argmin(options, axis=1)
        cost[sel, last] = options[np.arange(len(sel)), arg]
        parent[sel, last] = arg
    last_node = int(np.argmin(cost[full]))
    length = float(cost[full, last_node])
    order = [last_node]
    mask = full
    while len(order) < n:
        prev_node = int(parent[mask, order[-1]])
        mask ^= 1 << order[-1]
        order.append(prev_node)
    return length, tuple(reversed(order))


def random_placement(workload: Workload, rng: np.random.Generator) -> Placement:
    """A uniformly random partition of ``D_PP * D_DP`` devices into groups (the paper's baseline)."""
    devices = rng.permutation(workload.num_stages * workload.num_replicas)
    k = workload.num_replicas
    return tuple(
        tuple(sorted(int(d) for d in devices[i * k : (i + 1) * k])) for i in range(workload.num_stages)
    )


class CostModel:
    """DT-FM cost of placements on one network (matrices are fixed; pair costs are memoised).

    Args:
        latency_s: ``(N, N)`` one-way cost per message, seconds (the data sets use the ping RTT).
        bandwidth_bytes_per_s: ``(N, N)`` link bandwidth, bytes per second.
        workload: stage/replica counts and message sizes.
    """

    def __init__(self, latency_s: np.ndarray, bandwidth_bytes_per_s: np.ndarray, workload: Workload):
        n = workload.num_stages * workload.num_replicas
        if latency_s.shape != (n, n) or bandwidth_bytes_per_s.shape != (n, n):
            raise ValueError(f"matrices must be {n}x{n} for {workload}")
        if np.any(bandwidth_bytes_per_s[~np.eye(n, dtype=bool)] <= 0) or np.any(latency_s < 0):
            raise ValueError("bandwidth must be > 0 and latency >= 0 off the diagonal")
        self.workload = workload
        safe_beta = np.where(np.eye(n, dtype=bool), 1.0, bandwidth_bytes_per_s)
        dp = 2.0 * (latency_s + workload.c_dp_bytes / (workload.num_replicas * safe_beta))
        np.fill_diagonal(dp, 0.0)
        self.dp_weights = dp
        self.pp_weights = 2.0 * (latency_s + workload.c_pp_bytes / safe_beta)
        self._edge_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}

    @property
    def num_devices(self) -> int:
        return int(self.dp_weights.shape[0])

    def group_dp_cost(self, group: Sequence[int]) -> float:
        idx = np.asarray(group)
        return float(self.dp_weights[np.ix_(idx, idx)].sum(axis=1).max())

    def dp_cost(self, placement: Placement) -> float:
        """Eq. 2: the slowest all-reduce over all stage groups."""
        return max(self.group_dp_cost(g) for g in placement)

    def edge_cost(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """Bottleneck-matching cost between two groups (memoised; groups as sorted tuples)."""
        key = (a, b) if a <= b else (b, a)
        value = self._edge_cache.get(key)
        if value is None:
            if len(self._edge_cache) > 200_000:
                self._edge_cache.clear()
            value = bottleneck_matching(self.pp_weights[np.ix_(np.asarray(a), np.asarray(b))])[0]
            self._edge_cache[key] = value
        return value

    def edge_matrix(self, placement: Placement) -> np.ndarray:
        k = len(placement)
        matrix = np.zeros((k, k))
        for i in range(k):
            for j in range(i + 1, k):
                matrix[i, j] = matrix[j, i] = self.edge_cost(placement[i], placement[j])
        return matrix

    def pp_cost(self, placement: Placement) -> tuple[float, tuple[int, ...]]:
        """Eqs. 3-4: open-loop TSP over groups with bottleneck-matching distances; returns the order."""
        return open_loop_tsp(self.edge_matrix(placement))

    def cost(self, placement: Placement) -> float:
        """Total DT-FM communication cost (seconds per iteration) of ``placement``."""
        return self.dp_cost(placement) + self.pp_cost(placement)[0]

    def check(self, placement: Placement) -> None:
        """Raise ValueError unless ``placement`` is a partition into equal groups of the right sizes."""
        w = self.workload
        flat = sorted(d for g in placement for d in g)
        if len(placement) != w.num_stages or any(len(g) != w.num_replicas for g in placement):
            raise ValueError("placement must have num_stages groups of num_replicas devices")
        if flat != list(range(self.num_devices)):
            raise ValueError("placement must use every device exactly once")
