"""The compiled annealer over placements and stage orders (`dtfm_kernel`) and its use by the search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import CostModel, SearchConfig, dtfm_race, hybrid_search, random_placement
from ravnest_p2p.planning.dtfm import bottleneck_matching
from ravnest_p2p.planning.dtfm_bottleneck import bottleneck
from ravnest_p2p.planning.dtfm_kernel import KernelState, seed
from ravnest_p2p.planning.dtfm_race import race_rounds, racer_count, slope_at
from tests.unit.planning.helpers import Ticks
from tests.unit.planning.helpers import noisy_dtfm_model as _noisy_model


def _cost_along(model: CostModel, members: np.ndarray, order: np.ndarray) -> float:
    placement = tuple(tuple(sorted(int(d) for d in row)) for row in members)
    path = sum(model.edge_cost(placement[a], placement[b]) for a, b in itertools.pairwise(order.tolist()))
    return model.dp_cost(placement) + path


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 16])
def test_bottleneck_equals_the_reference_matching_with_and_without_ties(size: int) -> None:
    rng = np.random.default_rng(size)
    for trial in range(150):
        weights = rng.random((2 * size, 2 * size))
        if trial % 3 == 0:
            weights = np.round(weights * 4) / 4  # many ties
        rows = rng.permutation(2 * size)[:size].astype(np.int64)
        cols = rng.permutation(2 * size)[:size].astype(np.int64)
        assert bottleneck(weights, rows, cols) == bottleneck_matching(weights[np.ix_(rows, cols)])[0]


@pytest.mark.parametrize(
    ("stages", "replicas", "slope", "power"),
    [(4, 3, 0.0, 1.0), (6, 2, 1.0, 1.0), (5, 4, 0.0, 1.0), (3, 8, 1.0, 1.0), (4, 4, 1.0, 4.0)],
)
def test_kernel_cost_is_the_cost_along_its_order_after_many_moves(
    stages: int, replicas: int, slope: float, power: float
) -> None:
    """The slope on the mean all-reduce cost steers acceptance only: the tracked costs stay true."""
    model = _noisy_model(stages * 10 + replicas, stages, replicas)
    rng = np.random.default_rng(0)
    start = random_placement(model.workload, rng)
    state = KernelState(
        model.pp_weights, model.dp_weights, start, tuple(range(stages)), dp_slope=slope, dp_power=power
    )
    assert state.cost == pytest.approx(_cost_along(model, state.members, state.order), rel=1e-12)
    seed(3)
    for temperature in (1.0, 0.1, 1e-3):  # hot: most moves accepted; cold: most refused
        state.run(400, temperature, temperature, 0.2)
        assert sorted(state.members.ravel().tolist()) == list(range(stages * replicas))
        assert sorted(state.order.tolist()) == list(range(stages))
        assert state.cost == pytest.approx(_cost_along(model, state.members, state.order), rel=1e-9)
        assert state.best_cost <= state.cost + 1e-12
        assert state.best_cost == pytest.approx(
            _cost_along(model, state.best_members, state.best_order), rel=1e-9
        )
    # the cost along an order bounds the exact cost (optimal stage order) from above
    assert model.cost(state.best_placement()) <= state.best_cost + 1e-9


def _random_state(model: CostModel, seed_value: int) -> KernelState:
    """A kernel state from a seeded random placement along the identity stage order."""
    start = random_placement(model.workload, np.random.default_rng(seed_value))
    return KernelState(model.pp_weights, model.dp_weights, start, tuple(range(model.workload.num_stages)))


def test_order_moves_alone_keep_the_rank_and_the_cost_true() -> None:
    model = _noisy_model(7, 7, 3)
    state = _random_state(model, 7)
    seed(5)
    for temperature in (10.0, 0.1, 1e-4):
        state.run(300, temperature, temperature, 1.0)  # only reversals and relocations
        assert sorted(state.order.tolist()) == list(range(7))
        assert [int(state.rank[g]) for g in state.order] == list(range(7))
        assert state.cost == pytest.approx(_cost_along(model, state.members, state.order), rel=1e-9)


def test_cached_edges_keep_their_blocks_row_minima_for_the_screen() -> None:
    """The swap's screen reads a cached edge's row minima (``[g, h]``) and column minima (``[h, g]``)."""
    model = _noisy_model(8, 5, 4)
    state = _random_state(model, 8)
    mins = state.mins
    seed(9)
    for temperature in (1.0, 0.05, 1e-3):
        state.run(500, temperature, temperature, 0.2)
        for g, h in itertools.product(range(5), repeat=2):
            if g != h and state.cache[g, h] >= 0.0:
                block = model.pp_weights[np.ix_(state.members[g], state.members[h])]
                assert mins[g, h] == pytest.approx(block.min(axis=1))
                assert mins[h, g] == pytest.approx(block.min(axis=0))


def test_swap_deltas_change_nothing() -> None:
    model = _noisy_model(1, 4, 4)
    state = _random_state(model, 1)
    before = (state.members.copy(), state.order.copy(), state.cost)
    deltas = state.swap_deltas(200)
    assert (deltas > 0).any()
    assert (deltas < 0).any()
    assert (state.members == before[0]).all()
    assert (state.order == before[1]).all()
    assert state.cost == before[2]


def test_same_seed_same_moves_same_result() -> None:
    model = _noisy_model(2, 5, 3)
    start = random_placement(model.workload, np.random.default_rng(2))
    outcomes = []
    for _ in range(2):
        state = KernelState(model.pp_weights, model.dp_weights, start, tuple(range(5)))
        seed(11)
        state.run(2_000, 1.0, 1e-3, 0.1)
        outcomes.append((state.best_placement(), state.best_cost))
    assert outcomes[0] == outcomes[1]


def test_compiled_search_improves_on_its_start_and_reports_the_exact_cost() -> None:
    model = _noisy_model(4, 6, 4)
    config = SearchConfig(cpu_budget_s=2.0, seed=5, mixes_first=False)  # the plain race
    result = hybrid_search(model, config, clock=Ticks(0.02))
    model.check(result.placement)
    assert result.cost == pytest.approx(model.cost(result.placement), rel=1e-12)
    assert result.cost < result.initial_best_cost
    assert result.evaluations > 1_000
    assert result.generations >= 2
    costs = [c for _, c in result.curve]
    assert all(b < a for a, b in itertools.pairwise(costs))
    assert result.cost <= costs[-1] + 1e-9  # the curve holds upper bounds along the annealed order
    again = hybrid_search(model, config, clock=Ticks(0.02))
    assert again.placement == result.placement


def test_compiled_search_is_at_least_as_good_as_the_python_annealer_here() -> None:
    model = _noisy_model(6, 8, 4)
    compiled = hybrid_search(
        model, SearchConfig(cpu_budget_s=2.0, seed=1, mixes_first=False), clock=Ticks(0.02)
    )
    python = hybrid_search(model, SearchConfig(cpu_budget_s=2.0, seed=1, compiled=False), clock=Ticks(0.02))
    assert compiled.evaluations > python.evaluations
    assert compiled.cost <= python.cost * 1.001


def test_race_rounds_halve_the_annealers_and_cover_the_cooling_once() -> None:
    assert race_rounds(1) == [(0.0, 1.0, 1)]
    assert race_rounds(4) == [(0.0, 0.5, 4), (0.5, 0.25, 2), (0.75, 0.25, 1)]
    for racers in (2, 8, 16):
        rounds = race_rounds(racers)
        assert sum(length for _, length, _ in rounds) == pytest.approx(1.0)
        assert [count for _, _, count in rounds] == [racers >> k for k in range(len(rounds))]
    # early halvings: at a tenth of the cooling, then at its doubles
    assert race_rounds(4, 0.1) == [(0.0, 0.1, 4), (0.1, 0.1, 2), (0.2, 0.8, 1)]
    assert race_rounds(1, 0.1) == [(0.0, 1.0, 1)]
    with pytest.raises(ValueError, match="cannot halve"):
        race_rounds(4, 0.5)  # the second halving would come at the end of the cooling


def test_racers_leave_each_surviving_annealer_its_share_of_proposals() -> None:
    # the session-13 paces at 60 s CPU: 8x8 ~66M proposals, 16x8 ~52M, 8x16 ~28M
    assert racer_count(66e6, 64) == 16
    assert racer_count(52e6, 128) == 4
    assert racer_count(28e6, 128) == 2
    assert racer_count(1e3, 128) == 1


def test_the_slope_falls_geometrically_from_hot_to_cool() -> None:
    assert slope_at(0.0, 2.0, 0.5) == pytest.approx(2.0)
    assert slope_at(1.0, 2.0, 0.5) == pytest.approx(0.5)
    assert slope_at(0.5, 2.0, 0.5) == pytest.approx(1.0)  # the geometric mean
    values = [slope_at(k / 10, 2.0, 0.5) for k in range(11)]
    assert all(b < a for a, b in itertools.pairwise(values))
    assert slope_at(0.3, 1.0, 1.0) == 1.0
    assert slope_at(0.25, 1.0, 0.0) == pytest.approx(0.75)  # no geometric path to 0: linear


def test_a_slope_changed_between_runs_steers_acceptance_and_keeps_the_cost_true() -> None:
    model = _noisy_model(7, 5, 4)
    start = random_placement(model.workload, np.random.default_rng(3))
    state = KernelState(model.pp_weights, model.dp_weights, start, tuple(range(5)), dp_slope=2.0)
    seed(9)
    steep = state.swap_deltas(300)
    state.set_slope(0.0)
    seed(9)
    flat = state.swap_deltas(300)  # the same swaps (same seed, nothing applied), priced without the slope
    assert not np.allclose(steep, flat)
    seed(4)
    for slope in (2.0, 1.0, 0.5):
        state.set_slope(slope)
        state.run(500, 0.05, 0.01, 0.1)
        assert state.cost == pytest.approx(_cost_along(model, state.members, state.order), rel=1e-9)
        assert state.best_cost == pytest.approx(
            _cost_along(model, state.best_members, state.best_order), rel=1e-9
        )


def test_the_race_lowers_its_slope_from_hot_to_cool_over_the_cooling(monkeypatch: pytest.MonkeyPatch) -> None:
    slopes: list[float] = []
    original = KernelState.set_slope

    def spy(self: KernelState, dp_slope: float) -> None:
        slopes.append(dp_slope)
        original(self, dp_slope)

    monkeypatch.setattr(KernelState, "set_slope", spy)
    config = SearchConfig(cpu_budget_s=2.0, seed=2, mixes_first=False)  # the plain race (a mix's refine: 1.0)
    hybrid_search(_noisy_model(5, 6, 4), config, clock=Ticks(0.02))
    hot, cool = dtfm_race.DP_SLOPE, dtfm_race.DP_SLOPE * dtfm_race.SLOPE_END
    assert hot > cool
    assert len(slopes) > 10
    assert slopes[0] == pytest.approx(hot, rel=0.05)
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(slopes))
    assert cool <= slopes[-1] < slope_at(0.5, hot, cool)  # past half of the cooling when the budget ends
