"""Sites of a noisy network found in its matrix: devices that are twins up to per-pair noise.

Sites (`find_cities`). A device is described by its row of pipeline weights to every other device;
two devices of one city differ there only by per-pair noise, two of different cities also by the
city pairs. Profile distance: the mean absolute difference of the log weights over all third
devices; average linkage over it, cut at `CITY_TOLERANCE` x the median merge height (the merges
inside cities are most of them). On the hard cases this recovers the 8 cities exactly, where linkage
over the raw weights does not (per-pair noise of ~25% mixes them).

Site-level weights. `site_matrices`: per site pair a quantile of its device pairs' weights.
`matched_levels`: per site pair and k, the lowest pipeline weight at which k disjoint device pairs
join the two sites (a bottleneck k-matching inside the pair's block). A stage edge between two site
mixes needs as many pairs of a site pair as the mixes route through it, and the refine picks the
cheapest ones: on `hard-8x16-s0` the reference's city-crossing edges cost 5.38 and 5.71 s where the
site medians say 12.25 and 10.32, and the k-matching levels give 5.38 and 5.71 exactly.

Used by the mixes-first search (`dtfm_mix`) and the compiled annealer's same-site swaps.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ravnest_p2p.planning.dtfm import CostModel

__all__ = ["CITY_TOLERANCE", "find_cities", "matched_levels", "site_matrices"]

CITY_TOLERANCE = 1.3  # cut the profile linkage at this many times its median merge height


def _profile_distances(weights: np.ndarray) -> np.ndarray:
    n = weights.shape[0]
    logs = np.log(np.where(np.eye(n, dtype=bool), 1.0, weights))
    out = np.empty((n, n))
    diagonal = np.arange(n)
    for u in range(n):
        diff = np.abs(logs[u][None, :] - logs)  # row v, column w: |log w(u, w) - log w(v, w)|
        diff[:, u] = 0.0
        diff[diagonal, diagonal] = 0.0
        out[u] = diff.sum(axis=1) / max(n - 2, 1)
    out = (out + out.T) / 2.0
    np.fill_diagonal(out, 0.0)
    return out


def _average_linkage(distances: np.ndarray) -> list[tuple[int, int, float]]:
    """Merges ``(kept cluster, merged cluster, height)`` of average linkage, in order (ties: lowest index)."""
    n = distances.shape[0]
    d = distances.astype(float).copy()
    np.fill_diagonal(d, np.inf)
    sizes = np.ones(n)
    merges = []
    for _ in range(n - 1):
        flat = int(np.argmin(d))
        i, j = divmod(flat, n)
        i, j = min(i, j), max(i, j)
        height = float(d[i, j])
        merged = (sizes[i] * d[i] + sizes[j] * d[j]) / (sizes[i] + sizes[j])
        d[i], d[:, i] = merged, merged
        d[i, i] = np.inf
        d[j, :], d[:, j] = np.inf, np.inf
        sizes[i] += sizes[j]
        merges.append((i, j, height))
    return merges


def find_cities(model: CostModel, tolerance: float = CITY_TOLERANCE) -> np.ndarray:
    """Site label per device (0, 1, ... in order of each site's first device); see the module docstring."""
    n = model.num_devices
    labels = np.arange(n)
    if n < 3:
        return np.zeros(n, dtype=np.int64)
    merges = _average_linkage(_profile_distances(model.pp_weights))
    cut = tolerance * float(np.median([h for _, _, h in merges]))
    parent = np.arange(n)

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = int(parent[x])
        return x

    for i, j, height in merges:
        if height <= cut:
            parent[root(j)] = root(i)
    roots = [root(u) for u in range(n)]
    first: dict[int, int] = {}
    for u, r in enumerate(roots):
        first.setdefault(r, len(first))
        labels[u] = first[r]
    return labels.astype(np.int64)


def site_matrices(
    model: CostModel, labels: np.ndarray, quantile: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """``(all-reduce, pipeline)`` site x site ``quantile`` of the device pairs' weights (a one-device
    site's own entry: that of its weights to every other device)."""
    sites = int(labels.max()) + 1
    out = (np.zeros((sites, sites)), np.zeros((sites, sites)))
    for matrix, weights in zip(out, (model.dp_weights, model.pp_weights), strict=True):
        for a in range(sites):
            rows = labels == a
            for b in range(sites):
                block = weights[np.ix_(rows, labels == b)]
                if a == b:
                    block = (
                        block[~np.eye(len(block), dtype=bool)] if len(block) > 1 else weights[rows][:, ~rows]
                    )
                matrix[a, b] = float(np.quantile(block, quantile))
    return out


@njit(cache=True)
def _augment(allowed: np.ndarray, match_row: np.ndarray, match_col: np.ndarray) -> bool:
    """One augmenting path from any free row over ``allowed`` entries (BFS); applied when found."""
    rows, cols = allowed.shape
    from_col = np.full(cols, -1, np.int64)  # the row a column was reached from
    queue = np.empty(rows, np.int64)
    head = tail = 0
    for r in range(rows):
        if match_row[r] < 0:
            queue[tail] = r
            tail += 1
    seen = np.zeros(rows, np.bool_)
    seen[queue[:tail]] = True
    while head < tail:
        r = queue[head]
        head += 1
        for c in range(cols):
            if allowed[r, c] and from_col[c] < 0:
                from_col[c] = r
                if match_col[c] < 0:
                    while c >= 0:  # flip the path back to its free row
                        r = from_col[c]
                        previous = match_row[r]
                        match_row[r], match_col[c] = c, r
                        c = previous
                    return True
                nxt = match_col[c]
                if not seen[nxt]:
                    seen[nxt] = True
                    queue[tail] = nxt
                    tail += 1
    return False


@njit(cache=True)
def _k_levels(block: np.ndarray, pairs: int) -> np.ndarray:
    """``out[k]``: the lowest entry at which ``k + 1`` disjoint (row, column) pairs of ``block`` exist
    (inf entries are never used; inf when they cannot). Entries are added cheapest first and each one
    may grow the maximum matching by one augmenting path."""
    rows, cols = block.shape
    out = np.full(pairs, np.inf)
    flat = block.ravel()
    allowed = np.zeros((rows, cols), np.bool_)
    match_row, match_col = np.full(rows, -1, np.int64), np.full(cols, -1, np.int64)
    size = 0
    for index in np.argsort(flat, kind="mergesort"):
        if size >= pairs or not np.isfinite(flat[index]):
            break
        allowed[index // cols, index % cols] = True
        if _augment(allowed, match_row, match_col):
            out[size] = flat[index]
            size += 1
    return out


def matched_levels(model: CostModel, labels: np.ndarray, pairs: int) -> np.ndarray:
    """``levels[x, y, k]``: the lowest pipeline weight at which ``k + 1`` device pairs, no device in two,
    join site ``x`` to site ``y``; ascending in ``k``, inf where the sites run out. Inside one site the
    block is the site's own (no device paired with itself) and k stops at half the site: a device that
    both sends and receives there is not ruled out, an optimistic approximation."""
    sites = int(labels.max()) + 1
    members = [np.flatnonzero(labels == s) for s in range(sites)]
    out = np.full((sites, sites, pairs), np.inf)
    for x in range(sites):
        for y in range(x, sites):
            block = model.pp_weights[np.ix_(members[x], members[y])].astype(float)
            limit = pairs
            if x == y:
                np.fill_diagonal(block, np.inf)
                limit = min(pairs, len(members[x]) // 2)
            if limit > 0:
                out[x, y, :limit] = _k_levels(block, limit)[:limit]
            out[y, x] = out[x, y]
    return out
