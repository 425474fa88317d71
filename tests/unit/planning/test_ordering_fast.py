"""The pruned, shared-work stage ordering returns exactly what the plain enumeration returned."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import InfeasiblePlan, JobParams, order_stages, partition_layers
from tests.unit.planning.helpers import heterogeneous_peers, random_layers, random_peers

JOB = JobParams(micro_batch_size=4)


def _plain_order_stages(peers, layers, job):
    """The enumeration `order_stages` shipped before the speed-up (reference)."""
    ordered = sorted(peers, key=lambda p: p.peer_id)
    best, best_order = None, ()
    if len(ordered) <= 6:
        for perm in itertools.permutations(ordered):
            try:
                cuts, value = partition_layers(perm, layers, job)
            except InfeasiblePlan:
                continue
            if best is None or value < best[0]:
                best, best_order = (value, cuts), perm
    else:
        current = sorted(ordered, key=lambda p: (-p.link_bytes_per_s, p.peer_id))
        try:
            cuts, value = partition_layers(current, layers, job)
            best = (value, cuts)
        except InfeasiblePlan:
            best = None
        best_order = tuple(current)
        for _ in range(50):
            improved = False
            for i, j in itertools.combinations(range(len(current)), 2):
                trial = list(best_order)
                trial[i], trial[j] = trial[j], trial[i]
                try:
                    cuts, value = partition_layers(trial, layers, job)
                except InfeasiblePlan:
                    continue
                if best is None or value < best[0]:
                    best, best_order, improved = (value, cuts), tuple(trial), True
            if not improved:
                break
    if best is None:
        raise InfeasiblePlan("none")
    return best_order, best[1], best[0]


@pytest.mark.parametrize("seed", range(40))
def test_same_order_cuts_and_bottleneck_as_plain_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 9))
    layers = random_layers(rng, int(rng.integers(size, 14)))
    if seed % 3 == 0:
        peers = heterogeneous_peers(rng, size, 1e-3)
    else:
        peers = random_peers(rng, size, (200_000, 3_000_000) if seed % 2 else (10**12, 10**12 + 1))
    try:
        expected = _plain_order_stages(peers, layers, JOB)
    except InfeasiblePlan:
        with pytest.raises(InfeasiblePlan):
            order_stages(peers, layers, JOB)
        return
    order, cuts, bottleneck = order_stages(peers, layers, JOB)
    assert [p.peer_id for p in order] == [p.peer_id for p in expected[0]]
    assert cuts == expected[1]
    assert bottleneck == expected[2]


def test_order_is_independent_of_input_order() -> None:
    rng = np.random.default_rng(7)
    layers = random_layers(rng, 10)
    peers = random_peers(rng, 5, (10**12, 10**12 + 1))
    first = order_stages(peers, layers, JOB)
    assert order_stages(list(reversed(peers)), layers, JOB) == first
