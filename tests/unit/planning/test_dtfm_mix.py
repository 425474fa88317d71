"""Site mixes first (`dtfm_mix`): sites from the matrix, the site-level model, the mix search, the fill."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from benchmarks.placement_cases import make_case

from ravnest_p2p.planning import (
    CostModel,
    SearchConfig,
    Workload,
    dtfm_mix,
    dtfm_mixes_first,
    dtfm_race,
    hybrid_search,
    random_placement,
)
from ravnest_p2p.planning.dtfm import bottleneck_matching
from ravnest_p2p.planning.dtfm_kernel import KernelState, seed
from ravnest_p2p.planning.dtfm_mix import (
    MixCandidate,
    _boundary,
    _crossings,
    _memo_edge,
    _mix_edge,
    _seed,
    fill_mix,
    mix_estimate,
    search_mixes,
)
from ravnest_p2p.planning.dtfm_race import calibrate, race
from ravnest_p2p.planning.dtfm_sites import _k_levels, find_cities, matched_levels, site_matrices
from tests.unit.planning.helpers import Ticks


def _site_model(
    sizes: tuple[int, ...], stages: int, replicas: int, seed_: int, noise: float
) -> tuple[CostModel, np.ndarray]:
    """Devices in sites of ``sizes``: site-pair RTT and bandwidth, times lognormal per-pair ``noise``."""
    rng = np.random.default_rng(seed_)
    site = np.repeat(np.arange(len(sizes)), sizes)
    k, n = len(sizes), int(sum(sizes))
    rtt = rng.uniform(0.02, 0.2, (k, k))
    gbps = rng.uniform(0.3, 1.2, (k, k))
    rtt, gbps = np.triu(rtt) + np.triu(rtt, 1).T, np.triu(gbps) + np.triu(gbps, 1).T
    np.fill_diagonal(rtt, 0.005)
    np.fill_diagonal(gbps, 2.0)
    pair = np.exp(noise * rng.standard_normal((n, n)))
    pair = np.triu(pair, 1) + np.triu(pair, 1).T + np.eye(n)
    latency = rtt[np.ix_(site, site)] * (pair if noise else 1.0)
    bandwidth = gbps[np.ix_(site, site)] * 1.25e8 * (pair if noise else 1.0)
    np.fill_diagonal(latency, 0.0)
    model = CostModel(latency, bandwidth, Workload(stages, replicas, 650_000_000, 505_732_000))
    model.memo["matrices"] = (latency, bandwidth)
    return model, site


@pytest.mark.parametrize(("stages", "replicas"), [(8, 8), (8, 16), (16, 8)])
def test_the_sites_found_in_the_matrix_are_the_hard_cases_cities(stages: int, replicas: int) -> None:
    case = make_case(stages, replicas, 0)
    labels = find_cities(case.model())
    city = np.repeat(np.arange(len(case.city_sizes)), case.city_sizes)
    assert len(set(zip(labels.tolist(), city.tolist(), strict=True))) == len(set(city.tolist()))
    assert int(labels.max()) + 1 == len(set(city.tolist()))  # one label per city, no city split


def test_sites_do_not_depend_on_the_order_of_the_devices() -> None:
    model, _ = _site_model((9, 7, 12, 4), 4, 8, 1, 0.25)
    perm = np.random.default_rng(2).permutation(model.num_devices)
    latency, bandwidth = model.memo["matrices"]
    shuffled = CostModel(latency[np.ix_(perm, perm)], bandwidth[np.ix_(perm, perm)], model.workload)
    first, second = find_cities(model), find_cities(shuffled)
    together = set(zip(first[perm].tolist(), second.tolist(), strict=True))
    assert len(together) == int(first.max()) + 1 == int(second.max()) + 1


@pytest.mark.parametrize("trial", range(40))
def test_a_mix_edge_is_the_bottleneck_matching_of_its_expanded_sites(trial: int) -> None:
    rng = np.random.default_rng(trial)
    sites, replicas = int(rng.integers(2, 6)), int(rng.integers(1, 9))
    pp = rng.random((sites, sites))
    if trial % 2:
        pp = np.round(pp * 3) / 3  # ties
    pp = (pp + pp.T) / 2
    a = np.bincount(rng.integers(0, sites, replicas), minlength=sites).astype(np.int64)
    b = np.bincount(rng.integers(0, sites, replicas), minlength=sites).astype(np.int64)
    expanded = pp[np.ix_(np.repeat(np.arange(sites), a), np.repeat(np.arange(sites), b))]
    unlimited = np.repeat(pp[:, :, None], replicas, axis=2)  # every site pair: as many pairs as needed
    assert _mix_edge(a, b, unlimited, np.unique(pp)) == bottleneck_matching(expanded)[0]


def test_crossings_count_the_replicas_an_edge_takes_out_of_their_site() -> None:
    a, b = np.array([3, 0, 5, 0]), np.array([1, 2, 5, 0])
    assert _crossings(a, b) == _crossings(b, a) == 2  # 2 of site 0 meet site 1; the rest stay in a site
    assert _crossings(a, a) == 0
    assert _crossings(np.array([8, 0]), np.array([0, 8])) == 8


def test_a_boundary_move_gives_a_group_its_neighbours_mix_and_keeps_every_site_and_replica() -> None:
    model, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 4, 0.25)
    labels = find_cities(model)
    sizes = np.bincount(labels).tolist()
    rng = np.random.default_rng(7)
    _seed(3)
    moved = 0
    for _ in range(200):
        placement = random_placement(model.workload, rng)
        counts = np.array(
            [np.bincount(labels[list(g)], minlength=len(sizes)) for g in placement], dtype=np.int64
        )
        order = rng.permutation(4).astype(np.int64)
        trial, changed = counts.copy(), np.zeros(4, np.bool_)
        if not _boundary(counts, order, trial, changed):
            continue
        moved += 1
        assert trial.min() >= 0
        assert trial.sum(axis=1).tolist() == [16] * 4
        assert trial.sum(axis=0).tolist() == sizes
        neighbours = [(order[i], order[i + 1]) for i in range(3)]
        assert any(
            (trial[g] == counts[h]).all() and changed[g] for a, b in neighbours for g, h in ((a, b), (b, a))
        )
        assert sorted(np.flatnonzero((trial != counts).any(axis=1)).tolist()) <= sorted(
            np.flatnonzero(changed)
        )
    assert moved > 100


def test_the_edge_memo_returns_what_it_would_compute_through_evictions() -> None:
    model, _ = _site_model((9, 7, 12, 4), 4, 8, 3, 0.3)
    labels = find_cities(model)
    pairs = matched_levels(model, labels, 8)
    levels = np.unique(pairs[np.isfinite(pairs)])
    rng = np.random.default_rng(5)
    mixes = [
        np.bincount(labels[list(g)], minlength=4)
        for _ in range(6)
        for g in random_placement(model.workload, rng)
    ]
    keys, values = np.zeros((4, 8), np.int32), np.full(4, -1.0)  # 4 slots for 24 mixes: slots are reused
    for _ in range(3):
        for a, b in itertools.product(mixes[:8], mixes[8:16]):
            expected = _mix_edge(a, b, pairs, levels) + 0.5 * _crossings(a, b)
            assert _memo_edge(a, b, pairs, levels, 0.5, keys, values) == expected
    assert (values >= 0).all()  # every slot holds an edge now


@pytest.mark.parametrize("trial", range(30))
def test_matched_levels_are_the_bottleneck_k_matchings_of_a_block(trial: int) -> None:
    rng = np.random.default_rng(trial)
    rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    block = np.round(rng.random((rows, cols)) * (4 if trial % 2 else 100)) + 1.0  # odd trials: ties
    if trial % 3 == 0:
        block[rng.random((rows, cols)) < 0.3] = np.inf  # pairs that do not exist
    levels = _k_levels(block, 4)
    for k in range(1, 5):
        brute = min(
            (
                max(block[r, c] for r, c in zip(chosen, columns, strict=True))
                for chosen in itertools.combinations(range(rows), k)
                for columns in itertools.permutations(range(cols), k)
            ),
            default=np.inf,
        )
        assert levels[k - 1] == brute


def test_the_matched_estimate_is_a_lower_bound_of_every_filling_and_ranks_noise() -> None:
    model, _ = _site_model((9, 7, 12, 4), 4, 8, 3, 0.3)
    labels = find_cities(model)
    pairs = matched_levels(model, labels, 8)
    assert all(np.all(row[:-1] <= row[1:]) for row in pairs.reshape(-1, 8))  # ascending in k (inf last)
    assert np.isinf(pairs[3, 3, 2:]).all()  # a site of 4: at most 2 pairs inside it
    levels = np.unique(pairs[np.isfinite(pairs)])
    rng = np.random.default_rng(4)
    tighter = 0
    for _ in range(20):
        placement = random_placement(model.workload, rng)
        counts = np.array([np.bincount(labels[list(g)], minlength=4) for g in placement], dtype=np.int64)
        for g, h in itertools.pairwise(range(4)):
            estimate = _mix_edge(counts[g], counts[h], pairs, levels)
            assert estimate <= model.edge_cost(placement[g], placement[h]) + 1e-12
            medians = np.repeat(site_matrices(model, labels)[1][:, :, None], 8, axis=2)
            tighter += estimate < _mix_edge(counts[g], counts[h], medians, np.unique(medians))
    assert tighter > 0  # the median model overestimates what the refine can pick


def test_the_estimate_is_the_exact_cost_when_sites_are_made_of_twins() -> None:
    model, site = _site_model((6, 10, 8), 3, 8, 3, 0.0)  # no per-pair noise: medians are exact
    labels = find_cities(model)
    assert len(set(zip(labels.tolist(), site.tolist(), strict=True))) == 3
    rng = np.random.default_rng(0)
    for _ in range(5):
        placement = random_placement(model.workload, rng)
        for order in itertools.permutations(range(3)):
            path = sum(model.edge_cost(placement[a], placement[b]) for a, b in itertools.pairwise(order))
            exact = model.dp_cost(placement) + path
            assert mix_estimate(model, labels, placement, order) == pytest.approx(exact, rel=1e-12)


def test_the_mix_search_keeps_every_site_and_replica_and_reports_its_estimates() -> None:
    model, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 4, 0.25)
    labels = find_cities(model)
    clock = Ticks(0.25)  # a few chunks of a few hundred proposals per annealer
    found = search_mixes(
        model, labels, np.random.default_rng(1), span_s=3.0, racers=4, clock=clock, out_of_time=lambda: False
    )
    assert len(found) == 4
    assert [c.score for c in found] == sorted(c.score for c in found)  # ranked by the tie-broken score
    sizes = np.bincount(labels)
    dp, pp = site_matrices(model, labels)
    for candidate in found:
        assert candidate.counts.sum(axis=1).tolist() == [16] * 4
        assert candidate.counts.sum(axis=0).tolist() == sizes.tolist()
        placement = fill_mix(labels, candidate.counts, np.random.default_rng(2))
        model.check(placement)
        filled = np.array([np.bincount(labels[list(g)], minlength=len(sizes)) for g in placement])
        assert (filled == candidate.counts).all()
        estimate = mix_estimate(model, labels, placement, tuple(candidate.order.tolist()))
        assert estimate == pytest.approx(candidate.estimate, rel=1e-12)
        path = candidate.counts[candidate.order]
        crossings = sum(_crossings(a, b) for a, b in itertools.pairwise(path))
        assert candidate.score == pytest.approx(estimate + dtfm_mix.CROSS_WEIGHT * crossings, rel=1e-12)
    assert dp.shape == pp.shape == (len(sizes), len(sizes))
    start = random_placement(model.workload, np.random.default_rng(3))
    assert found[0].estimate < mix_estimate(model, labels, start, (0, 1, 2, 3))


def test_same_site_swaps_keep_every_groups_site_mix() -> None:
    model, _ = _site_model((10, 14, 8), 2, 16, 5, 0.25)
    labels = find_cities(model)
    start = random_placement(model.workload, np.random.default_rng(0))
    state = KernelState(
        model.pp_weights, model.dp_weights, start, (0, 1), 1.0, sites=labels, same_site_share=1.0
    )
    before = sorted(np.bincount(labels[row], minlength=3).tolist() for row in state.members)
    seed(1)
    state.run(5_000, 1.0, 1.0, 0.1)  # hot: every swap it proposes is taken
    after = sorted(np.bincount(labels[row], minlength=3).tolist() for row in state.members)
    assert after == before
    assert state.members.tolist() != [list(g) for g in start]  # devices did move
    with pytest.raises(ValueError, match="one label per device"):
        KernelState(model.pp_weights, model.dp_weights, start, (0, 1), sites=labels[:-1])


def test_mixes_first_on_every_layout_with_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[float] = []  # the slope of every mix search
    refines: list[object] = []  # the slopes of every refine (the race after it)
    starts: list[object] = []  # ... and the temperature (a fraction of the calibrated one) it starts at
    fillings: list[int] = []  # ... and how many fillings race in it
    halvings: list[object] = []  # ... and where the first halving is

    def counted(*args: object, **kwargs: object) -> list:
        calls.append(kwargs["slope"])  # type: ignore[arg-type]
        return search_mixes(*args, **kwargs)  # type: ignore[arg-type]

    def raced(*args: object, **kwargs: object) -> object:
        refines.append(kwargs.get("slope"))  # the plain race leaves these at their defaults
        starts.append(kwargs["hot"])
        fillings.append(len(kwargs.get("racers", ())))  # type: ignore[arg-type]
        halvings.append(kwargs.get("halve_at"))
        return race(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(dtfm_mix, "search_mixes", counted)
    monkeypatch.setattr(dtfm_race, "race", raced)
    few, many = dtfm_mixes_first._MIX_SLOPE_FEW, dtfm_mix.MIX_SLOPE
    refine = (dtfm_mixes_first._MIX_REFINE_SLOPE,) * 2  # the refine's, on every layout (session 21)
    model, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 6, 0.25)
    mixed = hybrid_search(model, SearchConfig(cpu_budget_s=1.0, seed=2), clock=Ticks(0.05))
    assert calls == [few]  # 64 devices: the slope of few devices in the mix search
    assert refines == [refine]
    model.check(mixed.placement)
    assert mixed.cost == pytest.approx(model.cost(mixed.placement), rel=1e-12)
    assert mixed.cost < mixed.initial_best_cost
    plain = hybrid_search(model, SearchConfig(cpu_budget_s=1.0, seed=2, mixes_first=False), clock=Ticks(0.05))
    assert calls == [few]  # mixes_first=False: the plain race, with its own falling slope
    assert refines[-1] is None
    for stages, replicas in ((8, 8), (16, 4)):  # narrow and tall layouts too (session 19)
        other, _ = _site_model((20, 11, 9, 16, 8), stages, replicas, 6, 0.25)
        hybrid_search(other, SearchConfig(cpu_budget_s=1.0, seed=2), clock=Ticks(0.05))
    assert calls == [few, few, few]
    wide_start, narrow_start = dtfm_mixes_first._MIX_REFINE_START_WIDE, dtfm_mixes_first._MIX_REFINE_START
    assert [starts[0], starts[2], starts[3]] == [
        wide_start,
        narrow_start,
        narrow_start,
    ]  # 16 / 8 / 4 replicas
    # wide groups: the best mix (`test_two_close_mixes_race_on_narrow_groups`) in four fillings, halved
    # from a tenth of the cooling on (session 22); narrow groups: one filling of each of one or two
    # mixes, halved at half; the plain race: none, halved at half
    assert dtfm_mixes_first._MIX_FILLINGS_WIDE == 4
    assert fillings[:2] == [4, 0]
    assert halvings[:2] == [dtfm_mixes_first._MIX_HALVE_AT_WIDE, None]
    assert dtfm_mixes_first._MIX_HALVE_AT_WIDE == 0.1
    assert set(fillings[2:]) <= {1, 2}
    assert halvings[2:] == [None, None]
    model.check(plain.placement)
    wide, _ = _site_model((40, 22, 18, 32, 16), 8, 16, 6, 0.25)  # 128 devices: slope 1.0 (session 20)
    hybrid_search(wide, SearchConfig(cpu_budget_s=1.0, seed=2), clock=Ticks(0.05))
    assert calls[-1] == many
    assert refines[-1] == refine


def test_two_close_mixes_race_on_narrow_groups() -> None:
    def mixes(*scores: float) -> list[MixCandidate]:
        return [
            MixCandidate(score, np.full((2, 2), k), np.arange(2), score) for k, score in enumerate(scores)
        ]

    raced = dtfm_mixes_first._raced_mixes
    gap = dtfm_mixes_first._MIX_RACE_GAP
    assert dtfm_mixes_first._MIX_RACERS == 2
    assert dtfm_mixes_first._MIX_RACERS_WIDE == 1
    close = mixes(50.0, 50.0, 50.0 * (1 + gap / 2), 50.1)  # the tie is one mix, the next distinct is close
    assert [c.score for c in raced(close, wide=False)] == [50.0, 50.0 * (1 + gap / 2)]
    assert [c.score for c in raced(close, wide=True)] == [50.0]  # wide groups: the best only
    apart = mixes(50.94, 52.21, 52.3)  # `hard-8x8-s0`: the deep mix, then the shallow one 2.5% above
    assert [c.score for c in raced(apart, wide=False)] == [50.94]
    assert [c.score for c in raced(mixes(41.4), wide=False)] == [41.4]


def test_wide_groups_race_more_mix_annealers() -> None:
    # 8x16 (128 devices, wide groups): 8 annealers missed its best mix in ~1 of 4 searches, 32 in ~1 of 10
    # (session 23); 16x8 (128 devices, narrow groups) keeps 8, below 128 devices 32 race anyway
    annealers = dtfm_mixes_first._mix_annealers
    assert annealers(few=False, wide=True) == 32 > annealers(few=False, wide=False) == 8
    assert annealers(few=True, wide=False) == annealers(few=True, wide=True)


def test_the_best_so_far_moves_while_mixes_are_searched(monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 mix annealers, as on 128 devices: with a ticking clock each chunk grows to its cap, so 32 would
    # cost ~4x the real CPU for the same ticks
    monkeypatch.setattr(dtfm_mixes_first, "_MIX_ANNEALERS_FEW", 8)
    model, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 6, 0.25)
    budget = 8.0
    result = hybrid_search(model, SearchConfig(cpu_budget_s=budget, seed=2), clock=Ticks(0.05))
    span = dtfm_mixes_first._MIX_SHARE_FEW * budget  # the mix search's share on 64 devices
    during = [(t, cost) for t, cost in result.curve if 0.0 < t <= span]
    assert during, result.curve[:5]  # a filling of the best mix so far was scored and noted
    assert min(cost for _, cost in during) < result.initial_best_cost
    assert result.cost <= min(cost for _, cost in result.curve) + 1e-9  # nothing noted beats the answer
    model.check(result.placement)
    assert result.cost == pytest.approx(model.cost(result.placement), rel=1e-12)


def test_the_mix_search_reports_valid_best_mixes() -> None:
    model, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 4, 0.25)
    labels = find_cities(model)
    sizes = np.bincount(labels).tolist()
    reports: list[np.ndarray] = []
    search_mixes(
        model, labels, np.random.default_rng(1), span_s=3.0, racers=4, clock=Ticks(0.25),
        out_of_time=lambda: False, on_best=reports.append,
    )  # fmt: skip
    assert reports
    for counts in reports:
        assert counts.sum(axis=1).tolist() == [16] * 4
        assert counts.sum(axis=0).tolist() == sizes


def test_the_searched_energy_ranks_the_deep_8x8_mix_first_as_the_estimate_does() -> None:
    """Session 20: with 1 x the mean group all-reduce in the energy, the mix search preferred a shallow
    `hard-8x8-s0` mix (three groups of 7 from the largest city) to the deep one that refines 2-5% lower
    (five groups of 5, every all-reduce slow), which the estimate ranks first; the slope must not
    reverse the estimate's order of the two (below 128 devices: `dtfm_mixes_first._MIX_SLOPE_FEW`)."""
    model = make_case(8, 8, 0).model()
    labels = find_cities(model)
    assert np.bincount(labels).tolist() == [7, 8, 1, 4, 10, 4, 25, 5]
    deep = [[1, 1, 0, 0, 0, 0, 5, 1]] * 5 + [[2, 3, 1, 0, 0, 2, 0, 0]] + [[0, 0, 0, 2, 5, 1, 0, 0]] * 2
    shallow = [[0, 1, 0, 0, 0, 0, 7, 0]] * 3 + [[0, 1, 0, 0, 0, 3, 4, 0], [0, 3, 0, 1, 0, 1, 0, 3]]
    shallow += [[1, 1, 1, 3, 0, 0, 0, 2]] + [[3, 0, 0, 0, 5, 0, 0, 0]] * 2
    dp, pairs, levels = dtfm_mix.site_model(model, labels)
    order = np.arange(8, dtype=np.int64)

    def scored(mix: list[list[int]]) -> tuple[float, float]:
        counts = np.array(mix, dtype=np.int64)
        assert counts.sum(axis=0).tolist() == np.bincount(labels).tolist()
        estimate = dtfm_mix._estimate(counts, order, dp, pairs, levels, dtfm_mix.CROSS_WEIGHT)
        mean_dp = float(np.mean([dtfm_mix._mix_dp(row, dp) for row in counts]))
        return estimate, estimate + dtfm_mixes_first._MIX_SLOPE_FEW * mean_dp

    (deep_estimate, deep_energy), (shallow_estimate, shallow_energy) = scored(deep), scored(shallow)
    assert deep_estimate == pytest.approx(50.94, abs=0.01)
    assert shallow_estimate == pytest.approx(52.21, abs=0.01)
    assert deep_energy < shallow_energy


def test_the_refine_calibrates_on_its_random_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    # one random layout's median uphill swap (along its best order) is a noisy temperature: on
    # `hard-8x8-s0` it varies by a factor of ~4 between seeds, pooled over 16 layouts by much less
    # (session 22; the refine pools `dtfm_race.CALIBRATION_LAYOUTS` of them since session 23)
    model = make_case(8, 8, 0).model()
    labels = find_cities(model)

    def layout(rng: np.random.Generator) -> KernelState:
        p = random_placement(model.workload, rng)
        order = model.pp_cost(p)[1]
        pp, dp = model.pp_weights, model.dp_weights
        return KernelState(pp, dp, p, order, 0.3, sites=labels, same_site_share=0.5)

    def temperatures(layouts: int) -> np.ndarray:
        out = []
        for value in range(12):
            rng = np.random.default_rng(value)
            seed(value)
            out.append(calibrate([layout(rng) for _ in range(layouts)]))
        return np.array(out)

    one, pooled = temperatures(1), temperatures(16)
    assert pooled.std() / pooled.mean() < 0.5 * one.std() / one.mean()
    assert 0.7 < np.median(pooled) / np.median(one) < 1.4  # the same scale: the tuned fractions still hold
    # the mixes-first refine calibrates on `CALIBRATION_LAYOUTS` layouts; the plain race on its start only
    monkeypatch.setattr(dtfm_race, "CALIBRATION_LAYOUTS", 4)
    seen: list[int] = []

    def counted(layouts: list[KernelState], swaps: int = 500) -> float:
        seen.append(len(layouts))
        return calibrate(layouts, swaps)

    monkeypatch.setattr(dtfm_race, "calibrate", counted)
    small, _ = _site_model((20, 11, 9, 16, 8), 4, 16, 6, 0.25)
    hybrid_search(small, SearchConfig(cpu_budget_s=1.0, seed=2), clock=Ticks(0.05))
    hybrid_search(small, SearchConfig(cpu_budget_s=1.0, seed=2, mixes_first=False), clock=Ticks(0.05))
    assert seen == [4, 1]
