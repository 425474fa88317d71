"""Structure of a DT-FM network: interchangeable devices ("twins") and co-located devices ("sites").

Both feed the placement search (`dtfm_search`): twins shrink the swap neighbourhood (swapping two twins
changes nothing), sites give the structure-aware starting layouts. See `dtfm_search` for why.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement

__all__ = ["deciding_twins", "find_sites", "structured_placements", "twin_classes"]


def twin_classes(model: CostModel) -> np.ndarray:
    """Class id per device; devices with identical rows (except their mutual entry) share a class."""
    n = model.num_devices
    labels = np.full(n, -1)
    mats = (model.dp_weights, model.pp_weights)
    next_label = 0
    for u in range(n):
        if labels[u] >= 0:
            continue
        labels[u] = next_label
        for v in range(u + 1, n):
            if labels[v] >= 0:
                continue
            mask = np.ones(n, dtype=bool)
            mask[[u, v]] = False
            if all(np.array_equal(m[u, mask], m[v, mask]) for m in mats):
                labels[v] = next_label
        next_label += 1
    return labels


def deciding_twins(model: CostModel) -> np.ndarray | None:
    """Twin class per device when every off-diagonal entry of both matrices is a function of the two
    devices' classes (then a group's all-reduce and an edge's matching depend only on the classes of
    their devices: one evaluation per multiset, shared by every state of the model); else None."""
    memo = model.memo
    if "twin_labels" not in memo:
        labels = twin_classes(model)
        count = int(labels.max()) + 1
        off = ~np.eye(model.num_devices, dtype=bool)
        keys = (labels[:, None] * count + labels[None, :])[off]
        decided = count < model.num_devices
        for matrix in (model.dp_weights, model.pp_weights):
            values = matrix[off]
            low, high = np.full(count * count, np.inf), np.full(count * count, -np.inf)
            np.minimum.at(low, keys, values)
            np.maximum.at(high, keys, values)
            decided = decided and bool(np.array_equal(low[keys], high[keys]))
        memo["twin_labels"] = labels if decided else None
    result: np.ndarray | None = memo["twin_labels"]
    return result


def find_sites(model: CostModel, tolerance: float = 1.25) -> tuple[tuple[int, ...], ...]:
    """Co-located device sets: connected components of links within ``tolerance`` x the cheapest link."""
    n = model.num_devices
    off = ~np.eye(n, dtype=bool)
    threshold = float(model.pp_weights[off].min()) * tolerance
    close = (model.pp_weights <= threshold) & off
    site = np.full(n, -1)
    sites: list[tuple[int, ...]] = []
    for start in range(n):
        if site[start] >= 0:
            continue
        stack, members = [start], []
        site[start] = len(sites)
        while stack:
            u = stack.pop()
            members.append(u)
            for v in np.flatnonzero(close[u]):
                if site[v] < 0:
                    site[v] = len(sites)
                    stack.append(int(v))
        sites.append(tuple(sorted(members)))
    return tuple(sites)


def structured_placements(model: CostModel, sites: Sequence[Sequence[int]]) -> list[Placement]:
    """The two site-aware layouts: sites filling stage groups, and sites carrying pipeline segments."""
    stages, replicas = model.workload.num_stages, model.workload.num_replicas
    by_size = sorted(sites, key=lambda s: (-len(s), s[0]))
    flat = [d for s in by_size for d in s]
    stage_major = tuple(tuple(sorted(flat[i * replicas : (i + 1) * replicas])) for i in range(stages))
    # Pipeline-major: the grid has one row per replica, one column per stage; pack site pieces into
    # rows, each piece into the least-filled row it fits, so equal pieces line up in the same columns
    # and the pipeline edges between those columns stay inside sites for every replica.
    rows: list[list[int]] = [[] for _ in range(replicas)]
    pieces = [list(s[i : i + stages]) for s in by_size for i in range(0, len(s), stages)]
    pieces.sort(key=lambda p: -len(p))
    for piece in pieces:
        while piece:
            fits = [r for r in range(replicas) if len(rows[r]) + len(piece) <= stages]
            if fits:
                target = min(fits, key=lambda r: (len(rows[r]), r))
                rows[target] += piece
                piece = []
            else:
                target = min(range(replicas), key=lambda r: (len(rows[r]), r))
                room = stages - len(rows[target])
                rows[target] += piece[:room]
                piece = piece[room:]
    pipeline_major = tuple(tuple(sorted(rows[r][s] for r in range(replicas))) for s in range(stages))
    return [stage_major, pipeline_major]
