"""Site mixes first: a coarse search over how many devices of each site every stage group holds.

Why. On noisy world-wide networks with wide stage groups (`benchmarks/placement_cases.py`, 8 stages x
16 replicas) what decides a search is the *mix* of every group -- how many devices of each city it
holds -- and it is chosen while a device-level annealer is still hot: the good layouts run replicas as
lanes inside one city through a run of consecutive groups that share one mix, and a single swap breaks
every lane it touches, so a run's mix cannot change one group at a time. Session 14 measured that a
60 s device-level search picks a good mix about once in 30 tries, and that the reference's own mixes,
filled with random devices of each city, refine to 1.005-1.010x of it. So this module finds sites,
searches mixes on a site-level model, and leaves the devices to the compiled annealer (`dtfm_race`,
with same-site swaps that keep a mix while devices are chosen).

Sites come from the matrix (`dtfm_sites.find_cities`).

Site-level model (`site_model`). A group's all-reduce: the largest row sum of its mix over the site
pairs' `DP_QUANTILE` all-reduce weights (the refine picks the better devices). An edge: the bottleneck
transport between two mixes, where site pair ``(x, y)`` carries at a weight level as many replicas as
it has disjoint device pairs at or below that level (`dtfm_sites.matched_levels`; bisection over the
levels, max flow with those capacities per level). It is a lower bound of the edge of every filling
of the two mixes (a test), exact when sites are made of twins, and it prices a city crossing at the
pairs the refine can pick: on `hard-8x16-s0` the reference's two crossings cost 5.38 and 5.71 s, the
site medians said 12.25 and 10.32, the matched levels say 5.38 and 5.71. The medians' model
(`MATCHED = False`, `DP_QUANTILE = 0.5`) ranked a mix that refines to 1.11-1.13x (62.71) ahead of one
that refines to ~1.02x (62.78) and both far ahead of the reference's own mix (67.79); this one ranks
them reference 42.63 < 43.00 < 45.90, near the reference's cost (45.72). Measured (60 s CPU, seeds
0-7, ratio to the reference): medians 1.098 1.049 1.013 1.037 1.081 1.021 1.006 1.025 (mean 1.041);
matched 1.006 1.005 0.998 1.007 1.016 1.027 1.008 1.057 (mean 1.016). Re-measured in session 16 over
21 runs of the matched model: mean 1.05, 6 of 21 <= 1.02 (`docs/planning-placement.md`): the 8 runs
above were a lucky draw of a time-sliced search.

Mix search (`search_mixes`). Compiled Metropolis over ``counts[g, s]`` (rows sum to the replicas,
columns to the site sizes) and a stage order, energy = estimated cost + a slope (`MIX_SLOPE`, 1.0, by
default) x the mean group all-reduce (as `dtfm_kernel`). Moves: one device of site ``x`` for one of
``y`` between two groups; the same along two disjoint stretches of the order at once (`LANE_SHARE`: a
lane of one site traded for a lane of another through a run of groups); stretch reversals of the order
(`ORDER_SHARE`). Evaluation is incremental (changed groups, their edges). Several annealers from random
mixes race on one cooling schedule (from the temperature that accepts the median uphill move half the
time to 1/1000 of it) and are halved at 1/2, 3/4, ... of it, as in `dtfm_race`. Below 128 devices the
slope is 0.3 (`dtfm_mixes_first._MIX_SLOPE_FEW`, session 20).

Session 17. (1) Edges go through a direct-mapped memo keyed by the two mixes (`_memo_edge`, shared by
the racers of one search; exact: the stored value is what `_mix_edge` returns): a proposal cost ~6 us
of max flows, and the cooler half of the schedule revisits the same mix pairs, so the search makes
~170k proposals per CPU second hot, 0.4-2.5 M cool (`hard-8x16-s0`). (2) A tie-break: the searched
score adds `CROSS_WEIGHT` (0.03 s) per replica an edge must carry across sites (`_crossings`). The
estimate cannot tell near-twin mixes apart (the search's 40.78 mix and the 40.83 one differ by four
devices), but their fillings refine differently: 45 CPU-s, one filling cooled to 0.005x, the 40.83
mix (19 crossings along the path) 1.0044 0.9998 1.0030 1.0046 of the reference, the 40.78 one (25
crossings: a run of groups whose cities alternate) 1.0345 1.0372 1.0144 1.0347 1.0015 1.0228. With
the tie-break the search ends on the 40.83 mix whenever it reaches that basin. Hit rate of that basin
(15 s, 8 seeds each): 8 racers 6 of 8, 16 racers 5 of 8, 32 racers 2 of 8; 4 racers 4 of 12 (the
default was 4 racers: 8 now, `dtfm_mixes_first._MIX_ANNEALERS`).
(3) A run-boundary move (`_boundary`, `BOUNDARY_SHARE` of the proposals): the misses that were left
were other run structures (Frankfurt through 3 groups and Oregon + London + Ireland through 4,
against 4 and 3), which no chain of unit or lane moves connects without climbing. The move gives a
group its neighbour's mix and trades what it gave up back into the groups on its own side, nearest
first. 15 s, 8 racers: the good basin in 12 of 16 runs (control, same code without it, 4 of 8); full
60 s searches reached it in 11 of 12 (numbers in `docs/planning-placement.md`).

What it reaches (session 15, `docs/planning-placement.md`): on the 8x16 hard case the estimate ranks
the reference's mixes near the top, and a 15 s mix search ends at the best estimate seen in about a
third of the runs; the mix search is a lottery of its own, and so is the device refine after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit

from ravnest_p2p.planning.dtfm import CostModel, Placement, random_placement
from ravnest_p2p.planning.dtfm_anneal import uphill_temperature
from ravnest_p2p.planning.dtfm_sites import matched_levels, site_matrices

__all__ = ["MixCandidate", "fill_mix", "mix_estimate", "search_mixes", "site_model"]

ORDER_SHARE = 0.15  # share of mix proposals that reverse a stretch of the stage order
BOUNDARY_SHARE = 0.05  # share of mix proposals that move a run boundary (`_boundary`)
LANE_SHARE = 0.5  # share of mix proposals that trade a lane through a stretch of groups
MIX_SLOPE = 1.0  # the energy's weight on the mean group all-reduce (as `dtfm_race.DP_SLOPE`), by default
MATCHED = True  # stage edges from k-matching levels (`dtfm_sites.matched_levels`); False: site medians
DP_QUANTILE = 0.25  # the quantile of a site pair's all-reduce weights a group's mix is estimated with
_CHUNK_S = 0.02  # CPU seconds between clock reads
MEMO_SLOTS = 1 << 17  # slots of the stage-edge memo of a mix search (`_memo_edge`; a power of two)
CROSS_WEIGHT = 0.03  # s per replica an edge carries across sites, in the searched score (a tie-break)
NOTE_EVERY_S = 0.5  # CPU seconds between reports of the best mix so far (`search_mixes(on_best=...)`)


@dataclass(frozen=True)
class MixCandidate:
    """A mix (``counts[g, s]``: devices of site ``s`` in group ``g``), a stage order, its estimate, and the
    score the search ranked it by (the estimate + `CROSS_WEIGHT` x its edges' `_crossings`)."""

    estimate: float
    counts: np.ndarray
    order: np.ndarray
    score: float


@njit(cache=True)
def _mix_dp(counts: np.ndarray, dp: np.ndarray) -> float:
    top = 0.0
    for j in range(counts.shape[0]):
        if counts[j] > 0:
            total = -dp[j, j]
            for k in range(counts.shape[0]):
                total += counts[k] * dp[j, k]
            top = max(top, total)
    return top


@njit(cache=True)
def _transport_fits(a: np.ndarray, b: np.ndarray, pairs: np.ndarray, level: float) -> bool:
    """Whether mix ``a`` matches onto mix ``b`` at ``level`` (max flow): site pair ``(x, y)`` carries as
    many replicas as it has device pairs at or below ``level`` (``pairs[x, y, :]``, ascending)."""
    sites = a.shape[0]
    capacity = np.zeros((sites, sites), np.int64)
    for i in range(sites):
        for j in range(sites):
            k = 0
            while k < pairs.shape[2] and pairs[i, j, k] <= level:
                k += 1
            capacity[i, j] = k
    flow = np.zeros((sites, sites), np.int64)
    left, right = a.copy(), b.copy()
    total, need = 0, a.sum()
    queue = np.empty(2 * sites, np.int64)
    while total < need:
        from_l = np.full(sites, -2, np.int64)  # -1: reached from the source, else the right node
        from_r = np.full(sites, -2, np.int64)
        head = tail = 0
        for i in range(sites):
            if left[i] > 0:
                from_l[i] = -1
                queue[tail] = i
                tail += 1
        found = -1
        while head < tail and found < 0:
            u = queue[head]
            head += 1
            if u < sites:
                for j in range(sites):
                    if from_r[j] == -2 and flow[u, j] < capacity[u, j]:
                        from_r[j] = u
                        if right[j] > 0:
                            found = j
                            break
                        queue[tail] = sites + j
                        tail += 1
            else:
                for i in range(sites):
                    if from_l[i] == -2 and flow[i, u - sites] > 0:
                        from_l[i] = u - sites
                        queue[tail] = i
                        tail += 1
        if found < 0:
            return False
        amount, j = right[found], found
        while True:
            i = from_r[j]
            amount = min(amount, capacity[i, j] - flow[i, j])
            if from_l[i] == -1:
                amount = min(amount, left[i])
                break
            amount = min(amount, flow[i, from_l[i]])
            j = from_l[i]
        right[found] -= amount
        j = found
        while True:
            i = from_r[j]
            flow[i, j] += amount
            if from_l[i] == -1:
                left[i] -= amount
                break
            flow[i, from_l[i]] -= amount
            j = from_l[i]
        total += amount
    return True


@njit(cache=True)
def _mix_edge(a: np.ndarray, b: np.ndarray, pairs: np.ndarray, levels: np.ndarray) -> float:
    lo, hi = 0, levels.shape[0] - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _transport_fits(a, b, pairs, levels[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(levels[lo])


@njit(cache=True)
def _crossings(a: np.ndarray, b: np.ndarray) -> int:
    """Replicas an edge from mix ``a`` to mix ``b`` must carry across sites (the rest stay in one)."""
    same = 0
    for s in range(a.shape[0]):
        same += min(a[s], b[s])
    return a.sum() - same


@njit(cache=True)
def _scored_edge(a: np.ndarray, b: np.ndarray, pairs: np.ndarray, levels: np.ndarray, cross: float) -> float:
    """`_mix_edge` + ``cross`` x `_crossings`: an edge as the search scores it."""
    return _mix_edge(a, b, pairs, levels) + cross * _crossings(a, b)


@njit(cache=True)
def _memo_edge(
    a: np.ndarray,
    b: np.ndarray,
    pairs: np.ndarray,
    levels: np.ndarray,
    cross: float,
    keys: np.ndarray,
    values: np.ndarray,
) -> float:
    """`_mix_edge` + ``cross`` x `_crossings` through a direct-mapped memo (``keys[slot]`` = the two
    mixes, ``values[slot]`` their edge, negative when empty; the slot count a power of two): computed
    once per mix pair while it stays in its slot."""
    sites = a.shape[0]
    code = np.uint64(14695981039346656037)
    for s in range(sites):
        code = (code ^ np.uint64(a[s])) * np.uint64(1099511628211)
    for s in range(sites):
        code = (code ^ np.uint64(b[s] + 65536)) * np.uint64(1099511628211)
    slot = np.int64(code >> np.uint64(20)) & (values.shape[0] - 1)
    if values[slot] >= 0.0:
        same = True
        for s in range(sites):
            if keys[slot, s] != a[s] or keys[slot, sites + s] != b[s]:
                same = False
                break
        if same:
            return values[slot]
    value = _scored_edge(a, b, pairs, levels, cross)
    keys[slot, :sites] = a
    keys[slot, sites:] = b
    values[slot] = value
    return value


@njit(cache=True)
def _estimate(
    counts: np.ndarray, order: np.ndarray, dp: np.ndarray, pairs: np.ndarray, levels: np.ndarray, cross: float
) -> float:
    """The estimate (+ ``cross`` x the crossings of its edges: the search's tie-break)."""
    top = 0.0
    for g in range(counts.shape[0]):
        top = max(top, _mix_dp(counts[g], dp))
    path = 0.0
    for i in range(order.shape[0] - 1):
        path += _scored_edge(counts[order[i]], counts[order[i + 1]], pairs, levels, cross)
    return top + path


@njit(cache=True)
def _boundary(counts: np.ndarray, order: np.ndarray, trial: np.ndarray, changed: np.ndarray) -> bool:
    """Move a run boundary: of two neighbours in the order, one takes the other's mix, and what it gave
    up is traded back into the groups on its own side, nearest first, one unit per group in turn (a
    unit of a site it had for one of a site it took, Tokyo-like fillers included). A run then spreads
    its cities over one group less and the neighbouring run over one more: what no chain of unit moves
    does without climbing (session 17)."""
    stages, sites = counts.shape
    i = np.random.randint(0, stages - 1)
    if np.random.random() < 0.5:
        g, h, first, stop, step = order[i], order[i + 1], i - 1, -1, -1
    else:
        g, h, first, stop, step = order[i + 1], order[i], i + 2, stages, 1
    excess = counts[g] - counts[h]
    units = 0
    for s in range(sites):
        units += max(excess[s], 0)
    if units == 0:
        return False
    trial[g, :] = counts[h]
    changed[g] = True
    gave = np.empty(units, np.int64)  # sites g gave up (to place), sites it took (to take back)
    took = np.empty(units, np.int64)
    a = b = 0
    for s in range(sites):
        for _ in range(max(excess[s], 0)):
            gave[a] = s
            a += 1
        for _ in range(max(-excess[s], 0)):
            took[b] = s
            b += 1
    side = np.empty(stages, np.int64)
    width = 0
    k = first
    while k != stop:
        side[width] = order[k]
        width += 1
        k += step
    cursor = 0
    for u in range(units):
        s, t = gave[u], took[u]
        target = -1
        for tries in range(width):
            q = side[(cursor + tries) % width]
            if trial[q, t] > 0:
                target, cursor = q, (cursor + tries + 1) % width
                break
        if target < 0:  # nobody on that side holds the site: the first group anywhere that does
            for q in range(stages):
                if q != g and trial[q, t] > 0:
                    target = q
                    break
        if target < 0:
            return False
        trial[target, t] -= 1
        trial[target, s] += 1
        changed[target] = True
    return True


@njit(cache=True)
def _propose(
    counts: np.ndarray, order: np.ndarray, trial: np.ndarray, trial_order: np.ndarray, changed: np.ndarray
) -> bool:
    stages, sites = counts.shape
    trial[:, :] = counts
    trial_order[:] = order
    changed[:] = False
    if np.random.random() < BOUNDARY_SHARE:
        return _boundary(counts, order, trial, changed)
    draw = np.random.random()
    if draw < ORDER_SHARE:
        lo, hi = np.random.randint(0, stages), np.random.randint(0, stages)
        if lo > hi:
            lo, hi = hi, lo
        if lo == hi:
            return False
        trial_order[lo : hi + 1] = order[lo : hi + 1][::-1]
        return True
    x, y = np.random.randint(0, sites), np.random.randint(0, sites)
    if x == y:
        return False
    length = np.random.randint(1, stages // 2 + 1) if draw > 1.0 - LANE_SHARE else 1
    p, q = np.random.randint(0, stages - length + 1), np.random.randint(0, stages - length + 1)
    if abs(p - q) < length:
        return False
    for k in range(length):
        g, h = order[p + k], order[q + k]
        if trial[g, x] <= 0 or trial[h, y] <= 0:
            return False
        trial[g, x] -= 1
        trial[g, y] += 1
        trial[h, y] -= 1
        trial[h, x] += 1
        changed[g] = changed[h] = True
    return True


@njit(cache=True)
def _anneal(
    counts: np.ndarray,
    order: np.ndarray,
    dp: np.ndarray,
    pairs: np.ndarray,
    levels: np.ndarray,
    steps: int,
    t_start: float,
    t_end: float,
    best: np.ndarray,
    best_counts: np.ndarray,
    best_order: np.ndarray,
    deltas: np.ndarray,
    cross: float,
    keys: np.ndarray,
    values: np.ndarray,
    slope: float,
) -> None:
    """``steps`` proposals cooling from ``t_start`` to ``t_end``; ``best[0]`` and the best layout are
    updated in place. With ``deltas`` non-empty, nothing is applied: it receives the energy deltas of
    that many proposals (to calibrate a temperature). Edges go through the memo ``keys``/``values``
    (`_memo_edge`), shared by every annealer of a search."""
    stages = counts.shape[0]
    group_dp = np.empty(stages)
    for g in range(stages):
        group_dp[g] = _mix_dp(counts[g], dp)
    edges = np.full((stages, stages), -1.0)
    path = 0.0
    for i in range(stages - 1):
        g, h = order[i], order[i + 1]
        edges[g, h] = edges[h, g] = _memo_edge(counts[g], counts[h], pairs, levels, cross, keys, values)
        path += edges[g, h]
    energy = group_dp.max() + path + slope * group_dp.mean()
    trial, trial_order = counts.copy(), order.copy()
    changed = np.zeros(stages, np.bool_)
    trial_dp, trial_edges = group_dp.copy(), np.empty(stages - 1)
    sampled = 0
    calibrating = deltas.shape[0] > 0
    step = 0
    while (sampled < deltas.shape[0]) if calibrating else (step < steps):
        temperature = t_start * (t_end / t_start) ** (step / max(steps, 1))
        step += 1
        if not _propose(counts, order, trial, trial_order, changed):
            continue
        top = total = 0.0
        for g in range(stages):
            trial_dp[g] = _mix_dp(trial[g], dp) if changed[g] else group_dp[g]
            top = max(top, trial_dp[g])
            total += trial_dp[g]
        trial_path = 0.0
        for i in range(stages - 1):
            g, h = trial_order[i], trial_order[i + 1]
            if changed[g] or changed[h] or edges[g, h] < 0.0:
                trial_edges[i] = _memo_edge(trial[g], trial[h], pairs, levels, cross, keys, values)
            else:
                trial_edges[i] = edges[g, h]
            trial_path += trial_edges[i]
        trial_energy = top + trial_path + slope * total / stages
        if calibrating:
            deltas[sampled] = trial_energy - energy
            sampled += 1
            continue
        if trial_energy <= energy or np.random.random() < math.exp((energy - trial_energy) / temperature):
            counts[:, :] = trial
            order[:] = trial_order
            energy = trial_energy
            for g in range(stages):
                if changed[g]:
                    group_dp[g] = trial_dp[g]
                    edges[g, :] = -1.0
                    edges[:, g] = -1.0
            for i in range(stages - 1):
                edges[order[i], order[i + 1]] = edges[order[i + 1], order[i]] = trial_edges[i]
            if top + trial_path < best[0]:
                best[0] = top + trial_path
                best_counts[:, :] = counts
                best_order[:] = order


@njit(cache=True)
def _seed(value: int) -> None:
    np.random.seed(value)


def mix_estimate(model: CostModel, labels: np.ndarray, placement: Placement, order: tuple[int, ...]) -> float:
    """The site-level estimate of ``placement`` along ``order`` (for diagnostics and tests)."""
    dp, pairs, levels = site_model(model, labels)
    sites = dp.shape[0]
    counts = np.array([np.bincount(labels[list(g)], minlength=sites) for g in placement], dtype=np.int64)
    return float(_estimate(counts, np.asarray(order, dtype=np.int64), dp, pairs, levels, 0.0))


def site_model(model: CostModel, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dp, pairs, levels)`` of the site-level model: the all-reduce weights per site pair, the
    pipeline levels per site pair and pair count (`_transport_fits`), and every distinct level."""
    replicas = model.workload.num_replicas
    dp, _ = site_matrices(model, labels, DP_QUANTILE)
    if MATCHED:
        pairs = matched_levels(model, labels, replicas)
    else:
        pairs = np.repeat(site_matrices(model, labels)[1][:, :, None], replicas, axis=2)
    return dp, pairs, np.unique(pairs[np.isfinite(pairs)])


@dataclass
class _MixAnnealer:
    counts: np.ndarray
    order: np.ndarray
    best: np.ndarray
    best_counts: np.ndarray
    best_order: np.ndarray


def search_mixes(
    model: CostModel,
    labels: np.ndarray,
    rng: np.random.Generator,
    *,
    span_s: float,
    racers: int,
    clock: Callable[[], float],
    out_of_time: Callable[[], bool],
    hot: float = 1.0,
    cool_to: float = 1e-3,
    slope: float = MIX_SLOPE,
    on_best: Callable[[np.ndarray], None] | None = None,
) -> list[MixCandidate]:
    """``racers`` mix annealers (a power of two) from random mixes on one cooling schedule from ``hot`` to
    ``cool_to`` x the calibrated temperature over ``span_s`` CPU seconds (energy: the estimate + ``slope`` x
    the mean group all-reduce), the better half going on at 1/2, 3/4, ... of it (`dtfm_race.race_rounds`);
    every annealer's best, best first.

    ``on_best`` gets a copy of the best mix so far (``counts``) at most every `NOTE_EVERY_S` CPU seconds,
    when it improved (the caller scores a filling of it: the search stays anytime while mixes are
    searched)."""
    from ravnest_p2p.planning.dtfm_race import race_rounds

    workload = model.workload
    stages = workload.num_stages
    dp, pairs, levels = site_model(model, labels)
    sites = dp.shape[0]
    keys, values = np.zeros((MEMO_SLOTS, 2 * sites), np.int32), np.full(MEMO_SLOTS, -1.0)
    _seed(int(rng.integers(2**31)))
    annealers = []
    for _ in range(racers):
        start = random_placement(workload, rng)
        counts = np.array([np.bincount(labels[list(g)], minlength=sites) for g in start], dtype=np.int64)
        order = np.arange(stages, dtype=np.int64)
        best = np.array([_estimate(counts, order, dp, pairs, levels, CROSS_WEIGHT)])
        annealers.append(_MixAnnealer(counts, order, best, counts.copy(), order.copy()))
    first_one = annealers[0]
    deltas = np.empty(300)
    _anneal(
        first_one.counts, first_one.order, dp, pairs, levels, 0, 1.0, 1.0, first_one.best,
        first_one.best_counts, first_one.best_order, deltas, CROSS_WEIGHT, keys, values, slope,
    )  # fmt: skip
    first = hot * uphill_temperature(deltas, float(first_one.best[0]))
    last = first * cool_to / hot
    rounds = race_rounds(racers)
    units = sum(length * count for _, length, count in rounds)
    alive = list(annealers)
    chunk = 2_000
    reported, last_report = np.inf, clock()
    for lo, length, count in rounds:
        if out_of_time():
            break
        alive = sorted(alive, key=lambda a: float(a.best[0]))[:count]
        span = max(span_s * length * count / units, 1e-6)
        opened = clock()
        done = pace = 0.0
        while done < 1.0 and not out_of_time():
            tick = clock()
            at, ahead = lo + length * done, lo + length * min(1.0, done + pace)
            t_from, t_to = first * (last / first) ** at, first * (last / first) ** ahead
            for a in alive:
                _anneal(
                    a.counts, a.order, dp, pairs, levels, chunk, t_from, t_to, a.best, a.best_counts,
                    a.best_order, np.empty(0), CROSS_WEIGHT, keys, values, slope,
                )  # fmt: skip
            spent = (clock() - tick) / len(alive)
            chunk = int(min(max(chunk * _CHUNK_S / max(spent, 1e-4), 200), 500_000))
            pace = spent * len(alive) / span
            done = (clock() - opened) / span
            if on_best is not None and clock() - last_report >= NOTE_EVERY_S:
                leader = min(annealers, key=lambda a: float(a.best[0]))
                if leader.best[0] < reported:
                    reported, last_report = float(leader.best[0]), clock()
                    on_best(leader.best_counts.copy())
    found = []
    for a in annealers:
        estimate = float(_estimate(a.best_counts, a.best_order, dp, pairs, levels, 0.0))
        found.append(MixCandidate(estimate, a.best_counts, a.best_order, float(a.best[0])))
    found.sort(key=lambda c: c.score)
    return found


def fill_mix(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> Placement:
    """A placement with ``counts[g, s]`` random devices of site ``s`` in group ``g``."""
    pools = [list(rng.permutation(np.flatnonzero(labels == s))) for s in range(counts.shape[1])]
    groups = []
    for row in counts:
        groups.append(tuple(sorted(int(pools[s].pop()) for s in range(len(row)) for _ in range(int(row[s])))))
    return tuple(groups)
