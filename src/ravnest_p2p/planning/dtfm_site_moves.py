"""Compound moves of the annealer (`dtfm_anneal`) on networks with sites (co-located devices).

Single swaps cannot cross the plateaus the cost's maxima make on such networks: a pipeline edge stays
as slow as its slowest pair until every replica's pair across it is co-located. Each move here is a
sequence of swaps applied to a `SwapState` and accepted or undone as a whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ravnest_p2p.planning.dtfm_anneal import SwapState

__all__ = ["even_out_site", "spread_site"]


def spread_site(state: SwapState, sites: list[list[int]], rng: np.random.Generator, threshold: float) -> bool:
    """Spread a random site over consecutive path positions (a compound of swaps); undo unless accepted.

    This is the move that lines co-located devices up as consecutive stages of one pipeline, which
    single swaps cannot reach on plateaus: every edge stays as slow as its slowest pair until all the
    replicas' pairs across it are co-located.
    """
    site = sites[int(rng.integers(len(sites)))]
    members = set(site)
    order = state.order
    span = min(len(site), len(order))
    first = int(rng.integers(len(order) - span + 1))
    devices = [site[int(i)] for i in rng.permutation(len(site))[:span]]
    before = state.energy
    done: list[tuple[int, int]] = []
    for device, group in zip(devices, order[first : first + span], strict=True):
        if state.group_of[device] == group:
            continue
        partners = [d for d in state.groups[group] if d not in members]
        if not partners:
            continue
        partner = partners[int(rng.integers(len(partners)))]
        state.apply(state.propose(device, partner))
        done.append((device, partner))
    return _keep_or_undo(state, done, before, threshold)


def even_out_site(
    state: SwapState,
    sites: list[list[int]],
    site_of: np.ndarray,
    rng: np.random.Generator,
    threshold: float,
) -> bool:
    """Give each group of a stretch of the path one device of a site, taken from where it is doubled.

    The other compound move for plateaus (see `spread_site`), for layouts with a site twice in some
    groups and missing from others: a pipeline edge between such groups cannot pair every replica
    inside its site, and repairing it one swap at a time first adds a second misaligned edge. Every
    group of the stretch that lacks the site receives one of its devices from a group holding two or
    more (or from outside the stretch) and sends back a device whose own site is doubled there, so
    both groups end more even. Accepted or undone as a whole. Session 12: ``datacenter_on_demand``
    without the structure starts sat at 1.26x the best known on some seeds, in layouts of two kinds
    of groups (one machine twice and another missing, and the reverse), one misaligned edge apart.
    """
    pick = int(rng.integers(len(sites)))
    site = sites[pick]
    order = state.order
    span = min(len(site), len(order))
    first = int(rng.integers(len(order) - span + 1))
    targets = order[first : first + span]
    inside = set(targets)
    before = state.energy
    done: list[tuple[int, int]] = []
    for group in targets:
        holders = state.group_of[site]
        if np.any(holders == group):
            continue
        counts = np.bincount(holders, minlength=len(state.groups))
        donors = [d for d, g in zip(site, holders, strict=True) if counts[g] >= 2 or int(g) not in inside]
        members = state.groups[group]
        tags = site_of[members]
        doubled = [
            d for d, t in zip(members, tags, strict=True) if t >= 0 and t != pick and (tags == t).sum() >= 2
        ]
        pool = doubled or [d for d, t in zip(members, tags, strict=True) if t != pick]
        if not donors or not pool:
            continue
        device = donors[int(rng.integers(len(donors)))]
        partner = pool[int(rng.integers(len(pool)))]
        state.apply(state.propose(device, partner))
        done.append((device, partner))
    return _keep_or_undo(state, done, before, threshold)


def _keep_or_undo(state: SwapState, done: list[tuple[int, int]], before: float, threshold: float) -> bool:
    """Keep the swaps ``done`` if the energy rose by at most ``threshold`` since ``before``, else undo."""
    if not done:
        return False
    if state.energy - before <= threshold:
        return True
    for device, partner in reversed(done):
        state.apply(state.propose(device, partner))
    return False
