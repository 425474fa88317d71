"""Sites of a noisy network found in its matrix: devices that are twins up to per-pair noise.

Sites (`find_cities`). A device is described by its row of pipeline weights to every other device;
two devices of one city differ there only by per-pair noise, two of different cities also by the
city pairs. Profile distance: the mean absolute difference of the log weights over all third
devices; average linkage over it, cut at `CITY_TOLERANCE` x the median merge height (the merges
inside cities are most of them). On the hard cases this recovers the 8 cities exactly, where linkage
over the raw weights does not (per-pair noise of ~25% mixes them).

Used by the mixes-first search (`dtfm_mix`) and the compiled annealer's same-site swaps.
"""

from __future__ import annotations

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel

__all__ = ["CITY_TOLERANCE", "find_cities", "site_matrices"]

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


def site_matrices(model: CostModel, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(all-reduce, pipeline)`` site x site medians of the device pairs' weights (a one-device site's
    own entry: the median of its weights to every other device)."""
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
                matrix[a, b] = float(np.median(block))
    return out
