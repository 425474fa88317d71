"""Racing compiled annealers over DT-FM placements and stage orders (noisy networks; see `dtfm_search`).

Method. Annealers of `dtfm_kernel` (the best start and random placements) cool from ``hot`` x the
calibrated temperature (the one at which the median uphill swap is accepted half the time) to
``cool_to`` x it on one geometric schedule, in lockstep; at half of the cooling the better half (by
best cost so far) goes on, at three quarters the better half of those, and so on until one is left
(`race_rounds`). CPU is shared so that the survivor cools at the same pace throughout; the budget is
spent in chunks of ~20 ms per annealer between clock reads. How many annealers: as many as leave the
survivor `ANNEAL_PROPOSALS` x devices^2 proposals at the pace measured on the first one
(`racer_count`).

Why. After its first cooling the compiled search was never moved by the Python search's restart
cycles (the basin is chosen while hot), and one run's outcome spread 5-10% between basins. Session 13,
60 s CPU, ratios to the references of that time: 8x8 did best with 16 annealers of ~6 M proposals each
(0.928-0.952) against 4 of ~24 M (0.934-0.949); 16x8 with 4 of ~19 M (0.953-0.983) and 8 (0.950-0.964)
against 16 of ~5 M (0.973-0.975) and one anneal (0.967-0.995). Numbers in `docs/planning-placement.md`.

The energy adds a *slope* x the mean group all-reduce cost to the cost (`dtfm_kernel`): 16x8 single
anneals, 60 s: no slope 1.008-1.034 of the session-12 reference, slope 0.1 0.961-1.078, 1.0
0.967-0.995, 3.0 0.978 / 0.981. Session 18: the slope falls with the cooling, geometrically from
`DP_SLOPE` (2.0) to `DP_SLOPE` x `SLOPE_END` (0.5) (`slope_at`). The slope pulls groups towards
cheap all-reduces (whole groups from one city) while the layout is chosen, but at the end it is not the
cost: on `hard-8x8-s0` the reference's energy at slope 1 is above that of a 1.010x result (a group of
five cities whose all-reduce is not the slowest). 60 s CPU, ratio to the reference, seeds 0-11 (two at
a time): constant 1.0 (before) mean 1.019, 3 of 6 <= 1.02; constant 0 / 0.3 / 2 / 3: 1.062 / 1.054 /
1.024 / 1.041; 1.0 -> 0.5: 1.026; 1.5 -> 0.75: 1.014 (8 of 12); **2.0 -> 0.5: 1.010, 12 of 12** (max
1.018); 3.0 -> 0.5: 1.017. `hard-16x8-s0`, seeds 0-5: constant 1.0 1.031 (0 of 6), 2.0 -> 0.5 1.019.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement, random_placement
from ravnest_p2p.planning.dtfm_anneal import uphill_temperature
from ravnest_p2p.planning.dtfm_kernel import KernelState, seed

__all__ = ["RaceOutcome", "calibrate", "race", "race_rounds", "racer_count", "slope_at"]

ORDER_SHARE = 0.1  # share of proposals that change the stage order
DP_SLOPE = 2.0  # the energy's weight on the mean group all-reduce cost as the cooling starts (best: by cost)
SLOPE_END = 0.25  # ... and as it ends, as a fraction of DP_SLOPE (geometric in between: `slope_at`)
ANNEAL_PROPOSALS = 800  # proposals per device^2 the surviving annealer should get
MAX_RACERS = 16
PACE_PROPOSALS = 20_000  # hot proposals on the first annealer that measure the pace
# Random layouts whose swaps calibrate the temperature of a race given its racers (the mixes-first refine),
# each along its own best stage order, as the start is (along `range(stages)` the scale is ~half: 16x8
# mean 1.11 against 1.99). Session 22, 40 seeds, 500 swaps each: one layout's median uphill swap varies
# with the layout (coefficient of variation 0.21 on `hard-16x8-s0`, 0.34 on 8x16, 0.29 on 8x8, ranges
# 1.2-3.1 / 0.5-2.3 / 1.1-5.1); pooled over 16 layouts 0.05 on 16x8. Session 23, full 60 s runs with 16
# (the schedules' fractions unchanged; ratios to the references): `hard-16x8-s0` seeds 80-103 22 of 24
# <= 1.02x, mean 1.012 (one layout, seeds 80-91: 9 of 12, 1.0157); 8x8 12 of 12, 1.0079; 8x16 10 of 12,
# 1.0098 (its two misses are its second-best mix, found before the race). Building the 15 extra layouts
# costs ~1.6 CPU-s on 16x8 (their stage orders), 0.05 s on 8x16.
CALIBRATION_LAYOUTS = 16


@dataclass(frozen=True)
class RaceOutcome:
    """The best placement any annealer reached, the rounds run and the proposals made."""

    placement: Placement
    rounds: int
    proposals: int


def race_rounds(racers: int, first: float | None = None) -> list[tuple[float, float, int]]:
    """(cooling progress where a round starts, its length, annealers in it): halved at 1/2, 3/4, ...; or,
    with ``first``, at ``first``, 2 x ``first``, 4 x ``first``, ... (early halvings, for refines that
    choose their basin early in the cooling)."""
    rounds, alive, begin = [], racers, 0.0
    while alive > 1:
        end = begin + (1.0 - begin) / 2  # halved at 1/2, 3/4, ...
        if first is not None:
            end = first if begin == 0.0 else 2 * begin
        if end >= 1.0:
            raise ValueError(f"{racers} annealers cannot halve from {first} of the cooling on")
        rounds.append((begin, end - begin, alive))
        begin, alive = end, alive // 2
    rounds.append((begin, 1.0 - begin, 1))
    return rounds


def racer_count(proposals: float, devices: int) -> int:
    """The most annealers (a power of two, <= `MAX_RACERS`) that still leave the one that cools to the
    end `ANNEAL_PROPOSALS` x devices^2 of ``proposals`` in all."""
    racers = 1
    while racers < MAX_RACERS:
        units = sum(length * count for _, length, count in race_rounds(racers * 2))
        if proposals / units < ANNEAL_PROPOSALS * devices**2:
            break
        racers *= 2
    return racers


def slope_at(progress: float, hot: float, cool: float) -> float:
    """The energy's slope at ``progress`` (0..1) through the cooling: geometric from ``hot`` to ``cool``."""
    if hot <= 0.0 or cool <= 0.0:
        return hot + (cool - hot) * progress
    return hot * (cool / hot) ** progress


def calibrate(layouts: Sequence[KernelState], swaps: int = 500) -> float:
    """The temperature at which the median uphill swap of ``layouts`` (``swaps`` random ones on each,
    none applied) is accepted half the time; 1/1000 of the first one's cost if no swap goes uphill."""
    deltas = np.concatenate([layout.swap_deltas(swaps) for layout in layouts])
    return uphill_temperature(deltas, layouts[0].cost)


def race(
    model: CostModel,
    start: Placement,
    rng: np.random.Generator,
    *,
    hot: float,
    cool_to: float,
    budget_s: float,
    max_rounds: int,
    out_of_time: Callable[[], bool],
    note: Callable[[tuple[float, float]], None],
    clock: Callable[[], float],
    started: float,
    racers: Sequence[Placement] = (),
    sites: np.ndarray | None = None,
    same_site_share: float = 0.0,
    slope: tuple[float, float] | None = None,
    halve_at: float | None = None,
) -> RaceOutcome:
    """Race annealers from ``start`` and random placements until ``out_of_time`` or the cooling ends.

    Args:
        racers: when given, these are the annealers (a power of two of them) and ``start`` only
            calibrates the temperature (the mixes-first search of `dtfm_mix`).
        sites / same_site_share: a site label per device and the share of swaps within a site
            (`dtfm_kernel.KernelState`).
        hot / cool_to: the schedule's ends as fractions of the calibrated temperature.
        budget_s: the CPU budget counted from ``started`` (as read by ``clock``).
        max_rounds: stop after this many halving rounds.
        note: called with ``(best cost so far, 0.0)`` after every chunk (an upper bound: the cost along
            the annealer's stage order).
        slope: the energy's slope on the mean group all-reduce as the cooling starts and as it ends
            (default: `DP_SLOPE` to `DP_SLOPE` x `SLOPE_END`).
        halve_at: the first halving's progress through the cooling, the next ones at its doubles
            (`race_rounds`; default: halved at 1/2, 3/4, ...).
    """
    hot_slope, cool_slope = slope if slope is not None else (DP_SLOPE, DP_SLOPE * SLOPE_END)
    seed(int(rng.integers(2**31)))
    stages = model.workload.num_stages

    def racer(layout: Placement, order: tuple[int, ...]) -> KernelState:
        return KernelState(
            model.pp_weights,
            model.dp_weights,
            layout,
            order,
            hot_slope,
            sites=sites,
            same_site_share=same_site_share,
        )

    states = [racer(start, model.pp_cost(start)[1])]
    probes = [states[0]]
    if racers:  # the start only calibrates: more random layouts with it (`CALIBRATION_LAYOUTS`)
        layouts = [random_placement(model.workload, rng) for _ in range(CALIBRATION_LAYOUTS - 1)]
        probes += [racer(layout, model.pp_cost(layout)[1]) for layout in layouts]  # ordered as the start
    temperature = calibrate(probes)
    first, last = temperature * hot, temperature * cool_to
    states[0].run(1, first, first, ORDER_SHARE)  # compiles on a fresh install: not part of the pace
    tick = clock()
    states[0].run(PACE_PROPOSALS, first, first, ORDER_SHARE)
    rate = PACE_PROPOSALS / max(clock() - tick, 1e-6)
    budget = budget_s - (clock() - started)
    if racers:
        states = [racer(layout, model.pp_cost(layout)[1]) for layout in racers]
    else:
        states += [
            racer(random_placement(model.workload, rng), tuple(range(stages)))
            for _ in range(1, racer_count(budget * rate, model.num_devices))
        ]
    rounds = race_rounds(len(states), halve_at)
    units = sum(length * count for _, length, count in rounds)
    chunk, proposals, ran = 1_000, 1 + PACE_PROPOSALS, 0
    for lo, length, count in rounds:
        if ran >= max_rounds or out_of_time():
            break
        states = sorted(states, key=lambda st: st.best_cost)[:count]
        span = max(budget * length * count / units, 1e-6)
        opened = clock()
        done = pace = 0.0
        while done < 1.0 and not out_of_time():
            tick = clock()
            at = lo + length * done
            ahead = lo + length * min(1.0, done + pace)  # where these chunks should end, at the last pace
            slope_now = slope_at(at, hot_slope, cool_slope)
            for st in states:
                st.set_slope(slope_now)
                st.run(chunk, first * (last / first) ** at, first * (last / first) ** ahead, ORDER_SHARE)
            proposals += chunk * len(states)
            spent = (clock() - tick) / len(states)
            chunk = int(min(max(chunk * 0.02 / max(spent, 1e-4), 100), 200_000))
            pace = spent * len(states) / span
            done = (clock() - opened) / span
            note((min(st.best_cost for st in states), 0.0))
        ran += 1
    best = min(states, key=lambda st: st.best_cost)
    return RaceOutcome(placement=best.best_placement(), rounds=ran, proposals=proposals)
