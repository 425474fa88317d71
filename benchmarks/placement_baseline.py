"""A plain simulated annealer for DT-FM placements: the baseline the placement benchmark compares against.

Random start, random swaps of two devices in different groups, every candidate scored in full with
`CostModel.cost` (pair costs memoised by the model, as for our search), Metropolis acceptance on the
true cost, geometric cooling over the CPU budget from the temperature that accepts the median uphill
move half the time down to 1/1000 of it. No surrogate, no structure, no incremental evaluation.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement, random_placement

__all__ = ["plain_anneal"]


def _swap(groups: list[list[int]], rng: np.random.Generator) -> list[list[int]]:
    a, b = (int(x) for x in rng.choice(len(groups), 2, replace=False))
    i, j = int(rng.integers(len(groups[a]))), int(rng.integers(len(groups[b])))
    out = [list(g) for g in groups]
    out[a][i], out[b][j] = out[b][j], out[a][i]
    return out


def _key(groups: list[list[int]]) -> Placement:
    return tuple(tuple(sorted(g)) for g in groups)


def plain_anneal(
    model: CostModel,
    cpu_budget_s: float,
    seed: int,
    clock: Callable[[], float] = time.process_time,
) -> tuple[Placement, float, list[tuple[float, float]]]:
    """Returns ``(best placement, its cost, [(cpu_s, best cost so far), ...])``."""
    rng = np.random.default_rng(seed)
    started = clock()
    groups = [list(g) for g in random_placement(model.workload, rng)]
    cost = model.cost(_key(groups))
    best, best_cost = _key(groups), cost
    curve = [(clock() - started, cost)]
    uphill = [d for d in (model.cost(_key(_swap(groups, rng))) - cost for _ in range(60)) if d > 0]
    t0 = float(np.median(uphill)) / math.log(2.0) if uphill else 1e-3 * cost
    while True:
        elapsed = clock() - started
        if elapsed >= cpu_budget_s:
            break
        temperature = t0 * 1e-3 ** (elapsed / cpu_budget_s)
        trial = _swap(groups, rng)
        trial_cost = model.cost(_key(trial))
        delta = trial_cost - cost
        if delta <= 0 or rng.random() < math.exp(-delta / temperature):
            groups, cost = trial, trial_cost
            if cost < best_cost - 1e-12 * best_cost:
                best, best_cost = _key(groups), cost
                curve.append((clock() - started, cost))
    return best, best_cost, curve
