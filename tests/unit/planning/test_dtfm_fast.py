"""Incremental swap evaluation, the path heuristic, and the annealing search's anytime behaviour."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import (
    CostModel,
    SearchConfig,
    Workload,
    hybrid_search,
    open_loop_tsp,
    random_placement,
)
from ravnest_p2p.planning.dtfm_anneal import SwapState
from ravnest_p2p.planning.dtfm_paths import improve_path, path_length, shortest_path
from tests.unit.planning.helpers import noisy_dtfm_model as _noisy_model


@pytest.mark.parametrize(
    ("seed", "stages", "replicas", "soft"), [(0, 4, 3, True), (1, 6, 2, False), (2, 5, 4, True)]
)
def test_incremental_swap_cost_equals_full_evaluation(
    seed: int, stages: int, replicas: int, soft: bool
) -> None:
    model = _noisy_model(seed, stages, replicas)
    rng = np.random.default_rng(seed)
    state = SwapState(model, random_placement(model.workload, rng), soft=soft)
    assert state.cost == model.cost(state.placement())
    n = model.num_devices
    for _ in range(40):
        u, v = (int(x) for x in rng.integers(n, size=2))
        if state.group_of[u] == state.group_of[v]:
            continue
        before = state.placement()
        proposal = state.propose(u, v)
        assert state.placement() == before  # proposing changes nothing
        swapped = [list(g) for g in before]
        a, b = int(state.group_of[u]), int(state.group_of[v])
        swapped[a][swapped[a].index(u)] = v
        swapped[b][swapped[b].index(v)] = u
        expected = model.cost(tuple(tuple(sorted(g)) for g in swapped))
        assert proposal.cost == expected  # bit-identical: same arithmetic, exact path
        if rng.random() < 0.5:
            state.apply(proposal)
            assert state.cost == model.cost(state.placement())
            assert list(state.dp) == [model.group_dp_cost(g) for g in state.groups]


def test_swap_within_one_group_is_refused() -> None:
    model = _noisy_model(3, 3, 2)
    state = SwapState(model, ((0, 1), (2, 3), (4, 5)))
    with pytest.raises(ValueError, match="two different groups"):
        state.propose(0, 1)


@pytest.mark.parametrize("seed", range(30))
def test_path_heuristic_matches_exact_on_small_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 8))
    d = rng.random((n, n))
    d = d + d.T
    np.fill_diagonal(d, 0.0)
    length, order = shortest_path(d, None, exact_limit=0)  # force the heuristic
    assert sorted(order) == list(range(n))
    assert length == pytest.approx(path_length(d, order), abs=1e-12)
    assert length == pytest.approx(open_loop_tsp(d)[0], abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_path_heuristic_never_worse_than_its_start(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(13, 25))
    points = rng.random((n, 2))
    d = np.linalg.norm(points[:, None] - points[None, :], axis=2) * rng.lognormal(0, 0.2, (n, n))
    d = (d + d.T) / 2
    identity = path_length(d, range(n))
    start = list(rng.permutation(n))
    improved, order = improve_path(d, start)
    assert improved <= path_length(d, start) + 1e-12
    assert sorted(order) == list(range(n))
    assert shortest_path(d)[0] <= identity + 1e-12


def test_heuristic_equals_exact_held_karp_on_twelve_nodes_mostly() -> None:
    # Not a guarantee (a local optimum), but on random metric-ish instances of 12 nodes the multi-start
    # 2-opt + Or-opt finds the exact optimum almost always; a regression would show here.
    hits = 0
    for seed in range(8):
        rng = np.random.default_rng(200 + seed)
        points = rng.random((12, 2))
        d = np.linalg.norm(points[:, None] - points[None, :], axis=2)
        hits += shortest_path(d, None, exact_limit=0)[0] <= open_loop_tsp(d)[0] + 1e-12
    assert hits >= 7


def _deterministic_search(model: CostModel, seed: int):
    config = SearchConfig(
        cpu_budget_s=1e9, max_generations=3, seed=seed, anneal_moves=150, structure_seeds=False
    )
    return hybrid_search(model, config, clock=lambda: 0.0)


def test_anytime_curve_is_monotone_and_ends_at_the_result() -> None:
    model = _noisy_model(5, 4, 4)
    result = _deterministic_search(model, seed=1)
    times = [t for t, _ in result.curve]
    costs = [c for _, c in result.curve]
    assert times == sorted(times)
    assert all(b < a for a, b in itertools.pairwise(costs))
    assert result.cost == pytest.approx(costs[-1], rel=1e-12)
    assert result.cost <= result.initial_best_cost
    assert result.cost == model.cost(result.placement)
    model.check(result.placement)


def test_search_is_deterministic_for_a_seed() -> None:
    model = _noisy_model(6, 4, 3)
    first, second = _deterministic_search(model, 4), _deterministic_search(model, 4)
    assert first.placement == second.placement
    assert first.cost == second.cost
    assert first.evaluations == second.evaluations


def test_beyond_the_exact_limit_the_reported_cost_is_exact() -> None:
    model = _noisy_model(7, 14, 2)  # 14 groups: the loop uses the path heuristic
    config = SearchConfig(cpu_budget_s=1e9, max_generations=1, anneal_moves=60, tsp_exact_limit=12)
    result = hybrid_search(model, config, clock=lambda: 0.0)
    assert result.cost == pytest.approx(model.cost(result.placement), rel=1e-12)


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown search method"):
        hybrid_search(_noisy_model(0, 2, 2), SearchConfig(method="magic"))


def test_ga_method_still_runs() -> None:
    model = _noisy_model(8, 3, 2)
    result = hybrid_search(
        model, SearchConfig(method="ga", cpu_budget_s=1e9, max_generations=3), clock=lambda: 0.0
    )
    model.check(result.placement)
    assert result.cost == pytest.approx(model.cost(result.placement), rel=1e-12)


def test_site_move_is_undone_when_rejected_and_consistent_when_accepted() -> None:
    from ravnest_p2p.planning.dtfm_site_moves import spread_site

    # 4 stages x 4 replicas; devices 0-3 and 4-7 are two machines, the rest lone instances
    machine = np.array([0] * 4 + [1] * 4 + list(range(2, 10)))
    same = machine[:, None] == machine[None, :]
    model = CostModel(
        np.where(same, 0.0, 0.001), np.where(same, 1e11, 1e9), Workload(4, 4, c_dp_bytes=1e8, c_pp_bytes=1e8)
    )
    rng = np.random.default_rng(0)
    sites = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for _ in range(10):
        state = SwapState(model, random_placement(model.workload, rng))
        before, cost = state.placement(), state.cost
        assert not spread_site(state, sites, rng, threshold=-np.inf)
        assert state.placement() == before
        assert state.cost == cost
        spread_site(state, sites, rng, threshold=np.inf)
        model.check(state.placement())
        assert state.cost == model.cost(state.placement())


@pytest.mark.parametrize(("stages", "replicas"), [(6, 3), (4, 10)])  # 10: screened by edge bounds first
def test_propose_below_rejects_only_swaps_above_the_ceiling(stages: int, replicas: int) -> None:
    model = _noisy_model(4, stages, replicas)
    rng = np.random.default_rng(4)
    state = SwapState(model, random_placement(model.workload, rng), soft=False)
    n = model.num_devices
    screened = 0
    for _ in range(200):
        u, v = (int(x) for x in rng.integers(n, size=2))
        if state.group_of[u] == state.group_of[v]:
            continue
        full = state.propose(u, v)
        ceiling = state.energy + float(rng.exponential(0.05 * state.energy))
        below = state.propose_below(u, v, ceiling)
        if below is None:
            screened += 1
            assert full.energy > ceiling
        else:
            assert (below.cost, below.energy, below.order) == (full.cost, full.energy, full.order)
        if full.energy <= ceiling:
            state.apply(full)
    assert screened > 0


def test_search_stops_at_the_target_cost() -> None:
    model = _noisy_model(9, 4, 3)
    config = SearchConfig(cpu_budget_s=1e9, max_generations=3, anneal_moves=20, target_cost=float("inf"))
    result = hybrid_search(model, config, clock=lambda: 0.0)
    assert result.generations == 0  # the first start already meets the target
    unreached = hybrid_search(
        model, SearchConfig(**{**config.__dict__, "target_cost": 0.0}), clock=lambda: 0.0
    )
    assert unreached.generations == 3
