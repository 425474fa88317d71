from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import (
    CostModel,
    SearchConfig,
    Workload,
    bottleneck_matching,
    hybrid_search,
    open_loop_tsp,
    random_placement,
)
from ravnest_p2p.planning.dtfm import max_matching_size


def _tiny_model(latency_s: float) -> CostModel:
    """4 devices, 2 stages x 2 replicas, c_dp = 2 B, c_pp = 1 B: weights are 2 * (alpha + 1 / beta)."""
    beta = np.array(
        [
            [1.0, 1.0, 2.0, 4.0],
            [1.0, 1.0, 4.0, 2.0],
            [2.0, 4.0, 1.0, 1.0],
            [4.0, 2.0, 1.0, 1.0],
        ]
    )
    alpha = np.full((4, 4), latency_s)
    np.fill_diagonal(alpha, 0.0)
    return CostModel(alpha, beta, Workload(num_stages=2, num_replicas=2, c_dp_bytes=2, c_pp_bytes=1))


@pytest.mark.parametrize(
    ("placement", "dp", "pp"),
    [
        # DP: 2 (alpha + 2 / (2 beta)) per peer; PP: bottleneck of 2 (alpha + 1 / beta) over the matching.
        (((0, 1), (2, 3)), 2.0, 0.5),  # DP 2/1 both groups; match 0-3, 1-2 at beta 4
        (((0, 3), (1, 2)), 0.5, 1.0),  # DP 2/4; match 0-2, 3-1 at beta 2
        (((0, 2), (1, 3)), 1.0, 0.5),  # DP 2/2; match 0-3, 2-1 at beta 4
    ],
)
@pytest.mark.parametrize("latency_s", [0.0, 0.1])
def test_cost_matches_hand_computed_values(placement, dp: float, pp: float, latency_s: float) -> None:
    model = _tiny_model(latency_s)
    assert model.dp_cost(placement) == pytest.approx(dp + 2 * latency_s)
    assert model.pp_cost(placement)[0] == pytest.approx(pp + 2 * latency_s)
    assert model.cost(placement) == pytest.approx(dp + pp + 4 * latency_s)


def test_three_stage_pipeline_cost_is_the_shortest_open_path() -> None:
    beta = np.array([[1.0, 1.0, 2.0], [1.0, 1.0, 4.0], [2.0, 4.0, 1.0]])
    model = CostModel(
        np.zeros((3, 3)), beta, Workload(num_stages=3, num_replicas=1, c_dp_bytes=5, c_pp_bytes=1)
    )
    placement = ((0,), (1,), (2,))
    assert model.dp_cost(placement) == 0.0  # one replica: nothing to all-reduce
    length, order = model.pp_cost(placement)
    assert length == pytest.approx(1.0 + 0.5)  # 0 -(beta 2)- 2 -(beta 4)- 1; edge 0-1 (cost 2) unused
    assert order in ((0, 2, 1), (1, 2, 0))


@pytest.mark.parametrize("seed", range(60))
def test_bottleneck_matching_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    weights = rng.integers(0, 6, (n, n)).astype(float) if seed % 2 else rng.random((n, n))
    value, col_of_row = bottleneck_matching(weights)
    expected = min(max(weights[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
    assert value == expected
    assert sorted(col_of_row) == list(range(n))
    assert max(weights[i, col_of_row[i]] for i in range(n)) == value


@pytest.mark.parametrize("seed", range(20))
def test_bottleneck_matching_equals_the_lowest_perfect_threshold_on_larger_matrices(seed: int) -> None:
    # Beyond brute force: the lowest level at which a (cold, independent) maximum matching is perfect.
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(7, 17))
    weights = rng.integers(0, 9, (n, n)).astype(float) if seed % 2 else rng.lognormal(0, 0.4, (n, n))
    value, col_of_row = bottleneck_matching(weights)
    expected = next(t for t in np.unique(weights) if max_matching_size(weights, float(t)) == n)
    assert value == expected
    assert sorted(col_of_row) == list(range(n))
    assert max(weights[i, col_of_row[i]] for i in range(n)) == value


@pytest.mark.parametrize("seed", range(40))
def test_open_loop_tsp_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    distances = rng.random((n, n))
    if seed % 2:
        distances = distances + distances.T
    length, order = open_loop_tsp(distances)
    expected = min(
        sum(distances[p[i], p[i + 1]] for i in range(n - 1)) for p in itertools.permutations(range(n))
    )
    assert length == pytest.approx(expected, abs=1e-12)
    assert sorted(order) == list(range(n))
    assert sum(distances[order[i], order[i + 1]] for i in range(n - 1)) == pytest.approx(length, abs=1e-12)


def test_random_placement_is_a_partition() -> None:
    workload = Workload(num_stages=4, num_replicas=3, c_dp_bytes=1, c_pp_bytes=1)
    model = CostModel(np.zeros((12, 12)), np.ones((12, 12)), workload)
    placement = random_placement(workload, np.random.default_rng(0))
    model.check(placement)
    with pytest.raises(ValueError, match="every device"):
        model.check(((0, 1, 2), (0, 4, 5), (6, 7, 8), (9, 10, 11)))


def _all_partitions(items: list[int], size: int):
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = [x for x in rest if x not in others]
        for tail in _all_partitions(remaining, size):
            yield ((first, *others), *tail)


@pytest.mark.parametrize("seed", range(4))
def test_search_finds_the_exhaustive_optimum_on_small_networks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 8  # 4 stages x 2 replicas: 105 placements
    sites = rng.integers(0, 3, n)
    latency = np.where(sites[:, None] == sites[None, :], 0.001, rng.uniform(0.01, 0.05, (n, n)))
    bandwidth = np.where(sites[:, None] == sites[None, :], 1e9, rng.uniform(1e7, 1e8, (n, n)))
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    model = CostModel(latency, bandwidth, Workload(4, 2, c_dp_bytes=5e7, c_pp_bytes=1e7))
    best = min(model.cost(p) for p in _all_partitions(list(range(n)), 2))
    result = hybrid_search(
        model, SearchConfig(cpu_budget_s=5.0, max_generations=4, seed=seed, anneal_moves=50)
    )
    model.check(result.placement)
    assert result.cost == pytest.approx(best, rel=1e-9)
    assert result.cost == pytest.approx(model.cost(result.placement), rel=1e-12)


def test_search_reports_when_it_found_its_best() -> None:
    ticks = iter(range(10_000))
    model = _tiny_model(0.0)
    config = SearchConfig(cpu_budget_s=1e9, max_generations=3, structure_seeds=False, anneal_moves=100)
    result = hybrid_search(model, config, clock=lambda: next(ticks))
    assert result.cost == pytest.approx(1.5)
    assert 0 < result.best_found_cpu_s <= result.cpu_s
