"""The mixes-first search of noisy networks with a few sites: site mixes, then a refine of their fillings.

`mix_racers` searches the stage groups' site mixes (`dtfm_mix.search_mixes`: how many devices of each
site every group holds, scored by an estimate over the sites' links) and fills the best of them with
random devices of those sites; `dtfm_search` races those fillings (`dtfm_race.race`) on the schedule of
`refine_schedule`. The knobs below carry the measurements behind them (60 s CPU runs of the generated
hard cases, `benchmarks/placement_cases.py`; ratios to their long-run references; the sessions' summaries
are in `docs/planning-placement.md`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ravnest_p2p.planning.dtfm import CostModel, Placement

if TYPE_CHECKING:
    from ravnest_p2p.planning.dtfm_mix import MixCandidate

__all__ = ["MixStart", "RefineSchedule", "mix_racers", "refine_schedule"]

# Noisy networks with a few sites: site mixes first (`dtfm_mix`), in this share of the budget by this
# many racing mix annealers; the best mixes (this many, filled with random devices) race from this
# fraction of the calibrated temperature to that one with this share of same-site swaps. Session 17: 8
# mix annealers (with the edge memo of `dtfm_mix`) and one filling cooled to 0.005x, not two to 0.001x
# (whose survivor never improved after the halving, 12 of 12 traced runs). Session 19: on every layout,
# not only wide groups (60 s CPU; `hard-16x8-s0`: 1.009x mean, 13 of 14 <= 1.02x, against the plain
# race's 1.017x, 7 of 12; `hard-8x8-s0`: a deeper basin, 2% below the old reference, in 3 of 12 runs,
# which the plain race never reached in 60+ runs).
_MIX_SHARE = 0.25
_MIX_ANNEALERS = 8
# ... and this many below `_MIX_FEW_DEVICES` devices (session 19, the mix search alone, 15 CPU-s, seeds 0-3:
# on `hard-8x8-s0` 8 annealers never reached the deep basin's mix (score 50.94; they stop at 52.21), 16 did
# in 2 of 4, 32 in 3 of 4; on `hard-16x8-s0` 32 were worse than 8: 58.61 / 57.61 / 57.94 / 58.62 against
# 57.76 / 57.85 / 57.93 / 57.87, and session 17 found 8 best on 8x16).
_MIX_ANNEALERS_FEW = 32
_MIX_FEW_DEVICES = 128
# ... and this many with wide groups (session 23, `hard-8x16-s0`, 15 CPU-s: the best mix, 41.4, in 25 of 32
# searches with 8 annealers, 19 of 23 with 16, 29 of 32 with 32; full 60 s runs with 32, seeds 80-91: 10 of 12
# found it, ratios 1.0031-1.0065, the others 1.0182 (42.08) and 1.0556 (42.95): 11 of 12 <= 1.02x, against
# 10 of 12 with 8, of which 8 found it). Weak evidence, but no worse anywhere measured.
_MIX_ANNEALERS_WIDE = 32
# ... in this share of the budget (session 21, the mix search alone at slope 0.3 on `hard-8x8-s0`, seeds
# 300-319: 15 CPU-s reached the deep mix in 17 of 20, 22.5 s in 19, 30 s in 20; 64 annealers in 15 s: 15
# of 20). A refine of 64 devices finds its best in 20-25 CPU-s (it freezes by half of its cooling).
_MIX_SHARE_FEW = 0.5
# ... with this slope on the mean group all-reduce in the mix energy (`dtfm_mix.MIX_SLOPE`, 1.0, above).
# Session 20: 1.0 ranked the shallow `hard-8x8-s0` mix (score 52.21: three groups of 7 from its largest
# city) *below* the deep one (50.94: five groups of 5, every all-reduce slow) that the estimate ranks first
# (`test_dtfm_mix`). The mix search alone (15 CPU-s, 32 annealers, seeds 5-12) reached 50.94 in 4 of 8
# with 1.0, 8 of 8 with 0.3 (and 4 more of 4) or 0; a slope falling from 1.0 to 0.1: 4 of 7. Full 60 s
# runs with 0.3: the deep mix in 17 of 19. On `hard-8x16-s0` 0.3 is worse: its best mix in 9 of 18 full
# runs (ratio mean 1.025) against 8 of 8 with 1.0 (1.014); 16x8: 1.013 mean (11 runs), as with 1.0.
# (Ratios to the references of the time: 57.235, 68.768 and 45.442 s.)
_MIX_SLOPE_FEW = 0.3
# The refine races fillings of this many of the best distinct mixes (halved at half of its cooling: the
# basin is chosen by then, ~0.02x the calibrated temperature, where a refine freezes), one with wide groups.
# Session 21, `hard-16x8-s0` (refine at slope 0.3, ratios to the 67.971 s reference): one mix, seeds 40-55,
# mean 1.0164, 10 of 16 <= 1.02; two 1.0081 1.0143 1.0063 1.0135 1.026 1.0064 1.0034 1.0164 1.0093 1.0118
# 1.0143 1.0162 1.0249 1.014 1.0106 1.0638 1.0188 1.0114 1.0058 1.0073 1.0045 1.0134 1.0095 1.0133 (seeds
# 40-63): mean 1.0143, 21 of 24 (the 1.0249 and 1.0638 from missed mixes, scores 59.75 and 60.2 against
# 57.6-58.9). `hard-8x16-s0` with two: 1.0344 1.0411 1.0156 1.0584 1.0225 1.0048 1.0206 1.0171 (seeds
# 40-47; one: 1.0088 1.0087 1.0149 1.0045 1.0124 1.0098 1.0315 1.0043).
_MIX_RACERS = 2
_MIX_RACERS_WIDE = 1
# ... but only a mix that scores within this fraction of the best: the estimate cannot tell those apart,
# and the refine reshapes their lanes anyway. Further apart the better estimate is the one to refine
# (`hard-8x8-s0`: the deep mix 50.94 against the shallow 52.21, 2.5%; session 21 with two racing: 1.0379
# once, the deep mix raced and lost at the halving; with one, none of 15 runs that found the deep mix).
_MIX_RACE_GAP = 0.01
# Each raced mix races this many random fillings (with wide groups: the second), the first halving at this
# progress through the cooling (None: at 1/2, 3/4, ...; `dtfm_race.race_rounds`), the next ones at its
# doubles. Session 22, the refine alone of the `hard-8x16-s0` reference's mix (random fillings, 0.05x ->
# 0.005x, slope 0.3): most fillings freeze by 10-20% of the cooling, and where they freeze is the lottery
# -- 15 M proposals: 6 of 29 fillings ended above 1.02x (1.0215-1.0533), 30 M: 4 of 13; each one's
# cost at 10% of the cooling already ranks it (best of 4 at 10%, bootstrapped: none above 1.02x).
_MIX_FILLINGS = 1
_MIX_FILLINGS_WIDE = 4
_MIX_HALVE_AT: float | None = None
_MIX_HALVE_AT_WIDE: float | None = 0.1
# The refine starts at this fraction of the calibrated temperature; with wide groups (>= `_WIDE_REPLICAS`
# replicas) at the second. Session 20, `hard-16x8-s0` (ratios to the 67.971 s reference): 0.05 1.0394
# 1.0277 1.0221 1.0278 (seeds 20-23; benchmark seeds 0-2: 1.0169 1.0805 1.0392); 0.1 1.0202 1.0039
# 1.0131 1.0036 1.0107 1.0245 1.0258 1.0226 (seeds 20-27: mean 1.016, 3 of 8 <= 1.02); 0.2 1.0188 1.0245
# 1.0138 1.0642; 0.02 1.0303 1.0511 1.028 1.0269. `hard-8x8-s0` at 0.1: 1.0073 1.0 1.013 (0.05: 1.0108
# 1.0135 1.011, seeds 10-12); `hard-8x16-s0` at 0.1: 1.0191 1.0191 1.0113 (0.05: 1.0124 1.0121 1.0064,
# seeds 10-12): it stays.
_MIX_REFINE_START = 0.1
_MIX_REFINE_START_WIDE = 0.05
_MIX_REFINE_COOL = 0.005
# The refine's slope on the mean group all-reduce (constant: the plain race's falling slope, `dtfm_race`,
# was measured without mixes). Session 20 set 0.3 below 128 devices (`hard-8x8-s0`, seeds 10-17: 1.0 1.0129
# 1.0038 1.0116 1.0108 1.0 1.0152 1.0003 1.0241; 0.3 1.0108 1.0135 1.011 1.0108 1.0108 1.0108 1.0108
# 1.0121). Session 21, everywhere: a refine of the 16x8 reference's own mix (40 M proposals from 0.1x to
# 0.005x, seeds 0-7) reached 1.0196x the reference at slope 1.0 (mean), 1.0121 at 0.3, 1.0147 at 0; full
# 60 s runs of `hard-8x16-s0`: 1.0 1.0253 1.0378 1.0082 1.0052 1.0205 1.007 1.0481 1.0143 (seeds 40-47,
# mean 1.021, 4 of 8 <= 1.02), 0.3 1.0088 1.0087 1.0149 1.0045 1.0124 1.0098 1.0315 1.0043 1.0097 1.0023
# 1.0109 1.0043 1.0028 1.0092 1.0075 1.0153 (seeds 40-55: 1.010, 15 of 16); `hard-16x8-s0` (one mix,
# seeds 40-47): 1.0 mean 1.017 (7 of 8), 0.3 1.016 (5 of 8).
_MIX_REFINE_SLOPE = 0.3
_SAME_SITE_SHARE = 0.5
_MAX_MIX_SITES = 16


@dataclass(frozen=True)
class MixStart:
    """What the mix search hands the refine: the racing fillings (a power of two of them; none without
    2-16 sites), the site label of every device, and the best filling scored while mixes were searched."""

    racers: tuple[Placement, ...]
    labels: np.ndarray | None
    filled: Placement | None


@dataclass(frozen=True)
class RefineSchedule:
    """The refine's race (`dtfm_race.race` arguments): its temperatures as fractions of the calibrated
    one, the energy's slope on the mean group all-reduce (as the cooling starts and ends), the first
    halving's progress (None: at 1/2) and the share of swaps inside a site."""

    hot: float
    cool_to: float
    slope: tuple[float, float]
    halve_at: float | None
    same_site_share: float


def refine_schedule(*, wide: bool) -> RefineSchedule:
    """The refine's schedule; ``wide``: >= 16 replicas per stage (`dtfm_search._WIDE_REPLICAS`)."""
    return RefineSchedule(
        hot=_MIX_REFINE_START_WIDE if wide else _MIX_REFINE_START,
        cool_to=_MIX_REFINE_COOL,
        slope=(_MIX_REFINE_SLOPE, _MIX_REFINE_SLOPE),
        halve_at=_MIX_HALVE_AT_WIDE if wide else _MIX_HALVE_AT,
        same_site_share=_SAME_SITE_SHARE,
    )


def _few_devices(model: CostModel) -> bool:
    """Below `_MIX_FEW_DEVICES`: 32 mix annealers, `_MIX_SHARE_FEW` of the budget, and slope
    `_MIX_SLOPE_FEW` in the mix energy."""
    return model.num_devices < _MIX_FEW_DEVICES


def mix_racers(
    model: CostModel,
    seed: int,
    budget_s: float,
    rng: np.random.Generator,
    out_of_time: Callable[[], bool],
    clock: Callable[[], float],
    note: Callable[[tuple[float, float]], None],
    *,
    wide: bool,
) -> MixStart:
    """Fillings of the best site mixes (`dtfm_mix`), the site labels, and the best filling scored on the
    way (searching ``budget_s`` x this module's share); none without 2-16 sites.

    While mixes are searched, a random filling of the best mix so far is scored exactly and noted (so
    the best-so-far curve moves during the mix search); the cheapest of those is returned. The
    fillings draw from a generator of their own: the search's random stream is the same with or
    without them."""
    from ravnest_p2p.planning.dtfm_mix import MIX_SLOPE, fill_mix, search_mixes
    from ravnest_p2p.planning.dtfm_sites import find_cities

    labels = find_cities(model)
    if not 2 <= int(labels.max()) + 1 <= _MAX_MIX_SITES:
        return MixStart((), None, None)
    side = np.random.default_rng([seed, 1])
    filled: list[tuple[float, Placement]] = []

    def on_best(counts: np.ndarray) -> None:
        placement = fill_mix(labels, counts, side)
        cost = model.cost(placement)
        if not filled or cost < filled[0][0]:
            filled[:] = [(cost, placement)]
        note((cost, 0.0))

    few = _few_devices(model)
    span = (_MIX_SHARE_FEW if few else _MIX_SHARE) * budget_s
    found = search_mixes(
        model, labels, rng, span_s=span, racers=_mix_annealers(few=few, wide=wide), clock=clock,
        out_of_time=out_of_time, slope=_MIX_SLOPE_FEW if few else MIX_SLOPE, on_best=on_best,
    )  # fmt: skip
    chosen = _raced_mixes(found, wide=wide)
    fillings = _MIX_FILLINGS_WIDE if wide else _MIX_FILLINGS
    racers = tuple(fill_mix(labels, c.counts, rng) for c in chosen for _ in range(fillings))
    return MixStart(racers, labels, filled[0][1] if filled else None)


def _mix_annealers(*, few: bool, wide: bool) -> int:
    """How many mix annealers race: `_MIX_ANNEALERS_FEW` below `_MIX_FEW_DEVICES` devices, else
    `_MIX_ANNEALERS_WIDE` with wide groups, else `_MIX_ANNEALERS`."""
    return _MIX_ANNEALERS_FEW if few else (_MIX_ANNEALERS_WIDE if wide else _MIX_ANNEALERS)


def _raced_mixes(found: Sequence[MixCandidate], *, wide: bool) -> list[MixCandidate]:
    """The mixes whose fillings race in the refine: the best of ``found`` (sorted by score), and on narrow
    groups the next distinct one too when it scores within `_MIX_RACE_GAP` of it (a power of two of them)."""
    distinct = [c for k, c in enumerate(found) if k == 0 or c.score > found[k - 1].score]
    chosen = [
        c
        for c in distinct[: _MIX_RACERS_WIDE if wide else _MIX_RACERS]
        if c.score <= distinct[0].score * (1.0 + _MIX_RACE_GAP)
    ]
    while len(chosen) & (len(chosen) - 1):
        chosen.pop()
    return chosen
