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

Methods. Bottleneck matching: a maximum matching (Kuhn, bitmask adjacency) of the entries up to an
easy lower bound (the largest row or column minimum, often the answer), then the other entries in
increasing order, each added to an alternating forest grown from the free rows until the matching is
perfect; the entry that completes it is the bottleneck. Exact; 16 us at 8x8 and 30 us at 16x16 on
noisy matrices, against 35 / 65 us for the binary search over thresholds with warm-started Kuhn
runs it replaced (same values on 3,000 random matrices with and without ties).
Open-loop TSP: Held-Karp over (visited set, last group), one vectorised step per subset size;
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
from typing import Any

import numpy as np

from ravnest_p2p.planning.dtfm_hall import HALL_LIMIT, batch_bottleneck

__all__ = [
    "CostModel",
    "Placement",
    "Workload",
    "bottleneck_matching",
    "matching_lower_bound",
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


def matching_lower_bound(weights: np.ndarray) -> float:
    """A lower bound of the bottleneck perfect matching of a square matrix: every row and every column
    must be matched, so the answer is at least the largest row or column minimum."""
    return max(float(weights.min(axis=1).max()), float(weights.min(axis=0).max()))


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
    # and usually the answer or close to it. A maximum matching at that level, then the remaining
    # entries in increasing order, each added to an alternating forest grown from the free rows: an
    # entry from a reached row to an unreached column either reaches a free column (augment; the
    # matching stays maximum) or extends the forest. The entry that completes the matching is the
    # bottleneck. Each augmentation costs O(entries) bit operations; no threshold is tried twice.
    lower = matching_lower_bound(weights)
    adjacency = _row_masks(weights <= lower)
    matched, row_of_col = _kuhn(adjacency, size, perfect=False)
    level = lower
    if matched < size:
        flat = weights.ravel()
        rest = np.flatnonzero(flat > lower)
        rest = rest[np.argsort(flat[rest], kind="stable")].tolist()
        level = _complete(adjacency, row_of_col, matched, rest, flat, size)
    col_of_row = [0] * size
    for col, row in enumerate(row_of_col):
        col_of_row[row] = col
    return level, tuple(col_of_row)


def _complete(
    adjacency: list[int], row_of_col: list[int], matched: int, entries: list[int], flat: np.ndarray, size: int
) -> float:
    """Add ``entries`` (flat indices, increasing weight) until the matching is perfect; its last weight.

    ``row_of_col`` holds a maximum matching of ``adjacency`` and is completed in place.
    """
    via_row = [-1] * size  # the reached row each reached column was reached from
    col_of_row = [-1] * size
    for col, row in enumerate(row_of_col):
        if row >= 0:
            col_of_row[row] = col
    reached_rows = reached_cols = 0

    def grow(queue: list[int]) -> int:
        """Extend the forest from ``queue``'s rows; a free column reached (or -1)."""
        nonlocal reached_rows, reached_cols
        while queue:
            row = queue.pop()
            fresh = adjacency[row] & ~reached_cols
            while fresh:
                low = fresh & -fresh
                fresh ^= low
                col = low.bit_length() - 1
                reached_cols |= low
                via_row[col] = row
                nxt = row_of_col[col]
                if nxt < 0:
                    return col
                reached_rows |= 1 << nxt
                queue.append(nxt)
        return -1

    def augment(col: int) -> None:
        while col >= 0:
            row = via_row[col]
            previous = col_of_row[row]
            row_of_col[col], col_of_row[row] = row, col
            col = previous

    def restart() -> int:
        nonlocal reached_rows, reached_cols
        free = [r for r in range(size) if col_of_row[r] < 0]
        reached_rows, reached_cols = sum(1 << r for r in free), 0
        return grow(free)

    found = restart()
    while found >= 0:  # only if the caller's matching was not maximum
        augment(found)
        matched += 1
        found = restart()
    for index in entries:
        row, col = divmod(index, size)
        adjacency[row] |= 1 << col
        if not (reached_rows >> row) & 1 or (reached_cols >> col) & 1:
            continue
        reached_cols |= 1 << col
        via_row[col] = row
        found = col if row_of_col[col] < 0 else -1
        if found < 0:
            nxt = row_of_col[col]
            reached_rows |= 1 << nxt
            found = grow([nxt])
        while found >= 0:
            augment(found)
            matched += 1
            if matched == size:
                return float(flat[index])
            found = restart()
    raise AssertionError("a complete bipartite graph has a perfect matching")


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
        self.memo: dict[str, Any] = {}
        """Facts and caches the searches derive from the matrices (e.g. `dtfm_anneal`'s twin classes)."""

    @property
    def num_devices(self) -> int:
        return int(self.dp_weights.shape[0])

    def group_dp_cost(self, group: Sequence[int]) -> float:
        idx = np.asarray(group)
        return float(self.dp_weights.take(idx, 0).take(idx, 1).sum(axis=1).max())

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
            value = bottleneck_matching(self.pp_weights.take(a, 0).take(b, 1))[0]
            self._edge_cache[key] = value
        return value

    def edge_costs(self, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[float]:
        """`edge_cost` of many pairs; uncached ones solved together when groups are small (`dtfm_hall`)."""
        if not pairs or len(pairs[0][0]) > HALL_LIMIT:
            return [self.edge_cost(a, b) for a, b in pairs]
        cache = self._edge_cache
        if len(cache) > 200_000:
            cache.clear()
        keys = [(a, b) if a <= b else (b, a) for a, b in pairs]
        missing = list({k for k in keys if k not in cache})
        if missing:
            rows = np.array([k[0] for k in missing])
            cols = np.array([k[1] for k in missing])
            values = batch_bottleneck(self.pp_weights[rows[:, :, None], cols[:, None, :]])
            cache.update(zip(missing, values.tolist(), strict=True))
        return [cache[k] for k in keys]

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
