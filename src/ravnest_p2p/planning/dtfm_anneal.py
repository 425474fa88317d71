"""Simulated annealing over DT-FM placements with incremental swap evaluation (see `dtfm_search`).

A swap of two devices between groups ``A`` and ``B`` changes only: the all-reduce cost of ``A`` and
``B``, the ``2 (D_PP - 1) - 1`` pipeline edges touching them, and the path over the groups. `SwapState`
recomputes exactly those (group costs and edges with the same arithmetic as `dtfm.CostModel`, edges
memoised per pair of groups by the model; on networks whose twin classes decide every link, per pair
of class multisets, shared by every state of the model; without the slope, groups of <= 8 devices
get all changed edges in one batched call, `dtfm_hall`) and re-solves the path (exact up to
``exact_limit`` groups, warm-started 2-opt + Or-opt beyond, `dtfm_paths`). For up to ``exact_limit``
groups its ``cost`` is bit-identical to `CostModel.cost` of the same placement (the unit tests check
this after random swaps).

The annealer minimises an *energy*: the cost plus two small slopes for the plateaus the maxima create
(as in the GA's surrogate): ``0.1 x`` the mean group all-reduce time, and on each pipeline edge of the
current path a discount of half the gap to the next cheaper weight times the *squared* fraction of pairs
already matchable below the bottleneck (squared so that gathering co-located devices on one edge beats
splitting them over two; linear, ``datacenter_spot`` settled on two half-aligned blocks). The best
placement is tracked by true cost only.

On networks with sites (co-located devices), 10% of the moves are compound: spread one site over
consecutive groups of the current path, one device per group, accepted or undone as a whole. Lining a
machine up as consecutive stages of one pipeline is what the best ``datacenter_spot`` layout does, and
single swaps cannot climb to it: an edge stays as slow as its slowest pair until every replica's pair
across it is co-located. Measured without the structure-aware starts: 6.57 s (1.50x the best known,
every seed, GA or annealing with swaps only) -> 4.389 s (the best known) after 2.6 s CPU. Half of the
compound moves are `dtfm_site_moves.even_out_site` instead: it gives each group of a stretch one device
of a site that some groups hold twice and others lack, sending back a device doubled in the receiving group
(session 12: without the structure starts ``datacenter_on_demand`` sat at 1.26x on some seeds, one
misaligned edge short of the best; now every seed reaches the best known in < 0.5 s CPU).

On noisy networks (no twins) 90% of the swaps are screened along the current stage order
(`SwapState.propose_along`): only the two groups' all-reduce costs and the <= 4 pipeline edges of the
current path that touch them are solved, and a swap is fully scored (every changed edge, the path) only
if it passes there; the other 10% go through the exact `propose_below`, so swaps that pay only through
a new stage order still happen. Per proposal (same seeded anneal, both trees at once, load ~6): 16x8
451 -> 191 us, 8x8 268 -> 160 us, 8x16 324 -> 179 us (wide groups: the <= 4 edges at their lower
bounds first).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ravnest_p2p.planning.dtfm import (
    CostModel,
    Placement,
    matching_lower_bound,
    max_matching_size,
    open_loop_tsp,
)
from ravnest_p2p.planning.dtfm_hall import HALL_LIMIT
from ravnest_p2p.planning.dtfm_paths import EXACT_TSP_LIMIT, shortest_path
from ravnest_p2p.planning.dtfm_site_moves import even_out_site, spread_site
from ravnest_p2p.planning.dtfm_structure import deciding_twins

__all__ = ["AnnealOutcome", "SwapState", "anneal", "uphill_temperature"]

_DP_MEAN_WEIGHT = 0.1
# Noisy networks (no twins) have no plateaus for the mean to tilt, and the 0.1 x mean all-reduce time
# (~2% of a hard case's cost) is not what the search is asked to minimise: the energy is the true cost
# there. Measured (session 12, 60 s CPU, ratio to the 600 s references, all runs of both versions
# that day): 16x8 mean 1.066 without the slope (6 runs, 1.016-1.153) vs 1.063 with it (7 runs,
# 1.017-1.092); 8x8 1.018 (4) vs 1.014 (6); 8x16 1.041 (5) vs 1.040 (5): no difference the spread
# between runs of one version (3-14%) can show.
_NOISY_DP_MEAN_WEIGHT = 0.0
_SOFT_GAP = 0.5
_SOFT_CACHE_LIMIT = 200_000
_SITE_MOVE_RATE = 0.1
_EXACT_SHARE = 0.1  # of the swaps on noisy networks: scored exactly (`propose_below`), not along the order
_EVEN_SHARE = 0.5  # of the site moves: `even_out_site` (else `spread_site`)


@dataclass
class _Proposal:
    a: int
    b: int
    group_a: list[int]
    group_b: list[int]
    dp_a: float
    dp_b: float
    row_a: np.ndarray
    row_b: np.ndarray
    gain_a: np.ndarray
    gain_b: np.ndarray
    pp: float
    order: tuple[int, ...]
    cost: float
    energy: float


class SwapState:
    """A placement with its per-group and per-edge costs, updated swap by swap.

    Args:
        model: the cost model.
        placement: the starting partition.
        exact_limit: groups up to which the path is solved exactly.
        soft: include the matching slope in the energy (costs one extra Kuhn run per new edge).
    """

    def __init__(
        self, model: CostModel, placement: Placement, exact_limit: int = EXACT_TSP_LIMIT, soft: bool = True
    ):
        self.model = model
        self.exact_limit = exact_limit
        self.soft = soft
        self._gain_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        self._twins = deciding_twins(model) if soft else None
        self.dp_weight = _DP_MEAN_WEIGHT if soft else _NOISY_DP_MEAN_WEIGHT
        self.groups = [sorted(int(d) for d in g) for g in placement]
        k = len(self.groups)
        self.group_of = np.empty(model.num_devices, dtype=np.int64)
        for gi, g in enumerate(self.groups):
            self.group_of[g] = gi
        self.dp = np.array([self._dp_of(g) for g in self.groups])
        self.hard = np.zeros((k, k))
        self.gain = np.zeros((k, k))
        for i in range(k):
            for j in range(i + 1, k):
                h, s = self._edge(self.groups[i], self.groups[j])
                self.hard[i, j] = self.hard[j, i] = h
                self.gain[i, j] = self.gain[j, i] = s
        self.pp, self.order = shortest_path(self.hard, None, exact_limit)
        # Screen swaps by edge lower bounds first where a matching is expensive (groups too wide to batch).
        self._screen_by_bounds = not soft and k <= exact_limit and len(self.groups[0]) > HALL_LIMIT
        self.cost = float(self.dp.max()) + self.pp
        self.energy = self._energy(self.dp, self.cost, self.gain, self.order)

    def placement(self) -> Placement:
        return tuple(tuple(g) for g in self.groups)

    def _dp_of(self, group: Sequence[int]) -> float:
        if self._twins is None:
            return self.model.group_dp_cost(group)
        key = np.sort(self._twins[list(group)]).tobytes()
        cache: dict[bytes, float] = self.model.memo.setdefault("twin_dp", {})
        value = cache.get(key)
        if value is None:
            value = cache[key] = self.model.group_dp_cost(group)
        return value

    def _edge(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
        """(bottleneck, slope) of the edge between groups a and b; by twin classes if they decide it."""
        if self._twins is None:
            return self._device_edge(a, b)
        ka, kb = np.sort(self._twins[list(a)]).tobytes(), np.sort(self._twins[list(b)]).tobytes()
        key = (ka, kb) if ka <= kb else (kb, ka)
        cache: dict[tuple[bytes, bytes], tuple[float, float]] = self.model.memo.setdefault("twin_edges", {})
        value = cache.get(key)
        if value is None:
            if len(cache) > _SOFT_CACHE_LIMIT:
                cache.clear()
            value = cache[key] = self._device_edge(a, b)
        return value

    def _device_edge(self, a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
        ta, tb = tuple(a), tuple(b)
        hard = self.model.edge_cost(ta, tb)
        if not self.soft:
            return hard, 0.0
        key = (ta, tb) if ta <= tb else (tb, ta)
        cache = self._gain_cache
        if key in cache:
            return hard, cache[key]
        sub = self.model.pp_weights.take(a, 0).take(b, 1)
        below = sub[sub < hard]
        gain = 0.0
        if below.size:
            prev = float(below.max())
            gain = (hard - prev) * _SOFT_GAP * (max_matching_size(sub, prev) / sub.shape[0]) ** 2
        if len(cache) > _SOFT_CACHE_LIMIT:
            cache.clear()
        cache[key] = gain
        return hard, gain

    def _energy(self, dp: np.ndarray, cost: float, gain: np.ndarray, order: Sequence[int]) -> float:
        discount = sum(gain[order[i], order[i + 1]] for i in range(len(order) - 1))
        return cost + self.dp_weight * float(dp.mean()) - float(discount)

    def propose_below(self, u: int, v: int, ceiling: float) -> _Proposal | None:
        """`propose`, or None when the swap's energy is certainly above ``ceiling`` (path not solved).

        Without the matching slope and with the exact path, once the changed pipeline edges are known
        the new path can be shorter than the current one by at most the four largest drops among
        them (a path has at most two edges at each of the two changed groups); when even that lower
        bound puts the energy above ``ceiling`` the swap is rejected without the Held-Karp path.
        Same decisions as comparing ``propose(u, v).energy`` with ``ceiling`` (a relative margin of
        1e-9 sends borderline swaps to the exact path).
        """
        return self._propose(u, v, ceiling)

    def propose_along(self, u: int, v: int, ceiling: float) -> _Proposal | None:
        """`propose` when the swap's energy along the *current* stage order is at most ``ceiling``, else None.

        A heuristic screen (unlike `propose_below`): only the two groups' all-reduce costs and the (at
        most four) pipeline edges of the current path that touch them are solved. The path can only get
        shorter when re-solved, so a swap that passes is accepted with its full proposal; a swap that
        would pass only through a new stage order is rejected (the annealer sends a share of the swaps
        to the exact `propose_below` so such re-routings still happen). On noisy 16 x 8 cases a
        rejected swap costs about 4 matchings instead of 29 and no path search.
        """
        a, b = int(self.group_of[u]), int(self.group_of[v])
        if a == b:
            raise ValueError("a swap needs devices of two different groups")
        group_a = tuple(sorted([d for d in self.groups[a] if d != u] + [v]))
        group_b = tuple(sorted([d for d in self.groups[b] if d != v] + [u]))
        dp_a, dp_b = self._dp_of(group_a), self._dp_of(group_b)
        dp = self.dp.copy()
        dp[a], dp[b] = dp_a, dp_b
        members = {a: group_a, b: group_b}
        order = self.order
        edges = [(x, y) for x, y in itertools.pairwise(order) if x in members or y in members]
        pairs = [
            (members.get(x) or tuple(self.groups[x]), members.get(y) or tuple(self.groups[y]))
            for x, y in edges
        ]
        base = float(dp.max()) + self.dp_weight * float(dp.mean())
        old = sum(float(self.hard[x, y]) for x, y in edges)
        if len(group_a) > HALL_LIMIT:  # wide groups: first with every edge at its lower bound, no matching
            weights = self.model.pp_weights
            low = 0.0
            for ga, gb in pairs:
                low += matching_lower_bound(weights.take(ga, 0).take(gb, 1))
            if base + self.pp - old + low > ceiling:
                return None
        pp = self.pp - old + sum(self.model.edge_costs(pairs))
        if base + pp > ceiling:
            return None
        return self._propose(u, v, None)

    def propose(self, u: int, v: int) -> _Proposal:
        """Costs after swapping devices ``u`` and ``v`` (in different groups); the state is unchanged."""
        proposal = self._propose(u, v, None)
        assert proposal is not None
        return proposal

    def _propose(self, u: int, v: int, ceiling: float | None) -> _Proposal | None:
        a, b = int(self.group_of[u]), int(self.group_of[v])
        if a == b:
            raise ValueError("a swap needs devices of two different groups")
        group_a = sorted([d for d in self.groups[a] if d != u] + [v])
        group_b = sorted([d for d in self.groups[b] if d != v] + [u])
        dp = self.dp.copy()
        dp[a] = self._dp_of(group_a)
        dp[b] = self._dp_of(group_b)
        hard, gain = self.hard.copy(), self.gain.copy()
        others = [o for o in range(len(self.groups)) if o not in (a, b)]
        if (
            ceiling is not None
            and self._screen_by_bounds
            and self._bound_above(a, b, group_a, group_b, dp, ceiling)
        ):
            return None
        if self.soft:
            for other in others:
                for gi, members in ((a, group_a), (b, group_b)):
                    h, s = self._edge(members, self.groups[other])
                    hard[gi, other] = hard[other, gi] = h
                    gain[gi, other] = gain[other, gi] = s
            h, s = self._edge(group_a, group_b)
            hard[a, b] = hard[b, a] = h
            gain[a, b] = gain[b, a] = s
        else:  # no slope: all the changed edges in one call (batched for small groups, `dtfm_hall`)
            ta, tb = tuple(group_a), tuple(group_b)
            rest = [tuple(self.groups[o]) for o in others]
            values = self.model.edge_costs([(ta, g) for g in rest] + [(tb, g) for g in rest] + [(ta, tb)])
            hard[a, others] = hard[others, a] = values[: len(others)]
            hard[b, others] = hard[others, b] = values[len(others) : 2 * len(others)]
            hard[a, b] = hard[b, a] = values[-1]
        if ceiling is not None and not self.soft:
            drops = np.concatenate([self.hard[a] - hard[a], self.hard[b] - hard[b]])
            drops[len(self.groups) + a] = 0.0  # the a-b edge, counted once
            if self._path_floor(drops, dp) > ceiling + 1e-9 * max(1.0, abs(ceiling)):
                return None
        pp, order = shortest_path(hard, self.order, self.exact_limit)
        cost = float(dp.max()) + pp
        return _Proposal(
            a, b, group_a, group_b, float(dp[a]), float(dp[b]), hard[a].copy(), hard[b].copy(),
            gain[a].copy(), gain[b].copy(), pp, order, cost, self._energy(dp, cost, gain, order),
        )  # fmt: skip

    def _path_floor(self, drops: np.ndarray, dp: np.ndarray) -> float:
        """Energy floor of a swap whose pipeline edges fall by at most ``drops`` (one entry per changed edge).

        A path has at most two edges at each of the two changed groups, so the new shortest path is at
        least the current one minus the four largest drops. Exact when the current path is (Held-Karp,
        up to ``exact_limit`` groups); above it the current path is a local optimum and the floor a
        screen: it rejects swaps that only a path better than every earlier local search could accept.
        """
        largest = np.partition(drops, len(drops) - 4)[-4:] if len(drops) > 4 else drops
        floor = self.pp - float(np.clip(largest, 0.0, None).sum())
        return floor + float(dp.max()) + self.dp_weight * float(dp.mean())

    def _bound_above(
        self, a: int, b: int, group_a: list[int], group_b: list[int], dp: np.ndarray, ceiling: float
    ) -> bool:
        """Is the swap's energy certainly above ``ceiling``? Solves as few matchings as it can.

        Every bottleneck matching is at least its largest row or column minimum, so the exact path over
        the edge matrix with the changed edges at those bounds is a lower bound of the new path. Until
        that bound decides: solve the matchings of the changed edges the bounding path uses, and
        re-solve the path (a path using exact edges only is the new exact path: nothing to screen).
        Worth it where a matching is expensive (groups too wide for `dtfm_hall`): a Held-Karp path at
        <= ``exact_limit`` groups costs a few matchings.
        """
        weights = self.model.pp_weights
        bounds = self.hard.copy()
        others = [o for o in range(len(self.groups)) if o not in (a, b)]
        cols = np.concatenate([self.groups[o] for o in others])
        r = len(group_a)
        members = {a: tuple(group_a), b: tuple(group_b)}
        for gi in (a, b):
            sub = weights.take(members[gi], 0).take(cols, 1).reshape(r, len(others), r)
            low = np.maximum(sub.min(axis=2).max(axis=0), sub.min(axis=0).max(axis=1))
            bounds[gi, others] = bounds[others, gi] = low
        bounds[a, b] = bounds[b, a] = matching_lower_bound(weights.take(group_a, 0).take(group_b, 1))
        base = float(dp.max()) + self.dp_weight * float(dp.mean())
        margin = ceiling + 1e-9 * max(1.0, abs(ceiling))
        solved: set[tuple[int, int]] = set()
        while True:
            length, order = open_loop_tsp(bounds)
            if base + length > margin:
                return True
            todo = [
                (x, y)
                for x, y in itertools.pairwise(order)
                if (x in members or y in members) and (min(x, y), max(x, y)) not in solved
            ]
            if not todo:
                return False
            for x, y in todo:
                gx = members.get(x) or tuple(self.groups[x])
                gy = members.get(y) or tuple(self.groups[y])
                bounds[x, y] = bounds[y, x] = self.model.edge_cost(gx, gy)
                solved.add((min(x, y), max(x, y)))

    def apply(self, p: _Proposal) -> None:
        """Commit a proposal returned by `propose` on this state."""
        self.groups[p.a], self.groups[p.b] = p.group_a, p.group_b
        self.group_of[p.group_a] = p.a
        self.group_of[p.group_b] = p.b
        self.dp[p.a], self.dp[p.b] = p.dp_a, p.dp_b
        for gi, row, gains in ((p.a, p.row_a, p.gain_a), (p.b, p.row_b, p.gain_b)):
            self.hard[gi, :] = row
            self.hard[:, gi] = row
            self.gain[gi, :] = gains
            self.gain[:, gi] = gains
        self.pp, self.order, self.cost, self.energy = p.pp, p.order, p.cost, p.energy


@dataclass
class AnnealOutcome:
    """Best placement one annealing run saw, by (path-heuristic) cost, and what it spent."""

    placement: Placement
    cost: float
    moves: int


def _pick_swap(state: SwapState, classes: np.ndarray, rng: np.random.Generator) -> tuple[int, int] | None:
    n = len(state.group_of)
    for _ in range(20):
        u, v = int(rng.integers(n)), int(rng.integers(n))
        if state.group_of[u] != state.group_of[v] and classes[u] != classes[v]:
            return u, v
    return None


def calibrate_temperature(state: SwapState, classes: np.ndarray, rng: np.random.Generator) -> float:
    """Temperature at which the median uphill move of ``state`` is accepted half the time."""
    deltas = []
    for _ in range(60):
        pick = _pick_swap(state, classes, rng)
        if pick is None:
            break
        deltas.append(state.propose(*pick).energy - state.energy)
    return uphill_temperature(np.array(deltas), state.cost)


def uphill_temperature(deltas: np.ndarray, cost: float) -> float:
    """The temperature at which the median uphill move of ``deltas`` (energy changes of proposed moves) is
    accepted half the time; 1/1000 of ``cost`` if none goes uphill."""
    uphill = deltas[deltas > 0]
    if not len(uphill):
        return 1e-3 * max(cost, 1e-9)
    return float(np.median(uphill)) / math.log(2.0)


def anneal(
    state: SwapState,
    classes: np.ndarray,
    rng: np.random.Generator,
    *,
    start_temperature: float,
    end_temperature: float,
    progress: Callable[[int], float],
    on_best: Callable[[SwapState], None],
    sites: Sequence[Sequence[int]] = (),
) -> AnnealOutcome:
    """One geometric-cooling run of swap proposals on ``state`` (mutated in place).

    Args:
        progress: called before every proposal with the number made so far; returns the fraction of
            the run done (the temperature follows it), ``>= 1`` ends the run.
        on_best: called whenever the state reaches a cost lower than any earlier in this run.
        sites: co-located device sets; when given, a share of the moves spread one site over
            consecutive groups of the current path (one device each), accepted or undone as a whole.
    """
    best_cost, best = state.cost, state.placement()
    ratio = end_temperature / start_temperature
    done = 0
    along = not state.soft  # noisy networks: most swaps screened along the order (`propose_along`)
    big_sites = [list(site) for site in sites if len(site) > 1]
    site_of = np.full(len(state.group_of), -1)
    for index, site in enumerate(big_sites):
        site_of[site] = index
    while True:
        fraction = progress(done)
        if fraction >= 1.0:
            break
        if big_sites and rng.random() < _SITE_MOVE_RATE:
            done += 1
            temperature = start_temperature * ratio**fraction
            threshold = -temperature * math.log(max(rng.random(), 1e-300))
            if rng.random() < _EVEN_SHARE:
                moved = even_out_site(state, big_sites, site_of, rng, threshold)
            else:
                moved = spread_site(state, big_sites, rng, threshold)
            if moved and state.cost < best_cost - 1e-12 * max(1.0, best_cost):
                best_cost, best = state.cost, state.placement()
                on_best(state)
            continue
        pick = _pick_swap(state, classes, rng)
        if pick is None:
            break
        done += 1
        temperature = start_temperature * ratio**fraction
        threshold = -temperature * math.log(max(rng.random(), 1e-300))
        if along and rng.random() >= _EXACT_SHARE:
            proposal = state.propose_along(*pick, state.energy + threshold)
        else:
            proposal = state.propose_below(*pick, state.energy + threshold)
        if proposal is not None and proposal.energy - state.energy <= threshold:
            state.apply(proposal)
            if state.cost < best_cost - 1e-12 * max(1.0, best_cost):
                best_cost, best = state.cost, state.placement()
                on_best(state)
    return AnnealOutcome(best, best_cost, done)
