"""The annealer's compound move for doubled sites and its order-screened swaps (`dtfm_anneal`)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import CostModel, Workload, dtfm_anneal, random_placement
from ravnest_p2p.planning.dtfm_anneal import SwapState, anneal
from ravnest_p2p.planning.dtfm_paths import path_length
from ravnest_p2p.planning.dtfm_site_moves import even_out_site

# 4 machines x 4 devices, 4 stages x 4 replicas: inside a machine 100 Gbit/s, between machines 25
# (DT-FM's datacenter_on_demand, scaled down). The best layout runs one pipeline per machine.
MACHINE = np.repeat(np.arange(4), 4)
SITES = [[int(d) for d in np.flatnonzero(m == MACHINE)] for m in range(4)]


def _machines_model() -> CostModel:
    same = MACHINE[:, None] == MACHINE[None, :]
    return CostModel(
        np.zeros((16, 16)), np.where(same, 100e9, 25e9) / 8, Workload(4, 4, c_dp_bytes=1.3e9, c_pp_bytes=1e9)
    )


def _doubled_layout() -> tuple[tuple[int, ...], ...]:
    """Machine 2 twice in two groups, machine 3 twice in the other two: one edge can never align."""
    m0, m1, m2, m3 = (list(s) for s in SITES)
    return (
        (m0[0], m1[0], m2[0], m2[1]),
        (m0[1], m1[1], m2[2], m2[3]),
        (m0[2], m1[2], m3[0], m3[1]),
        (m0[3], m1[3], m3[2], m3[3]),
    )


def _site_of() -> np.ndarray:
    return MACHINE.copy()


def _even(state: SwapState) -> bool:
    return all(sorted(MACHINE[list(g)].tolist()) == [0, 1, 2, 3] for g in state.groups)


def test_even_out_site_gives_every_group_one_device_of_the_site() -> None:
    model = _machines_model()
    rng = np.random.default_rng(0)
    state = SwapState(model, _doubled_layout())
    before, cost = state.placement(), state.cost
    assert not even_out_site(state, SITES, _site_of(), rng, threshold=-np.inf)
    assert (state.placement(), state.cost) == (before, cost)  # rejected: undone
    for _ in range(20):  # machines 0 and 1 are already even: only a pick of 2 or 3 moves anything
        if even_out_site(state, SITES, _site_of(), rng, threshold=np.inf):
            break
    assert _even(state)
    model.check(state.placement())
    assert state.cost == pytest.approx(model.cost(state.placement()), rel=1e-12)
    assert state.cost < cost


def _machines8() -> tuple[CostModel, tuple[tuple[int, ...], ...], list[list[int]]]:
    """8 machines x 8 devices, 8 x 8 (datacenter_on_demand at full size), in a doubled layout:
    groups 0-3 hold machine 6 twice and no 7, groups 4-7 the reverse."""
    machine = np.repeat(np.arange(8), 8)
    same = machine[:, None] == machine[None, :]
    model = CostModel(
        np.zeros((64, 64)), np.where(same, 100e9, 25e9) / 8, Workload(8, 8, c_dp_bytes=1.3e9, c_pp_bytes=1e9)
    )
    sites = [[int(d) for d in np.flatnonzero(machine == m)] for m in range(8)]
    groups = []
    for g in range(8):
        members = [sites[m][g] for m in range(6)]
        doubled = 6 if g < 4 else 7
        members += [sites[doubled][2 * (g % 4)], sites[doubled][2 * (g % 4) + 1]]
        groups.append(tuple(sorted(members)))
    return model, tuple(groups), sites


@pytest.mark.parametrize("even_share", [0.5, 0.0])
def test_cool_annealing_leaves_the_doubled_layout_only_with_the_even_move(
    even_share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dtfm_anneal, "_EVEN_SHARE", even_share)
    model, layout, sites = _machines8()
    state = SwapState(model, layout)
    cost = state.cost
    rng = np.random.default_rng(1)
    temperature = 1e-4 * cost  # too cool to climb over a second misaligned edge swap by swap
    anneal(
        state, np.arange(64), rng, start_temperature=temperature, end_temperature=temperature,
        progress=lambda done: done / 1000, on_best=lambda s: None, sites=sites,
    )  # fmt: skip
    assert (state.cost < cost * 0.9) == (even_share > 0)


def test_propose_along_passes_exactly_the_swaps_accepted_along_the_current_order() -> None:
    rng = np.random.default_rng(3)
    n, stages, replicas = 64, 16, 4
    latency = rng.lognormal(-3, 0.5, (n, n))
    bandwidth = rng.lognormal(20, 0.6, (n, n))
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(latency, 0.0)
    model = CostModel(latency, bandwidth, Workload(stages, replicas, c_dp_bytes=5e8, c_pp_bytes=1e8))
    state = SwapState(model, random_placement(model.workload, rng), soft=False)
    passed = screened = 0
    for u, v in itertools.islice(((int(x), int(y)) for x, y in rng.integers(n, size=(400, 2))), 400):
        if state.group_of[u] == state.group_of[v]:
            continue
        full = state.propose(u, v)
        hard = state.hard.copy()
        hard[full.a, :] = hard[:, full.a] = full.row_a
        hard[full.b, :] = hard[:, full.b] = full.row_b
        dp = state.dp.copy()
        dp[full.a], dp[full.b] = full.dp_a, full.dp_b
        along = float(dp.max()) + path_length(hard, state.order) + state.dp_weight * float(dp.mean())
        ceiling = state.energy + float(rng.exponential(0.02 * state.energy))
        screened_swap = state.propose_along(u, v, ceiling)
        if along > ceiling * (1 + 1e-12):
            assert screened_swap is None
            screened += 1
        elif along < ceiling * (1 - 1e-12):
            assert screened_swap is not None
            assert (screened_swap.cost, screened_swap.order) == (full.cost, full.order)
            assert screened_swap.energy <= ceiling
            state.apply(screened_swap)
            passed += 1
    assert passed > 0
    assert screened > 0
