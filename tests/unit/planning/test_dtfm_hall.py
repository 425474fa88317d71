"""The batched bottleneck matching (Hall's condition) against the one-at-a-time exact matching."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_p2p.planning import CostModel, Workload, random_placement
from ravnest_p2p.planning.dtfm import bottleneck_matching
from ravnest_p2p.planning.dtfm_anneal import SwapState
from ravnest_p2p.planning.dtfm_hall import HALL_LIMIT, batch_bottleneck


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 8])
def test_batch_equals_exact_matching_with_and_without_ties(size: int) -> None:
    rng = np.random.default_rng(size)
    weights = rng.lognormal(0.0, 1.0, (300, size, size))
    weights[:100] = np.round(weights[:100])  # many ties
    weights[100:120] = 1.0  # all equal
    expected = [bottleneck_matching(w)[0] for w in weights]
    assert batch_bottleneck(weights).tolist() == expected  # the same floats, not just close


def test_batch_refuses_large_groups_and_accepts_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="at most"):
        batch_bottleneck(np.ones((2, HALL_LIMIT + 1, HALL_LIMIT + 1)))
    assert batch_bottleneck(np.ones((0, 4, 4))).shape == (0,)


def _model(seed: int, stages: int, replicas: int) -> CostModel:
    rng = np.random.default_rng(seed)
    n = stages * replicas
    latency = rng.lognormal(-3.0, 0.5, (n, n))
    bandwidth = rng.lognormal(19.0, 0.5, (n, n))
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(latency, 0.0)
    return CostModel(latency, bandwidth, Workload(stages, replicas, c_dp_bytes=5e8, c_pp_bytes=1e8))


def test_batched_swaps_cost_what_a_fresh_model_says() -> None:
    model = _model(3, 6, 8)
    rng = np.random.default_rng(3)
    state = SwapState(model, random_placement(model.workload, rng), soft=False)
    n = model.num_devices
    for _ in range(30):
        u, v = (int(x) for x in rng.integers(n, size=2))
        if state.group_of[u] == state.group_of[v]:
            continue
        state.apply(state.propose(u, v))
        fresh = _model(3, 6, 8)  # same network, empty edge cache: one-at-a-time matchings
        assert state.cost == fresh.cost(state.placement())


def test_edge_costs_survive_a_full_cache() -> None:
    model = _model(4, 3, 4)
    a, b = (0, 1, 2, 3), (4, 5, 6, 7)
    first = model.edge_costs([(a, b)])
    model._edge_cache.update({((i,), (i + 1,)): 0.0 for i in range(200_001)})
    assert model.edge_costs([(a, b), (b, (8, 9, 10, 11))])[0] == first[0]


def _sites_model(seed: int, stages: int, replicas: int) -> CostModel:
    rng = np.random.default_rng(seed)
    n = stages * replicas
    site = rng.integers(0, 3, n)
    between = rng.lognormal(-3.0, 0.5, (3, 3))
    latency = (between + between.T)[site][:, site]  # a function of the two sites: twins
    np.fill_diagonal(latency, 0.0)
    return CostModel(
        latency, np.full((n, n), 1e9), Workload(stages, replicas, c_dp_bytes=5e8, c_pp_bytes=1e8)
    )


def test_swaps_on_twins_cost_what_a_fresh_model_says() -> None:
    model = _sites_model(5, 5, 4)
    rng = np.random.default_rng(5)
    state = SwapState(model, random_placement(model.workload, rng), soft=True)
    assert state._twins is not None  # the classes decide every entry: costs are shared per multiset
    n = model.num_devices
    for _ in range(40):
        u, v = (int(x) for x in rng.integers(n, size=2))
        if state.group_of[u] == state.group_of[v]:
            continue
        proposal = state.propose(u, v)
        if rng.random() < 0.5:
            state.apply(proposal)
            fresh = _sites_model(5, 5, 4)
            assert state.cost == fresh.cost(state.placement())
            assert list(state.dp) == [fresh.group_dp_cost(g) for g in state.groups]
