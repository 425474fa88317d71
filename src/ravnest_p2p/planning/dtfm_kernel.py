"""Compiled annealing over DT-FM placements *and* stage orders, for noisy networks (see `dtfm_search`).

Why. On noisy networks (no twins, no plateaus) the Python annealer (`dtfm_anneal`) spends 160-190 us
per swap proposal (bitmask matchings, path searches, Python objects), so a minute of CPU is ~350k
proposals, and which basin a 60 s run ends in varied by 3-14% between runs of the same code (session
12). This module runs the same kind of search compiled (numba), at ~1-3 us per proposal.

State. The partition (``members[g]``: the devices of stage group ``g``) *and* a stage order
(``order``: a permutation of the groups). The tracked cost is the DT-FM cost of the placement *along
that order*: ``max_g DP(g) + sum_i edge(order[i], order[i + 1])`` with the same arithmetic as
`dtfm.CostModel` (``DP`` from the per-device row sums of the all-reduce weights inside the group,
``edge`` the bottleneck perfect matching of the pipeline weights). That is an upper bound of the true
cost (whose path is the optimal open-loop TSP over the groups); the two meet when the order is
optimal, and order moves keep it near-optimal, so the search optimises both together instead of
solving a TSP per proposal. The caller re-scores the result exactly. The energy that decides
acceptance adds ``dp_slope x`` the mean group all-reduce cost: the max over groups is a plateau for
every group but the slowest, and the good layouts of the hard cases (`benchmarks/placement_cases.py`)
fill some groups from one large city (cheap all-reduce) and run the other groups' replicas as lanes
inside cities (cheap pipeline edges), which a pure max does not lead to (numbers in
`docs/planning-placement.md`). The best state is tracked by cost, not energy.

Moves (Metropolis at the caller's temperature):

* **swap** two devices of different groups: new row sums of the two groups (``O(D_DP)`` each), their
  all-reduce costs, and the <= 4 edges of the current order that touch them (bottleneck matchings);
  every changed edge first at a screen (``O(D_DP)``: the largest row minimum, the kept rows' minima
  cached with the edge and the arriving device's row afresh), then at its full lower bound (the
  block's row and column minima, ``O(D_DP^2)``), then solved one by one; rejected as soon as the bounds
  so far pass the acceptance threshold. On 16x8 ~83% of the cool proposals end at the screen and
  ~0.3% need a matching. The proposal's scratch arrays are allocated once per state.
* **reverse** a stretch of the order (2-opt on an open path: <= 2 edges change);
* **relocate** one group to another position (Or-opt of one: <= 3 edges change). Both price only the
  changed edges and apply in place.

Edges between groups are cached in a ``G x G`` matrix (``-1`` = unknown) with their blocks' row
minima (``G x G x D_DP``: row ``g``'s minima against group ``h`` in ``[g, h]``, so a block's column
minima are ``[h, g]``), and a swap forgets the rows of the two groups it changed; each edge is a
compiled bottleneck matching (`dtfm_bottleneck`). Session 19 (same decisions, seeded bests identical;
CPU per proposal, hot / cool part of the cooling): 16x8 1.14 / 1.00 -> 1.05 / 0.57 us, 8x8 0.81 /
0.69 -> 0.64 / 0.58, 8x16 2.34 / 1.69 -> 1.85 / 0.82 -- from the screen, from passing the arrays
one by one (not as a tuple: ~0.2 us of reference counting per proposal), and from order moves that
price only their changed edges (they re-summed the whole path on a fresh copy). Session 24: the proposal
loop `_run` is compiled without numba's reference counting (``_nrt=False``, and so are the functions
it calls; none allocates, and slice copies are written as loops, which that mode requires). With it,
every call of `_swap` increfed and decrefed its ~25 array arguments: ~0.4 us per proposal on a slower
machine (a toy call with 22 arrays: 367 ns with reference counting, 1 ns without), half of a cool
proposal. 16x8 hot / mid / cool: 1.58-1.80 / 1.10-1.21 / 0.92-1.08 -> 1.32 / 0.76 / 0.65 us; seeded
runs give bit-identical results.

Reproducible: the kernel draws from numba's own generator, seeded by `seed`; the same seed and the
same sequence of ``run`` calls give the same result. Compiled once per install (``cache=True``: the
first import in a fresh checkout compiles for ~10 s of CPU; later processes load the cache).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from ravnest_p2p.planning.dtfm_bottleneck import complete, fill

__all__ = ["KernelState", "seed"]

# numba's flag (not in its type stubs) that compiles a function, and what it calls, without reference
# counting: see the module docstring (session 24)
_NO_REFCOUNTS: dict[str, Any] = {"_nrt": False}


@njit(cache=True)
def seed(value: int) -> None:
    """Seed the kernel's generator (numba keeps its own, separate from numpy's)."""
    np.random.seed(value)


@njit(cache=True)
def _store_mins(sub: np.ndarray, mins: np.ndarray, g: int, h: int) -> None:
    """Row minima of the block ``sub`` (rows: group ``g``, columns: group ``h``) into ``mins[g, h]`` and
    its column minima into ``mins[h, g]``."""
    size = sub.shape[0]
    for r in range(size):
        low = sub[r, 0]
        for c in range(1, size):
            low = min(low, sub[r, c])
        mins[g, h, r] = low
    for c in range(size):
        low = sub[0, c]
        for r in range(1, size):
            low = min(low, sub[r, c])
        mins[h, g, c] = low


@njit(cache=True)
def _edge(
    pp: np.ndarray,
    members: np.ndarray,
    cache: np.ndarray,
    mins: np.ndarray,
    sub: np.ndarray,
    work: np.ndarray,
    g: int,
    h: int,
) -> float:
    if cache[g, h] < 0.0:
        level = fill(pp, members[g], members[h], sub)
        _store_mins(sub, mins, g, h)
        value = complete(sub, level, work)
        cache[g, h] = value
        cache[h, g] = value
    return cache[g, h]


@njit(cache=True)
def _path(
    pp: np.ndarray,
    members: np.ndarray,
    cache: np.ndarray,
    mins: np.ndarray,
    sub: np.ndarray,
    work: np.ndarray,
    order: np.ndarray,
) -> float:
    total = 0.0
    for i in range(order.shape[0] - 1):
        total += _edge(pp, members, cache, mins, sub, work, order[i], order[i + 1])
    return total


@njit(cache=True)
def _screen(
    pp: np.ndarray, mins: np.ndarray, partner: np.ndarray, g: int, h: int, slot: int, arriving: int
) -> float:
    """A lower bound of the edge between group ``g`` (whose member in ``slot`` is replaced by ``arriving``)
    and the unchanged group ``h`` (members ``partner``): the largest row minimum, the kept rows' from
    ``mins[g, h]``, the arriving device's row afresh. O(D_DP) instead of the full block's O(D_DP^2)."""
    size = partner.shape[0]
    level = pp[arriving, partner[0]]
    for c in range(1, size):
        level = min(level, pp[arriving, partner[c]])
    for k in range(size):
        if k != slot:
            level = max(level, mins[g, h, k])
    return level


@njit(cache=True)
def _swapped_sums(
    dp: np.ndarray, group: np.ndarray, sums: np.ndarray, leaving: int, arriving: int, out: np.ndarray
) -> float:
    """Row sums of ``group`` (``arriving`` already in, ``leaving`` out) into ``out``; their max.

    O(D_DP): each member loses its weight to the leaving device and gains the arriving one's; only the
    arriving device's own row is summed afresh."""
    size = group.shape[0]
    top = 0.0
    for k in range(size):
        m = group[k]
        if m == arriving:
            total = 0.0
            for q in range(size):
                if q != k:
                    total += dp[arriving, group[q]]
        else:
            total = sums[m] - dp[m, leaving] + dp[m, arriving]
        out[k] = total
        top = max(top, total)
    return top


@njit(cache=True)
def _swap(
    pp: np.ndarray, dp: np.ndarray, members: np.ndarray, group_of: np.ndarray, slot_of: np.ndarray,
    order: np.ndarray, rank: np.ndarray, sums: np.ndarray, groups_dp: np.ndarray, cache: np.ndarray,
    state: np.ndarray, subs: np.ndarray, work: np.ndarray, site_of: np.ndarray, by_site: np.ndarray,
    site_start: np.ndarray, new_a: np.ndarray, new_b: np.ndarray, sums_a: np.ndarray, sums_b: np.ndarray,
    lefts: np.ndarray, lows: np.ndarray, values: np.ndarray, mins: np.ndarray, temperature: float,
    delta_only: bool,
) -> float:  # fmt: skip
    """One swap proposal; returns the energy delta (applied if accepted; ``delta_only`` never applies).

    The arrays are `KernelState.arrays`, one by one: unpacking the tuple here, once per proposal, cost
    ~0.2 us of numba reference counting (session 19: a third of a cool proposal on 16x8)."""
    n = group_of.shape[0]
    size = members.shape[1]
    stages = members.shape[0]
    i = np.random.randint(0, n)
    a = group_of[i]
    if state[5] > 0.0 and np.random.random() < state[5]:  # a device of i's own site: the mix stays
        site = site_of[i]
        j = by_site[site_start[site] + np.random.randint(0, site_start[site + 1] - site_start[site])]
        b = group_of[j]
        if a == b:
            return 0.0
    else:
        j = np.random.randint(0, n)
        b = group_of[j]
        while a == b:
            j = np.random.randint(0, n)
            b = group_of[j]
    for k in range(size):
        new_a[k] = members[a, k]
        new_b[k] = members[b, k]
    new_a[slot_of[i]] = j
    new_b[slot_of[j]] = i
    top_a = _swapped_sums(dp, new_a, sums, i, j, sums_a)
    top_b = _swapped_sums(dp, new_b, sums, j, i, sums_b)
    old_max = 0.0
    new_max = max(top_a, top_b)
    for g in range(stages):
        old_max = max(old_max, groups_dp[g])
        if g != a and g != b:
            new_max = max(new_max, groups_dp[g])
    # edges of the current order touching a or b: (position of its left end)
    count = 0
    for p in (rank[a] - 1, rank[a], rank[b] - 1, rank[b]):
        if 0 <= p < stages - 1:
            dup = False
            for q in range(count):
                if lefts[q] == p:
                    dup = True
            if not dup:
                lefts[count] = p
                count += 1
    # the energy: the cost plus state[2] x the mean of the groups' all-reduce costs (a slope on the max's
    # plateau), each cost taken to the power state[3] relative to state[4] (> 1 weighs the slowest groups)
    if state[3] == 1.0:
        bias = state[2] * (top_a + top_b - groups_dp[a] - groups_dp[b]) / stages
    else:
        power, scale = state[3], state[4]
        bias = (
            state[2]
            * scale
            * (
                (top_a / scale) ** power
                + (top_b / scale) ** power
                - (groups_dp[a] / scale) ** power
                - (groups_dp[b] / scale) ** power
            )
            / stages
        )
    delta = new_max - old_max + bias
    for q in range(count):
        p = lefts[q]
        delta -= cache[order[p], order[p + 1]]
    threshold = np.inf
    if not delta_only:
        threshold = -temperature * math.log(1.0 - np.random.random())
    # every changed edge at a cheap lower bound first (one changed row against the cached row minima),
    # then at its full lower bound: most cool proposals end here, before any matching
    screened = 0.0
    for q in range(count):
        p = lefts[q]
        g = order[p]
        h = order[p + 1]
        low = 0.0
        g_changed = (g == a) | (g == b)  # not `in (a, b)`: slower in numba (measured)
        if g_changed != ((h == a) | (h == b)):  # one side changed: the other's members are as cached
            changed, kept = (g, h) if g_changed else (h, g)
            if changed == a:
                low = _screen(pp, mins, members[kept], a, kept, slot_of[i], j)
            else:
                low = _screen(pp, mins, members[kept], b, kept, slot_of[j], i)
        lows[q] = low
        screened += low
        if delta + screened > threshold:
            return delta + screened
    for q in range(count):
        p = lefts[q]
        g = order[p]
        h = order[p + 1]
        rows = new_a if g == a else (new_b if g == b else members[g])
        cols = new_a if h == a else (new_b if h == b else members[h])
        screened -= lows[q]
        lows[q] = fill(pp, rows, cols, subs[q])
        delta += lows[q]
        if delta + screened > threshold:  # lower bounds only add: the rest cannot bring it back
            return delta + screened
    for q in range(count):
        values[q] = complete(subs[q], lows[q], work)
        delta += values[q] - lows[q]
        if delta > threshold:
            return delta
    if delta_only:
        return delta
    for k in range(size):
        members[a, k] = new_a[k]
        members[b, k] = new_b[k]
    group_of[i] = b
    group_of[j] = a
    slot_i = slot_of[i]
    slot_of[i] = slot_of[j]
    slot_of[j] = slot_i
    for k in range(size):
        sums[new_a[k]] = sums_a[k]
        sums[new_b[k]] = sums_b[k]
    groups_dp[a] = top_a
    groups_dp[b] = top_b
    for g in range(stages):
        cache[a, g] = -1.0
        cache[g, a] = -1.0
        cache[b, g] = -1.0
        cache[g, b] = -1.0
    for q in range(count):
        p = lefts[q]
        cache[order[p], order[p + 1]] = values[q]
        cache[order[p + 1], order[p]] = values[q]
        _store_mins(subs[q], mins, order[p], order[p + 1])
    state[0] += delta - bias
    return delta


@njit(cache=True)
def _reorder(
    pp: np.ndarray,
    members: np.ndarray,
    order: np.ndarray,
    rank: np.ndarray,
    cache: np.ndarray,
    state: np.ndarray,
    temperature: float,
    mins: np.ndarray,
    sub: np.ndarray,
    work: np.ndarray,
) -> None:
    """One order proposal: reverse a stretch (2-opt: <= 2 edges change) or move one group elsewhere
    (Or-opt: <= 3 edges change); Metropolis on the changed edges only, applied in place."""
    stages = order.shape[0]
    threshold = -temperature * math.log(1.0 - np.random.random())
    if np.random.random() < 0.5:
        lo = np.random.randint(0, stages)
        hi = np.random.randint(0, stages)
        if lo > hi:
            lo, hi = hi, lo
        if lo == hi:
            return
        delta = 0.0
        if lo > 0:
            delta += _edge(pp, members, cache, mins, sub, work, order[lo - 1], order[hi])
            delta -= _edge(pp, members, cache, mins, sub, work, order[lo - 1], order[lo])
        if hi < stages - 1:
            delta += _edge(pp, members, cache, mins, sub, work, order[lo], order[hi + 1])
            delta -= _edge(pp, members, cache, mins, sub, work, order[hi], order[hi + 1])
        if delta > threshold:
            return
        while lo < hi:
            order[lo], order[hi] = order[hi], order[lo]
            rank[order[lo]] = lo
            rank[order[hi]] = hi
            lo += 1
            hi -= 1
    else:
        src = np.random.randint(0, stages)
        dst = np.random.randint(0, stages)
        if src == dst:
            return
        moved = order[src]
        delta = 0.0
        if src > 0:  # out of its place: its two edges go, its neighbours meet
            delta -= _edge(pp, members, cache, mins, sub, work, order[src - 1], moved)
        if src < stages - 1:
            delta -= _edge(pp, members, cache, mins, sub, work, moved, order[src + 1])
        if 0 < src < stages - 1:
            delta += _edge(pp, members, cache, mins, sub, work, order[src - 1], order[src + 1])
        # into place ``dst`` of the order without it (``rest[k]``: order[k] before src, order[k + 1] after)
        left = -1 if dst == 0 else (order[dst - 1] if dst - 1 < src else order[dst])
        right = -1 if dst == stages - 1 else (order[dst] if dst < src else order[dst + 1])
        if left >= 0 and right >= 0:
            delta -= _edge(pp, members, cache, mins, sub, work, left, right)
        if left >= 0:
            delta += _edge(pp, members, cache, mins, sub, work, left, moved)
        if right >= 0:
            delta += _edge(pp, members, cache, mins, sub, work, moved, right)
        if delta > threshold:
            return
        if src < dst:
            for p in range(src, dst):
                order[p] = order[p + 1]
                rank[order[p]] = p
        else:
            for p in range(src, dst, -1):
                order[p] = order[p - 1]
                rank[order[p]] = p
        order[dst] = moved
        rank[moved] = dst
    state[0] += delta


@njit(cache=True, **_NO_REFCOUNTS)
def _run(
    pp: np.ndarray,
    dp: np.ndarray,
    arrays: tuple,
    best_members: np.ndarray,
    best_order: np.ndarray,
    steps: int,
    t_start: float,
    t_end: float,
    order_share: float,
) -> None:
    (
        members, group_of, slot_of, order, rank, sums, groups_dp, cache, state, subs, work, site_of, by_site,
        site_start, new_a, new_b, sums_a, sums_b, lefts, lows, values, mins,
    ) = arrays  # fmt: skip
    factor = (t_end / t_start) ** (1.0 / steps) if steps > 0 else 1.0
    temperature = t_start / factor
    for _ in range(steps):
        temperature *= factor
        if np.random.random() < order_share:
            _reorder(pp, members, order, rank, cache, state, temperature, mins, subs[0], work)
        else:
            _swap(
                pp, dp, members, group_of, slot_of, order, rank, sums, groups_dp, cache, state, subs, work,
                site_of, by_site, site_start, new_a, new_b, sums_a, sums_b, lefts, lows, values, mins,
                temperature, False,
            )  # fmt: skip
        if state[0] < state[1] - 1e-12 * state[1]:
            state[1] = state[0]
            for g in range(members.shape[0]):
                best_order[g] = order[g]
                for k in range(members.shape[1]):
                    best_members[g, k] = members[g, k]


@njit(cache=True)
def _deltas(pp: np.ndarray, dp: np.ndarray, arrays: tuple, count: int) -> np.ndarray:
    out = np.empty(count)
    (
        members, group_of, slot_of, order, rank, sums, groups_dp, cache, state, subs, work, site_of, by_site,
        site_start, new_a, new_b, sums_a, sums_b, lefts, lows, values, mins,
    ) = arrays  # fmt: skip
    for k in range(count):
        out[k] = _swap(
            pp, dp, members, group_of, slot_of, order, rank, sums, groups_dp, cache, state, subs, work,
            site_of, by_site, site_start, new_a, new_b, sums_a, sums_b, lefts, lows, values, mins, 0.0, True,
        )  # fmt: skip
    return out


class KernelState:
    """A placement and a stage order with the arrays the compiled moves keep up to date.

    Args:
        pp_weights / dp_weights: the cost model's pipeline and all-reduce pair weights.
        placement: groups of device indices (any order inside a group).
        order: the initial stage order (a permutation of the group indices).
        dp_slope / dp_power: the energy's weight on the mean group all-reduce cost, and its power.
        sites / same_site_share: a site label per device, and the share of swap proposals that pair a
            device with another of its own site (such a swap keeps every group's site mix: for refining
            a layout whose mixes were chosen first, `dtfm_mix`). Without sites, every swap is uniform.
    """

    def __init__(
        self,
        pp_weights: np.ndarray,
        dp_weights: np.ndarray,
        placement: tuple[tuple[int, ...], ...],
        order: tuple[int, ...],
        dp_slope: float = 0.0,
        dp_power: float = 1.0,
        sites: np.ndarray | None = None,
        same_site_share: float = 0.0,
    ) -> None:
        self.pp = np.ascontiguousarray(pp_weights, dtype=np.float64)
        self.dp = np.ascontiguousarray(dp_weights, dtype=np.float64)
        self.members = np.array(placement, dtype=np.int64)
        stages, size = self.members.shape
        n = stages * size
        self.group_of = np.empty(n, np.int64)
        self.slot_of = np.empty(n, np.int64)
        for g in range(stages):
            for k in range(size):
                self.group_of[self.members[g, k]] = g
                self.slot_of[self.members[g, k]] = k
        self.order = np.array(order, dtype=np.int64)
        self.rank = np.empty(stages, np.int64)
        self.rank[self.order] = np.arange(stages)
        self.sums = np.empty(n)
        self.groups_dp = np.empty(stages)
        for g in range(stages):
            block = self.dp[np.ix_(self.members[g], self.members[g])]
            self.sums[self.members[g]] = block.sum(axis=1)
            self.groups_dp[g] = float(self.sums[self.members[g]].max())
        self.cache = np.full((stages, stages), -1.0)
        self.mins = np.empty((stages, stages, size))  # row minima of the cached edges' blocks (`_screen`)
        subs = np.empty((4, size, size))  # scratch: the <= 4 changed edges' weight blocks
        work = np.empty(4 * size, np.int64)  # scratch of the matching
        path = _path(self.pp, self.members, self.cache, self.mins, subs[0], work, self.order)
        cost = float(self.groups_dp.max()) + path
        # cost along the order, its best, the slope's weight, power and scale (the start's slowest group),
        # and the share of same-site swap proposals
        share = same_site_share if sites is not None else 0.0
        self.state = np.array([cost, cost, dp_slope, dp_power, float(self.groups_dp.max()), share])
        site_of = np.zeros(n, np.int64) if sites is None else np.asarray(sites, dtype=np.int64)
        if site_of.shape != (n,):
            raise ValueError(f"sites must give one label per device ({n})")
        by_site = np.argsort(site_of, kind="stable").astype(np.int64)
        site_start = np.searchsorted(site_of[by_site], np.arange(int(site_of.max()) + 2)).astype(np.int64)
        self.best_members = self.members.copy()
        self.best_order = self.order.copy()
        self.arrays = (
            self.members, self.group_of, self.slot_of, self.order, self.rank, self.sums, self.groups_dp,
            self.cache, self.state, subs, work, site_of, by_site, site_start,
            np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size), np.empty(size),
            np.empty(4, np.int64), np.empty(4), np.empty(4), self.mins,
        )  # fmt: skip

    @property
    def cost(self) -> float:
        return float(self.state[0])

    @property
    def best_cost(self) -> float:
        return float(self.state[1])

    def best_placement(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(sorted(int(d) for d in row)) for row in self.best_members)

    def set_slope(self, dp_slope: float) -> None:
        """The energy's weight on the mean group all-reduce from the next proposal on (the tracked cost and
        best are costs, not energies, so they stay valid)."""
        self.state[2] = dp_slope

    def run(self, steps: int, t_start: float, t_end: float, order_share: float) -> None:
        """``steps`` proposals cooling geometrically from ``t_start`` to ``t_end``."""
        _run(
            self.pp,
            self.dp,
            self.arrays,
            self.best_members,
            self.best_order,
            steps,
            t_start,
            t_end,
            order_share,
        )

    def swap_deltas(self, count: int) -> np.ndarray:
        """Energy deltas of ``count`` random swaps, none applied (to calibrate a temperature)."""
        return _deltas(self.pp, self.dp, self.arrays, count)
