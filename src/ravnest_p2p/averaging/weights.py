"""Chunk sizes of a ring all-reduce whose members have links of different rates (pure, exact).

Problem. In the ring of `session.py` (C members in ring order, the shard cut into chunks c[0..C-1] that
sum to S), member i sends every chunk but c[i+1] in reduce-scatter and every chunk but c[i+2] in
all-gather: ``2S - c[i+1] - c[i+2]`` bytes on link i (member i -> member i+1). Link i runs at
``r[i] = min(upload[i], download[i+1])``. With equal chunks every link carries 2(C-1)/C * S, so the
slowest member's two links set the round time. Unequal chunks shift traffic off slow links:

    minimise T  subject to  2 - c[i+1] - c[i+2] <= T * r[i]  (every link i),  sum(c) = 1,  c >= 0

(S = 1). T is the busiest link's time; parts are pipelined, so a round takes about T plus the
pipeline's fill (see `ring.py`). Two chunks sum to at most S, so every link carries at least S and
T >= S / min(r). When the links other than the slowest member's two are at least twice as fast, that is
the optimum: one chunk holds everything, the slowest member reduces it, and its links carry S each
instead of 2(C-1)/C * S (1.5 S for C = 4). With equal rates the optimum is the usual 2(C-1)/C * S / B.

Which optimum. Many chunk vectors reach the optimal T (with equal rates and C = 4, (0, 1/2, 0, 1/2) as
well as (1/4, 1/4, 1/4, 1/4)). A second LP picks, among them, the one closest to equal chunks (smallest
largest deviation from 1/C): equal rates give exactly equal chunks, and chunks stay as even as the rates
allow (empty chunks idle a link while the pipeline fills).

Determinism. Every member must cut the shard at the same element boundaries, or the ring refuses its
parts. The rates are first reduced to integers (parts per million of the fastest link; IEEE division and
rounding give the same integers on every machine), both LPs are solved by a simplex in exact rational
arithmetic (`fractions.Fraction`, Bland's rule: no floating point, no ties broken by rounding), and the
boundaries are floors of exact fractions of `numel`. The boundaries' digest travels in every stream's
hello anyway, so members that were given different rates refuse each other cleanly.

Fallbacks to equal chunks: fewer than 3 members (with 2, every member sends exactly S whatever the
split), a rate missing, zero, negative or not finite, or a gain under `MIN_GAIN` (not worth the
unevenness), or more than `MAX_WEIGHTED_MEMBERS` members (the exact simplex grows quickly).

Alternatives rejected. hivemind's `load_balancing.py` solves a similar LP for its butterfly all-reduce
with scipy's floating-point solver; its results may differ in the last bits across builds, which a ring
whose members compute their boundaries independently cannot afford. The ring order stays the plan's
(hash order, `shards.py`); choosing it by rate as well is not explored.

Limits. Only link rates count: per-part costs, the fill of the pipeline and CPU are ignored. A big
chunk on a slow link makes single steps long: `RingConfig.step_timeout_s` must exceed the time the
slowest link needs for one part times the ring's depth, as before, but a member may now wait for its
left neighbour while that one moves a large chunk; the lab benchmark uses 60 s. Measured
(benchmarks/results/averaging_lab.md, 64 MB, 25/50/100/200 Mbit/s): 29.9 s against 44.5 s with equal
chunks and hivemind's 31.5 s, 0.68 of this LP's 20.5 s (the slow member's links run below their rate;
25.5 s with paced streams, see `ring.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction

__all__ = [
    "MAX_WEIGHTED_MEMBERS",
    "MIN_GAIN",
    "chunk_bounds",
    "chunk_fractions",
    "equal_bounds",
    "link_loads",
    "optimal_ring_time",
]

MIN_GAIN = Fraction(1, 50)  # weighted chunks only if they cut the busiest link's time by 2 % or more
MAX_WEIGHTED_MEMBERS = 12  # the exact simplex takes ~0.3 s at 12 members (once per rate vector)
_RATE_SCALE = 1_000_000


def equal_bounds(numel: int, num_members: int) -> list[int]:
    """Boundaries of `num_members` equal chunks (the default cut): chunk k is [b[k], b[k+1])."""
    return [k * numel // num_members for k in range(num_members + 1)]


def link_loads(chunks: Sequence[Fraction]) -> list[Fraction]:
    """Bytes on link i (member i -> i+1) per byte of shard, for chunk fractions summing to 1."""
    c = len(chunks)
    return [2 - chunks[(i + 1) % c] - chunks[(i + 2) % c] for i in range(c)]


def _integer_rates(upload: Sequence[float], download: Sequence[float]) -> tuple[int, ...] | None:
    """Link rates r[i] = min(upload[i], download[i+1]) in parts per million of the fastest, or None."""
    c = len(upload)
    if len(download) != c:
        return None
    for rate in (*upload, *download):
        if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
            return None
    links = [min(float(upload[i]), float(download[(i + 1) % c])) for i in range(c)]
    fastest = max(links)
    scaled = tuple(round(r / fastest * _RATE_SCALE) for r in links)
    return scaled if min(scaled) > 0 else None


# ----- an exact simplex ---------------------------------------------------------------------------
def _pivot(tab: list[list[Fraction]], basis: list[int], row: int, col: int) -> None:
    pivot = tab[row][col]
    tab[row] = [v / pivot for v in tab[row]]
    for r, other in enumerate(tab):
        if r != row and other[col] != 0:
            factor = other[col]
            tab[r] = [a - factor * b for a, b in zip(other, tab[row], strict=True)]
    basis[row] = col


def _run_simplex(tab: list[list[Fraction]], basis: list[int], cost: Sequence[Fraction], allowed: int) -> None:
    """Minimise cost·x over the tableau's rows (last column = rhs), entering columns < `allowed` only."""
    while True:
        reduced = list(cost[:allowed])
        for r, b in enumerate(basis):
            if cost[b] != 0:
                reduced = [v - cost[b] * tab[r][j] for j, v in enumerate(reduced)]
        col = next((j for j, v in enumerate(reduced) if v < 0), None)  # Bland: the first improving column
        if col is None:
            return
        best: tuple[Fraction, int, int] | None = None
        for r, row in enumerate(tab):
            if row[col] > 0:
                key = (row[-1] / row[col], basis[r], r)  # Bland: ties go to the smallest basic index
                if best is None or key < best:
                    best = key
        assert best is not None, "the LPs solved here are bounded"
        _pivot(tab, basis, best[2], col)


def _lp_min(
    cost: Sequence[Fraction], rows: Sequence[Sequence[Fraction]], rhs: Sequence[Fraction]
) -> list[Fraction]:
    """min cost·x s.t. rows·x = rhs, x >= 0 (two-phase simplex, exact). Raises ValueError if infeasible."""
    m, n = len(rows), len(cost)
    tab: list[list[Fraction]] = []
    for i, (row, b) in enumerate(zip(rows, rhs, strict=True)):
        sign = -1 if b < 0 else 1
        tab.append([sign * Fraction(v) for v in row] + [Fraction(int(k == i)) for k in range(m)] + [sign * b])
    basis = [n + i for i in range(m)]
    phase1 = [Fraction(0)] * n + [Fraction(1)] * m
    _run_simplex(tab, basis, phase1, n + m)
    if sum((tab[r][-1] for r, b in enumerate(basis) if b >= n), Fraction(0)) != 0:
        raise ValueError("infeasible")
    for r in range(m - 1, -1, -1):  # drive the (zero) artificials out of the basis, or drop their rows
        if basis[r] >= n:
            col = next((j for j in range(n) if tab[r][j] != 0), None)
            if col is None:
                del tab[r], basis[r]
            else:
                _pivot(tab, basis, r, col)
    _run_simplex(tab, basis, [*cost, *([Fraction(0)] * m)], n)
    x = [Fraction(0)] * n
    for r, var in enumerate(basis):
        x[var] = tab[r][-1]
    return x


# ----- the two LPs ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _solve(rates: tuple[int, ...]) -> tuple[Fraction, tuple[Fraction, ...]]:
    c = len(rates)
    zero, one = Fraction(0), Fraction(1)
    # LP 1, variables c[0..C-1], T, s[0..C-1]: c[i+1] + c[i+2] + r[i] T - s[i] = 2; sum(c) = 1
    n1 = 2 * c + 1
    rows: list[list[Fraction]] = []
    rhs: list[Fraction] = []
    for i in range(c):
        row = [zero] * n1
        row[(i + 1) % c] += 1
        row[(i + 2) % c] += 1
        row[c] = Fraction(rates[i])
        row[c + 1 + i] = -one
        rows.append(row)
        rhs.append(Fraction(2))
    rows.append([one] * c + [zero] * (c + 1))
    rhs.append(one)
    time = _lp_min([zero] * c + [one] + [zero] * c, rows, rhs)[c]
    # LP 2, variables c, D, s, p, q: the same links within `time`; |c[j] - 1/C| <= D; minimise D
    n2 = 4 * c + 1
    rows, rhs = [], []
    for i in range(c):
        need = 2 - time * rates[i]
        if need <= 0:
            continue  # met by any c >= 0
        row = [zero] * n2
        row[(i + 1) % c] += 1
        row[(i + 2) % c] += 1
        row[c + 1 + i] = -one
        rows.append(row)
        rhs.append(need)
    rows.append([one] * c + [zero] * (3 * c + 1))
    rhs.append(one)
    for j in range(c):
        upper = [zero] * n2  # c[j] - D + p[j] = 1/C
        upper[j], upper[c], upper[2 * c + 1 + j] = one, -one, one
        lower = [zero] * n2  # c[j] + D - q[j] = 1/C
        lower[j], lower[c], lower[3 * c + 1 + j] = one, one, -one
        rows += [upper, lower]
        rhs += [Fraction(1, c), Fraction(1, c)]
    cost = [zero] * n2
    cost[c] = one
    chunks = _lp_min(cost, rows, rhs)[:c]
    return time, tuple(chunks)


def optimal_ring_time(link_rates: Sequence[int]) -> Fraction:
    """The smallest busiest-link time T (per byte of shard, in 1/rate units) over all chunk vectors."""
    return _solve(tuple(link_rates))[0]


def chunk_fractions(upload: Sequence[float], download: Sequence[float]) -> tuple[Fraction, ...] | None:
    """Each member's chunk as a fraction of the shard, for members in ring order; None = equal chunks.

    Args:
        upload: each member's upload rate (any unit, the same for all), in ring order.
        download: each member's download rate, same unit and order (pass `upload` for symmetric links).
    """
    c = len(upload)
    if c < 3 or c > MAX_WEIGHTED_MEMBERS:
        return None
    rates = _integer_rates(upload, download)
    if rates is None:
        return None
    time, chunks = _solve(rates)
    equal_time = Fraction(2 * (c - 1), c) / min(rates)
    if time > (1 - MIN_GAIN) * equal_time:
        return None
    return chunks


def chunk_bounds(numel: int, upload: Sequence[float], download: Sequence[float] | None = None) -> list[int]:
    """Element boundaries of the C chunks of a `numel`-element shard: chunk k is [b[k], b[k+1]).

    Args:
        numel: shard size in elements.
        upload: each member's upload rate in ring order (any unit common to all).
        download: each member's download rate (default: the same as `upload`, symmetric links).

    Returns:
        C + 1 non-decreasing boundaries from 0 to `numel`; equal chunks when weighting does not apply.
    """
    fractions = chunk_fractions(upload, upload if download is None else download)
    if fractions is None:
        return equal_bounds(numel, len(upload))
    bounds, total = [0], Fraction(0)
    for share in fractions[:-1]:
        total += share
        bounds.append(math.floor(total * numel))
    bounds.append(numel)
    return bounds
