"""DT-FM placement search: annealing with incremental swap evaluation, structure-aware starts (+ the GA).

Problem. Find the partition of ``N = D_PP * D_DP`` devices into ``D_PP`` stage groups minimising the
DT-FM cost (`dtfm.CostModel`). The paper (Yuan et al. 2022, sec. 3.3) runs a hybrid genetic algorithm in
the style of Bui & Moon's balanced graph partitioning: a population of partitions, a crossover that
keeps whole groups of one parent, and a swap local search on every child.

Method (default, ``method="anneal"``). Score the structure-aware starts (below) and one random
placement; from the best, run simulated annealing over swaps of two devices in different groups, each
swap evaluated incrementally (`dtfm_anneal.SwapState`: only the two groups' all-reduce costs, the
pipeline edges touching them, and the path, which is exact up to ``tsp_exact_limit`` groups and a
warm-started 2-opt + Or-opt beyond, `dtfm_paths`). Metropolis acceptance on an energy = cost + slopes
for the plateaus (see `dtfm_anneal`); geometric cooling to 1/1000 of the temperature that accepts the
median uphill move half the time. Cycles: the first takes 3/4 of the CPU budget, each later one restarts
from the best placement so far at 0.3x that temperature and takes half of what is left, so the
best-so-far curve keeps improving with CPU time (``SearchResult.curve``). On networks with twins a cycle
also ends once its best has not improved for 1/4 of the budget, and a cycle that did not improve the
overall best is followed by one from a fresh random placement at the full temperature (3/4 of what is
left) instead of a reheat of the same basin (session 11: `regional` seed 2 without structure starts sat
at 1.10x from 0.9 CPU s to the end of the minute in one 45 s first cycle; cycles capped at 1/4 of the
budget with random restarts fixed it but lost `datacenter_on_demand` seed 0, so the first cycle is the
same as before until it stalls). The final answer is re-scored with the exact model.

Noisy networks (no twins) under the CPU-time schedule (the default) are searched by compiled
annealers (`dtfm_kernel`, session 13): the same Metropolis search, but over the placement *and* a
stage order together (swaps scored along the current order, 10% of the proposals reverse or move
groups of the order), at ~1-2 us per proposal instead of the Python annealer's 160-190 us (below),
with a slope on the mean group all-reduce cost in the acceptance (`dtfm_kernel`) that falls from 2x
to 0.5x over the cooling (session 18; 0.3x throughout for the refine of a mix, below). Several
annealers race on one cooling schedule and are halved at 1/2, 3/4, ... of it (`dtfm_race`; how
many from the measured pace). ``SearchConfig(compiled=False)`` keeps the Python annealer; its
restart cycles below do not apply to the compiled search. Results in `docs/planning-placement.md`.
With 2-16 sites found in the matrix (`dtfm_sites.find_cities`; until session 19 only with 16 or more
replicas per stage), the compiled search first spends a quarter of the budget on the groups' site
*mixes* (`dtfm_mix`; 8 racing mix annealers; below 128 devices 32 of them in half of the budget), then
races fillings of the two best mixes (one on wide groups) from 0.1x (0.05x on wide groups) to 0.005x
the calibrated temperature, halved at half of the cooling, with half of the swaps inside a site
(session 15: the mix decides the basin on wide groups; session 17: one filling, not two racing;
session 20: below 128 devices the mix energy weighs the mean all-reduce 0.3x, not 1x; session 21: the
refine 0.3x everywhere, two racing fillings of close mixes on narrow groups, where a refine freezes by
half of its cooling, and half of the budget for the mixes of 64 devices; session 22: on wide groups
four fillings of the best mix, halved at 1/10 and 2/10 of the cooling, where their refines freeze;
``mixes_first=False`` skips it).

Noisy networks (no twins) with the CPU-time schedule get a schedule of their own: the old curves (8x8,
60 s) spent the first third of the hot cycle at temperatures where the best-so-far did not move (a
random walk) and the last quarter frozen, and every reheat at 0.3x restarted from scratch without
ever improving. Now the first cycle runs from 0.2x to 1/1000 of the calibrated temperature over 80% of
the budget, then cycles of 4% of the budget each restart from the best at 0.02x (an iterated local
search whose kick is a short warm walk). With 16 or more replicas per stage the first cycle starts at
the full calibrated temperature instead (session 10, 60 s CPU, load 15-20: 8x16 seeds 0 / 2 went from
1.073 / 1.106x the reference to 1.019 / 1.009x; the same start on 16x8 seed 0 gave 1.095x against
1.039x, so stage-heavy layouts keep 0.2x). The by-proposals schedule (``anneal_moves``) keeps the
classic temperatures.

Rejection without the path. At the cool temperatures most swaps are rejected; once a swap's changed
pipeline edges are known, the current path length minus the four largest edge drops bounds the new
exact path from below, and when that already puts the energy above the acceptance threshold the
Held-Karp path is skipped (`SwapState.propose_below`; same decisions, ~23% of proposals on 8x8).

Why not the GA (kept as ``method="ga"``). Measured before this change (`benchmarks/bench_placement.py`):
on the public scenarios it reached the best-known cost only through the structure-aware starts -- its
genetic and local search never improved on a start -- and without them ended at 1.06-1.18x on the
world-wide case and 1.50x on ``datacenter_spot``; on noisy 128-device cases its first-improvement local
search (~7,000 swaps, each a full re-evaluation) used the whole 60 s budget before generation 1 (8x16:
1.09-1.30x a plain annealer), and at 16 stages the exact 16-group path made it 410 evaluations per
minute (1.48x). Tabu search was not tried (a tabu list needs the whole neighbourhood scored per step,
thousands of matchings). What the GA work taught us is kept:

* **Plateaus.** The cost is made of maxima (slowest device of an all-reduce, slowest pair of a
  bottleneck matching): almost every swap leaves it unchanged (on ``datacenter_spot`` nearly every
  layout costs 6.57 s). The surrogate softens each pipeline edge by how *close* its matching is to the
  next cheaper level (``bottleneck - gap * 0.5 * m / n`` with ``m`` the maximum matching below the
  bottleneck) and adds a small weight on the mean group all-reduce time. The annealer uses the matching
  slope only when the network has twins (on noisy networks there are no plateaus and it doubles the
  matching work).
* **Symmetry.** Devices whose rows are identical in both matrices ("twins": GPUs of one machine, or all
  lone spot instances) are interchangeable; swaps between twins are skipped (annealer) or scored once
  per multiset of twin classes (GA).
* **Structure.** Co-located devices ("sites": single-linkage over the cheapest links, within a
  tolerance) are what good layouts exploit: a site either fills whole stage groups (cheap all-reduce)
  or carries consecutive stages of whole pipelines (cheap pipeline edges). Both layouts are starts
  (`dtfm_structure.structured_placements`); the GA uses site moves as mutations, the annealer (on
  networks with twins) a compound move spreading a site over consecutive path positions.

Measured at commit c5542d8, before the faster matching and path search and the noisy schedule
(`benchmarks/results/placement.md`, 60 s CPU, a busy 2-core host): all four public
scenarios reach the best-known cost (seed 0) with the structure-aware starts (in < 0.01 s) and without
them (2.3-45 s CPU; ``datacenter_spot`` needs the site moves of `dtfm_anneal`). Hard noisy cases
(`benchmarks/placement_cases.py`), seeds 0 and 1, ours vs. a plain annealer with the same budget:
8x8 67.6 / 67.2 vs 65.0 / 68.1 s; 8x16 53.0 / 52.1 vs 53.3 / 54.8 s; 16x8 86.7 / 87.4 vs 100.0 /
100.5 s (the path heuristic pays: ~30k proposals against the plain annealer's exact 16-group paths).
Ours is within 1.05x of the references (best found by anything), not the 1.02x we aimed for.
Since then a swap proposal costs 0.55 / 0.95 / 1.05 ms on the 8x8 / 8x16 / 16x8 hard cases against
1.06 / 2.65 / 2.32 ms before (`benchmarks/bench_placement_swaps.py`, both trees at once, load ~40).

Session 10 (commit 1ad1a4b, 60 s CPU, seeds 0-2, load 8-30): the five public scenarios (now with
DT-FM's world-wide one) reach the best-known cost on every seed with the structure-aware starts;
without them 14 of 15 runs do (0.3-31 CPU s), and ``regional`` seed 2 stays at 1.10x from 1.1 s on
(no move out of that layout at the reheat temperatures). Hard cases: `docs/planning-placement.md`.
Session 11 (the stall rule above, twin-class memo in `dtfm_anneal`, batched matchings): see
`docs/planning-placement.md` and `benchmarks/results/placement_session11.md`. Session 12: swaps on
noisy networks are screened along the current stage order (`SwapState.propose_along`, ~2.4x the
proposals per CPU second on 16x8) and a second compound move evens out doubled sites
(`dtfm_site_moves.even_out_site`); results in `docs/planning-placement.md`.

Tried in session 12 and not kept (60 s CPU, 16x8, one run per seed, load 1-6): the cities of the
generator given to the search as sites (an oracle; starts and site moves): 1.069 / 1.062x with the
starts only, 1.081 / 1.125x with site moves too (50k moves in the minute instead of 150k); three
independent first cycles instead of one: 1.093 / 1.055 / 1.038x against one cycle's 1.065-1.081x
(same code otherwise). A screen of every changed edge at its lower bound (largest row/column
minimum) before any matching rejected 3 of 1,886 cool swaps on 16x8: slower, dropped.

Known limits. No optimality proof. Above ``tsp_exact_limit`` groups the in-loop pipeline cost is a
local-search upper bound (the reported cost is exact). With the default time-sliced schedule a result
depends on how many proposals the CPU budget allows; pass ``anneal_moves`` (and ``max_generations``)
for bit-reproducible runs. The bottleneck matchings dominated the time (~15-30 us each in Python,
``2 D_PP - 3`` per swap; 12.5 of 15.7 s in a profiled 16x8 run). Session 11: groups of <= 8 devices
get the changed edges of a swap in one vectorised call (`dtfm_hall`, Hall's condition on bitmasks; 16x8
0.82 -> 0.42 ms per proposal, 8x8 0.39 -> 0.25 ms), and wider groups (8x16) are screened by edge lower
bounds and a Held-Karp path over them before any matching (`SwapState.propose_below`; ~95% of the cool
proposals rejected with a few matchings). A compiled matching would be the next speed-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement, random_placement
from ravnest_p2p.planning.dtfm_anneal import SwapState, anneal, calibrate_temperature
from ravnest_p2p.planning.dtfm_ga import ga_search
from ravnest_p2p.planning.dtfm_mixes_first import MixStart, mix_racers, refine_schedule
from ravnest_p2p.planning.dtfm_paths import EXACT_TSP_LIMIT
from ravnest_p2p.planning.dtfm_structure import find_sites, structured_placements, twin_classes

__all__ = ["SearchConfig", "SearchResult", "find_sites", "hybrid_search", "structured_placements"]

_REHEAT = 0.3  # later annealing cycles start at this fraction of the calibrated temperature
_COOL_TO = 1e-3  # every cycle cools down to this fraction of it
_FIRST_SHARE = 0.75  # of what is left of the CPU budget, for a cycle from a fresh start
# Networks with twins: a cycle ends once its best has not improved for this share of the CPU budget
# (session 11: one 45 s first cycle left `regional` seed 2 at 1.10x from 0.9 s to the end).
_TWIN_STALL_SHARE = 0.25
# Noisy networks (no twins): the calibrated temperature is a random walk; the first cycle starts at
# this fraction of it, later cycles are short (a share of the budget each) and start cooler.
_NOISY_START = 0.2
# ... except with many replicas per stage (wide stage groups: every pipeline edge is a bottleneck
# matching over >= 16 pairs), where the 0.2x start froze into a poor basin (8x16: 1.07 / 1.11x the
# reference on two seeds) and the full calibrated temperature did not (1.019 / 1.009x). The same
# full start hurt 16x8 (1.04 -> 1.095x, one seed), so it is not the default everywhere.
_NOISY_START_WIDE = 1.0
_WIDE_REPLICAS = 16
_NOISY_REHEAT = 0.02
_NOISY_FIRST_SHARE = 0.8
_NOISY_LATER_SHARE = 0.04


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of `hybrid_search`.

    Attributes:
        cpu_budget_s: stop after this much CPU time (as read by the injected clock).
        max_generations: stop after this many children (whichever comes first).
        population_size: individuals kept.
        seed: seeds every random choice.
        structure_seeds: seed the population with the site layouts (off = the paper's plain start).
        site_tolerance: links within this factor of the cheapest link count as co-located.
        stall_s: also stop once the best cost has not improved for this much CPU time (None: never).
        method: ``"anneal"`` (default: annealing cycles from the best start) or ``"ga"`` (the hybrid
            GA of the paper with our surrogate and site moves).
        anneal_moves: swap proposals in the first annealing cycle (each later cycle doubles it, up to
            32x: bit-reproducible); 0 (default) schedules cycles by CPU time instead: half the budget,
            then half of what is left, and so on.
        tsp_exact_limit: stage counts up to which the pipeline path is solved exactly in the loop.
        start_temperature: first annealing cycle's start, as a fraction of the calibrated temperature
            (None: 1 on networks with twins, 0.2 on noisy ones, 1 on noisy ones with >= 16 replicas).
        reheat: later cycles' start, as that fraction (None: 0.3 with twins, 0.02 on noisy networks;
            the Python annealer only: the compiled search has no restart cycles).
        target_cost: also stop once a placement costs at most this (e.g. a known optimum or a
            benchmark's best-known value: the time to reach it is then ``best_found_cpu_s``).
        compiled: on noisy networks under the CPU-time schedule, search with the compiled annealer
            over placements and stage orders (`dtfm_kernel`); off = the Python annealer.
        mixes_first: with the compiled annealer, >= 16 replicas per stage and 2-16 sites found in the
            matrix, search the groups' site mixes first and refine their fillings (`dtfm_mix`).
    """

    cpu_budget_s: float = 60.0
    max_generations: int = 100_000
    population_size: int = 12
    seed: int = 0
    structure_seeds: bool = True
    site_tolerance: float = 1.25
    stall_s: float | None = None
    method: str = "anneal"
    anneal_moves: int = 0
    tsp_exact_limit: int = EXACT_TSP_LIMIT
    start_temperature: float | None = None
    reheat: float | None = None
    target_cost: float | None = None
    compiled: bool = True
    mixes_first: bool = True


@dataclass(frozen=True)
class SearchResult:
    """Best placement found, its cost and stage order, and what the search spent."""

    placement: Placement
    cost: float
    stage_order: tuple[int, ...]
    generations: int
    evaluations: int
    cpu_s: float
    initial_best_cost: float
    best_found_cpu_s: float
    curve: tuple[tuple[float, float], ...] = ()
    """``(cpu_s, best cost so far)`` at every improvement (upper bounds above the exact TSP limit)."""


def hybrid_search(
    model: CostModel,
    config: SearchConfig | None = None,
    *,
    clock: Callable[[], float] = time.process_time,
) -> SearchResult:
    """Search placements with the hybrid GA + local search described in the module docstring.

    Args:
        model: the cost model of the network and workload.
        config: budgets and switches (defaults: 60 s CPU, structure seeds on).
        clock: CPU-time source for the budget (injected so tests can fix it).

    Returns:
        The best placement seen, with its DT-FM cost and stage order.
    """
    config = config or SearchConfig()
    if config.method not in ("anneal", "ga"):
        raise ValueError(f"unknown search method {config.method!r}")
    rng = np.random.default_rng(config.seed)
    started = clock()

    best_cost = np.inf
    best_found = 0.0
    curve: list[tuple[float, float]] = []

    def out_of_time() -> bool:
        now = clock() - started
        stalled = config.stall_s is not None and now - best_found >= config.stall_s
        reached = config.target_cost is not None and best_cost <= config.target_cost
        return now >= config.cpu_budget_s or stalled or reached

    def note(score: tuple[float, float]) -> None:
        nonlocal best_cost, best_found
        if not np.isfinite(best_cost) or score[0] < best_cost - 1e-9 * max(1.0, best_cost):
            best_cost, best_found = score[0], clock() - started
            curve.append((best_found, best_cost))

    sites = find_sites(model, config.site_tolerance)
    starts: list[Placement] = structured_placements(model, sites) if config.structure_seeds else []
    if config.method == "anneal":
        return _anneal_search(model, config, rng, starts, sites, out_of_time, note, clock, started, curve)
    best, generations, evaluations, initial_best = ga_search(
        model, starts, sites, rng, config.population_size, config.max_generations, out_of_time, note
    )
    return _result(model, best, generations, evaluations, initial_best, clock() - started, curve)


def _result(
    model: CostModel,
    best: Placement,
    generations: int,
    evaluations: int,
    initial_best: float,
    cpu_s: float,
    curve: list[tuple[float, float]],
) -> SearchResult:
    """``best`` scored exactly (DP + the exact open-loop path) with what the search spent."""
    length, order = model.pp_cost(best)
    return SearchResult(
        placement=best,
        cost=model.dp_cost(best) + length,
        stage_order=order,
        generations=generations,
        evaluations=evaluations,
        cpu_s=cpu_s,
        initial_best_cost=initial_best,
        best_found_cpu_s=curve[-1][0] if curve else 0.0,
        curve=tuple(curve),
    )


def _anneal_search(
    model: CostModel,
    config: SearchConfig,
    rng: np.random.Generator,
    starts: list[Placement],
    sites: Sequence[Sequence[int]],
    out_of_time: Callable[[], bool],
    note: Callable[[tuple[float, float]], None],
    clock: Callable[[], float],
    started: float,
    curve: list[tuple[float, float]],
) -> SearchResult:
    """Annealing cycles (geometric cooling, doubling length) restarted from the best placement so far."""
    limit = config.tsp_exact_limit
    classes = twin_classes(model)
    # The matching slope pays off on plateaus, which come from identical links (twins); on noisy
    # networks it only doubles the matching work (measured: no gain on the hard cases).
    soft = len(set(classes.tolist())) < model.num_devices
    candidates = [*starts, random_placement(model.workload, rng)]
    states = [SwapState(model, p, limit, soft) for p in candidates]
    state = min(states, key=lambda s: s.cost)
    best, best_exact = state.placement(), model.cost(state.placement())
    initial_best = best_exact
    note((best_exact, 0.0))
    # The noisy schedule is tuned for CPU budgets of tens of seconds; the by-proposals schedule (tests,
    # reproducible runs) keeps the classic temperatures.
    noisy = not soft and config.anneal_moves == 0
    wide = model.workload.num_replicas >= _WIDE_REPLICAS
    hot = config.start_temperature or ((_NOISY_START_WIDE if wide else _NOISY_START) if noisy else 1.0)
    if noisy and config.compiled:  # the race calibrates its own temperature
        from ravnest_p2p.planning.dtfm_race import race  # numba: imported (and compiled, once) when used

        mixes = MixStart((), None, None)
        if config.mixes_first:
            budget = config.cpu_budget_s
            mixes = mix_racers(model, config.seed, budget, rng, out_of_time, clock, note, wide=wide)
        racing = partial(
            race, budget_s=config.cpu_budget_s, max_rounds=config.max_generations, out_of_time=out_of_time,
            note=note, clock=clock, started=started,
        )  # fmt: skip
        if mixes.racers:  # the start only calibrates the temperature: the mixes' fillings race
            schedule = refine_schedule(wide=wide)
            won = racing(
                model, random_placement(model.workload, rng), rng, hot=schedule.hot, cool_to=schedule.cool_to,
                racers=mixes.racers, sites=mixes.labels, same_site_share=schedule.same_site_share,
                slope=schedule.slope, halve_at=schedule.halve_at,
            )  # fmt: skip
        else:
            won = racing(model, best, rng, hot=hot, cool_to=_COOL_TO)
        filled = mixes.filled
        final = won.placement if filled is None else min(won.placement, filled, key=model.cost)
        return _result(model, final, won.rounds, won.proposals, initial_best, clock() - started, curve)
    temperature = calibrate_temperature(state, classes, rng)
    reheat = config.reheat or (_NOISY_REHEAT if noisy else _REHEAT)
    # Networks with twins under the CPU-time schedule: a cycle whose best has not moved for a quarter of
    # the budget ends, and a cycle that did not improve the best is followed by a fresh random layout at
    # the full temperature instead of a reheat of the same basin.
    restarts = soft and config.anneal_moves == 0
    last_gain = [clock()]

    def stalled() -> bool:
        return clock() - last_gain[0] >= config.cpu_budget_s * _TWIN_STALL_SHARE

    def gained(s: SwapState) -> None:
        last_gain[0] = clock()
        note((s.cost, 0.0))

    cycles = proposals = 0
    fresh = True
    while cycles < config.max_generations and not out_of_time():
        last_gain[0] = clock()
        stop = stalled if restarts else None
        progress = _schedule(config, cycles, clock, started, out_of_time, noisy=noisy, fresh=fresh, stop=stop)
        outcome = anneal(
            state,
            classes,
            rng,
            start_temperature=temperature * (hot if fresh else reheat),
            end_temperature=temperature * _COOL_TO,
            progress=progress,
            on_best=gained,
            sites=sites if soft else (),
        )
        cycles += 1
        proposals += outcome.moves
        exact = model.cost(outcome.placement) if len(best) > limit else outcome.cost
        improved = exact < best_exact - 1e-12 * max(1.0, best_exact)
        if improved:
            best, best_exact = outcome.placement, exact
            note((exact, 0.0))
        fresh = restarts and not improved
        state = SwapState(model, random_placement(model.workload, rng) if fresh else best, limit, soft)
    return _result(model, best, cycles, proposals, initial_best, clock() - started, curve)


def _schedule(
    config: SearchConfig,
    cycle: int,
    clock: Callable[[], float],
    started: float,
    out_of_time: Callable[[], bool],
    *,
    noisy: bool = False,
    fresh: bool = True,
    stop: Callable[[], bool] | None = None,
) -> Callable[[int], float]:
    """Progress of annealing cycle ``cycle``: by proposals when ``anneal_moves`` is set, else by CPU time.

    By CPU time, a cycle from a fresh start gets 3/4 of what is left of the budget and a reheat half
    of it (anytime: a reheat restarts from the best so far, cooler and shorter); ``stop`` ends a cycle
    early (the stall rule on networks with twins). Noisy networks have their own shares. By proposals, cycle
    ``c`` makes ``anneal_moves x 2^min(c, 5)`` of them: bit-reproducible, independent of the machine.
    """
    if config.anneal_moves > 0:
        moves = config.anneal_moves * 2 ** min(cycle, 5)

        def by_moves(done: int) -> float:
            if done % 16 == 0 and out_of_time():
                return 1.0
            return done / moves

        return by_moves
    begin = clock() - started
    if noisy:
        left = config.cpu_budget_s - begin
        span = (
            left * _NOISY_FIRST_SHARE if cycle == 0 else min(left, config.cpu_budget_s * _NOISY_LATER_SHARE)
        )
        span = max(span, 1e-6)
    else:
        share = _FIRST_SHARE if fresh else 0.5
        span = max((config.cpu_budget_s - begin) * share, 1e-6)
    latest = [0.0]

    def by_time(done: int) -> float:
        if done % 16 == 0:
            done_ = out_of_time() or (stop is not None and stop())
            latest[0] = 1.0 if done_ else (clock() - started - begin) / span
        return latest[0]

    return by_time
