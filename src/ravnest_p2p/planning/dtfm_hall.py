"""Bottleneck matchings of many small groups at once (numpy), for the placement search's swaps.

Problem. A swap in the annealer (`dtfm_anneal.SwapState`) changes two stage groups, so ``2 D_PP - 3``
pipeline edges -- each a bottleneck perfect matching (`dtfm.bottleneck_matching`) -- must be recomputed.
One matching costs 15-40 us of Python (Kuhn on bitmasks), which at 16 stages x 8 replicas is ~80% of a
swap's CPU time (cProfile, 15 s run of `hard-16x8-s0`: 12.5 of 15.7 s in matchings).

Method. For groups of at most `HALL_LIMIT` devices, all the changed edges are solved together. The
bottleneck value is the smallest entry ``t`` of a matrix such that the entries ``<= t`` hold a perfect
matching; by Hall's theorem that holds iff every set ``S`` of rows reaches at least ``|S|`` columns.
With rows as bitmasks of their allowed columns, the neighbourhoods of all ``2^r`` row sets come from
``r`` vectorised OR steps (each set = a smaller set plus one row), and a popcount table checks Hall's
condition for every matrix of the batch at once. The threshold is searched per matrix over its sorted
entries, from the easy lower bound (the largest row or column minimum, often the answer) upward by
bisection: ``1 + log2(r^2)`` vectorised tests for the whole batch. The value is exact (the same float
as `bottleneck_matching`; the unit tests compare them), the pairing is not returned.

Limits. ``2^r`` row sets: cheap at ``r <= 8`` (256), useless at 16 (65,536 per matrix), where the
caller keeps the one-at-a-time Kuhn matching.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HALL_LIMIT", "batch_bottleneck"]

HALL_LIMIT = 8

_PROBES = 8  # levels tested per matrix and round: at most 2 rounds past the lower bound at r = 8
_SIZES = np.array([bin(v).count("1") for v in range(1 << HALL_LIMIT)], dtype=np.uint8)
# Eight 0/1 bytes (a row of 8 booleans read as one little-endian uint64) times this constant put byte
# ``i`` at bit ``56 + i``: the row's bitmask in the top byte (any fixed column order serves Hall's test).
_GATHER = np.uint64(0x0102040810204080)
_TOP_BYTE = np.uint64(56)


def _popcount(values: np.ndarray) -> np.ndarray:
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0
        return np.bitwise_count(values)  # type: ignore[no-any-return]
    return _SIZES[values]  # type: ignore[no-any-return]


def _perfect(allowed: np.ndarray) -> np.ndarray:
    """Per matrix of ``allowed`` (``(B, r, r)`` bool): does it hold a perfect matching (Hall)?"""
    count, r, _ = allowed.shape
    if r == HALL_LIMIT:
        words = np.ascontiguousarray(allowed).view(np.uint64)[:, :, 0]
        masks = ((words * _GATHER) >> _TOP_BYTE).astype(np.uint8)  # (B, r): row -> bitmask of columns
    else:
        masks = np.packbits(allowed, axis=2, bitorder="little")[:, :, 0]
    reach = np.zeros((count, 1 << r), dtype=np.uint8)  # reach[:, S] = columns reached by row set S
    for i in range(r):
        reach[:, 1 << i : 2 << i] = reach[:, : 1 << i] | masks[:, i : i + 1]
    return ~np.any(_popcount(reach) < _SIZES[: 1 << r], axis=1)  # type: ignore[no-any-return]


def batch_bottleneck(weights: np.ndarray) -> np.ndarray:
    """Bottleneck perfect-matching value of each ``(r, r)`` matrix of ``weights`` (``(B, r, r)``).

    Args:
        weights: ``B`` square matrices with ``r <= HALL_LIMIT``.

    Returns:
        ``(B,)`` values, each equal to ``dtfm.bottleneck_matching(weights[i])[0]``.
    """
    count, r, _ = weights.shape
    if r > HALL_LIMIT:
        raise ValueError(f"batch_bottleneck handles groups of at most {HALL_LIMIT}, not {r}")
    if count == 0 or r == 0:
        return np.zeros(count)
    flat = weights.reshape(count, r * r)
    values = np.sort(flat, axis=1)
    lower = np.maximum(weights.min(axis=2).max(axis=1), weights.min(axis=1).max(axis=1))
    lo = (values < lower[:, None]).sum(axis=1)  # index of the lower bound: the answer is at or above it
    hi = np.full(count, r * r - 1)  # the largest entry always allows a perfect matching
    rows = np.arange(count)
    feasible = _perfect(weights <= values[rows, lo][:, None, None])
    hi = np.where(feasible, lo, hi)
    lo = np.where(feasible, lo, lo + 1)
    steps = np.arange(1, _PROBES + 1)
    while True:
        open_ = np.flatnonzero(lo < hi)
        if open_.size == 0:
            break
        # _PROBES levels per open matrix, evenly spaced in [lo, hi): feasibility is monotone in the
        # level, so the first feasible probe is the new upper end and the last infeasible one + 1 the
        # new lower end.
        low, span = lo[open_], hi[open_] - lo[open_]
        probes = low[:, None] + (span[:, None] * (steps - 1)) // _PROBES  # (m, K), non-decreasing
        levels = values[open_[:, None], probes]
        ok = _perfect((weights[open_][:, None] <= levels[:, :, None, None]).reshape(-1, r, r))
        ok = ok.reshape(len(open_), _PROBES)
        first_ok = np.where(ok.any(axis=1), probes[np.arange(len(open_)), ok.argmax(axis=1)], hi[open_])
        failed = np.where(ok, -1, probes).max(axis=1)
        hi[open_] = first_ok
        lo[open_] = np.maximum(low, failed + 1)
    return values[rows, lo]  # type: ignore[no-any-return]
