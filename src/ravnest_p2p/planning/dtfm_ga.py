"""The hybrid genetic algorithm of the DT-FM paper, kept as ``hybrid_search(method="ga")``.

Yuan et al. 2022, sec. 3.3, in the style of Bui & Moon's balanced graph partitioning: a population of
partitions, a crossover that keeps whole groups of one parent, and a swap local search on every child,
here with the plateau surrogate and site mutations described in `dtfm_search` (which explains why the
annealer replaced it as the default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement, max_matching_size, open_loop_tsp, random_placement
from ravnest_p2p.planning.dtfm_structure import twin_classes

__all__ = ["ga_search"]

_SOFT_GAP = 0.5
_DP_MEAN_WEIGHT = 0.1


class _Scorer:
    """Memoised (cost, surrogate) of placements, keyed by twin-class multisets."""

    def __init__(self, model: CostModel):
        self.model = model
        self.classes = twin_classes(model)
        self.evaluations = 0
        self._group: dict[tuple[int, ...], float] = {}
        self._edge: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, float]] = {}
        self._total: dict[tuple[tuple[int, ...], ...], tuple[float, float]] = {}

    def group_key(self, group: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted(int(self.classes[d]) for d in group))

    def key(self, groups: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(sorted(self.group_key(g) for g in groups))

    def _group_dp(self, key: tuple[int, ...], group: Sequence[int]) -> float:
        value = self._group.get(key)
        if value is None:
            value = self._group[key] = self.model.group_dp_cost(group)
        return value

    def _edge_pair(
        self, ka: tuple[int, ...], a: Sequence[int], kb: tuple[int, ...], b: Sequence[int]
    ) -> tuple[float, float]:
        key = (ka, kb) if ka <= kb else (kb, ka)
        value = self._edge.get(key)
        if value is None:
            sub = self.model.pp_weights.take(a, 0).take(b, 1)
            hard = self.model.edge_cost(tuple(sorted(a)), tuple(sorted(b)))
            below = sub[sub < hard]
            soft = hard
            if below.size:
                prev = float(below.max())
                matched = max_matching_size(sub, prev)
                soft = hard - (hard - prev) * _SOFT_GAP * matched / sub.shape[0]
            value = self._edge[key] = (hard, soft)
        return value

    def score(self, groups: Sequence[Sequence[int]]) -> tuple[float, float]:
        keys = [self.group_key(g) for g in groups]
        total_key = tuple(sorted(keys))
        cached = self._total.get(total_key)
        if cached is not None:
            return cached
        self.evaluations += 1
        dp = [self._group_dp(k, g) for k, g in zip(keys, groups, strict=True)]
        m = len(groups)
        hard, soft = np.zeros((m, m)), np.zeros((m, m))
        for i in range(m):
            for j in range(i + 1, m):
                h, s = self._edge_pair(keys[i], groups[i], keys[j], groups[j])
                hard[i, j] = hard[j, i] = h
                soft[i, j] = soft[j, i] = s
        cost = max(dp) + open_loop_tsp(hard)[0]
        surrogate = max(dp) + _DP_MEAN_WEIGHT * float(np.mean(dp)) + open_loop_tsp(soft)[0]
        result = self._total[total_key] = (cost, surrogate)
        if len(self._total) > 500_000:
            self._total.clear()
        return result


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    eps = 1e-9 * max(1.0, abs(b[0]))
    return a[0] < b[0] - eps or (a[0] <= b[0] + eps and a[1] < b[1] - eps)


def _local_search(
    groups: list[list[int]], scorer: _Scorer, rng: np.random.Generator, out_of_time: Callable[[], bool]
) -> tuple[float, float]:
    """First-improvement swaps between groups over distinct twin classes until a local optimum."""
    current = scorer.score(groups)
    classes = scorer.classes
    improved = True
    while improved and not out_of_time():
        improved = False
        moves = []
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                reps_a = {int(classes[d]): i for i, d in enumerate(groups[a])}
                reps_b = {int(classes[d]): i for i, d in enumerate(groups[b])}
                moves += [
                    (a, ia, b, ib) for ca, ia in reps_a.items() for cb, ib in reps_b.items() if ca != cb
                ]
        for index in rng.permutation(len(moves)):
            a, ia, b, ib = moves[int(index)]
            groups[a][ia], groups[b][ib] = groups[b][ib], groups[a][ia]
            trial = scorer.score(groups)
            if _better(trial, current):
                current, improved = trial, True
                break
            groups[a][ia], groups[b][ib] = groups[b][ib], groups[a][ia]
    return current


def _crossover(p1: Placement, p2: Placement, rng: np.random.Generator, n: int) -> list[list[int]]:
    """Keep a random half of parent 1's groups, then parent 2's groups minus used devices, then fill."""
    k = len(p1)
    size = len(p1[0])
    child: list[list[int]] = [list(p1[i]) for i in rng.permutation(k)[: k // 2]]
    used = {d for g in child for d in g}
    for parent_group in p2:
        if len(child) == k:
            break
        rest = [d for d in parent_group if d not in used]
        if len(rest) * 2 >= size:
            child.append(rest)
            used.update(rest)
    free = [d for d in rng.permutation(n).tolist() if d not in used]
    while len(child) < k:
        child.append([])
    for group in child:
        while len(group) < size:
            group.append(free.pop())
    return child


def _mutate(groups: list[list[int]], sites: Sequence[Sequence[int]], rng: np.random.Generator) -> None:
    """A random swap kick, or a site move: gather a site into one group, or spread it across groups."""
    where = {d: (gi, i) for gi, g in enumerate(groups) for i, d in enumerate(g)}

    def swap(u: int, v: int) -> None:
        (ga, ia), (gb, ib) = where[u], where[v]
        groups[ga][ia], groups[gb][ib] = v, u
        where[u], where[v] = (gb, ib), (ga, ia)

    choice = rng.integers(3)
    big_sites = [s for s in sites if len(s) > 1]
    if choice == 0 or not big_sites:
        for _ in range(int(rng.integers(2, 5))):
            u, v = (int(x) for x in rng.choice(len(where), 2, replace=False))
            swap(u, v)
        return
    site = [int(d) for d in big_sites[int(rng.integers(len(big_sites)))]]
    if choice == 1:  # gather into the group already holding most of the site
        counts = np.bincount([where[d][0] for d in site], minlength=len(groups))
        target = int(np.argmax(counts))
        outsiders = [d for d in groups[target] if d not in set(site)]
        movers = [d for d in site if where[d][0] != target]
        for u, v in zip(movers, outsiders, strict=False):
            swap(u, v)
    else:  # spread: one device of the site per group where possible
        for gi, d in zip(rng.permutation(len(groups)).tolist(), site, strict=False):
            if where[d][0] != gi:
                candidates = [x for x in groups[gi] if x not in set(site)]
                if candidates:
                    swap(d, candidates[int(rng.integers(len(candidates)))])


def ga_search(
    model: CostModel,
    starts: list[Placement],
    sites: Sequence[Sequence[int]],
    rng: np.random.Generator,
    population_size: int,
    max_generations: int,
    out_of_time: Callable[[], bool],
    note: Callable[[tuple[float, float]], None],
) -> tuple[Placement, int, int, float]:
    """Run the GA; returns ``(best placement, generations, evaluations, best starting cost)``."""
    starts = list(starts)
    scorer = _Scorer(model)
    n = model.num_devices
    while len(starts) < population_size:
        starts.append(random_placement(model.workload, rng))
    population: list[tuple[tuple[float, float], Placement]] = []
    initial_best = min(scorer.score(p)[0] for p in starts)
    note((initial_best, 0.0))
    for start in starts:
        groups = [list(g) for g in start]
        score = _local_search(groups, scorer, rng, out_of_time)
        note(score)
        population.append((score, tuple(tuple(sorted(g)) for g in groups)))
        if out_of_time():
            break
    seen = {scorer.key(p) for _, p in population}
    generations = 0
    while generations < max_generations and not out_of_time():
        generations += 1
        picks = rng.choice(len(population), size=min(4, len(population)), replace=False)
        ranked = sorted(picks.tolist(), key=lambda i: population[i][0])
        p1, p2 = population[ranked[0]][1], population[ranked[-1 if len(ranked) < 2 else 1]][1]
        child = _crossover(p1, p2, rng, n) if rng.random() < 0.5 else [list(g) for g in p1]
        _mutate(child, sites, rng)
        score = _local_search(child, scorer, rng, out_of_time)
        note(score)
        key = scorer.key(child)
        worst = max(range(len(population)), key=lambda i: population[i][0])
        if key not in seen and _better(score, population[worst][0]):
            seen.discard(scorer.key(population[worst][1]))
            seen.add(key)
            population[worst] = (score, tuple(tuple(sorted(g)) for g in child))
    best = min(population, key=lambda item: item[0])[1]
    return best, generations, scorer.evaluations, initial_best
