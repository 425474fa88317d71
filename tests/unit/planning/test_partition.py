from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import (
    InfeasiblePlan,
    JobParams,
    evaluate_partition,
    layer_memory_bytes,
    model_memory_bytes,
    partition_layers,
)
from tests.unit.planning.helpers import random_layers, random_peers

JOB = JobParams(micro_batch_size=8, max_in_flight=2, memory_headroom=1.1)


def brute_force(peers, layers, job):
    """Every way to cut n layers into len(peers) non-empty ranges; the min-max feasible one."""
    best = None
    for cuts in itertools.combinations(range(1, len(layers)), len(peers) - 1):
        times, memory = evaluate_partition(peers, layers, job, cuts)
        if all(m <= p.memory_bytes for m, p in zip(memory, peers, strict=True)):
            best = max(times) if best is None else min(best, max(times))
    return best


def test_layer_memory_counts_params_grads_optimizer_stash_and_activations() -> None:
    layer = random_layers(np.random.default_rng(0), 1)[0]
    job = JobParams(micro_batch_size=4, max_in_flight=3, memory_headroom=1.0)
    # live + 3 stashed versions + 1 gradient; activations of 3 micro-batches of 4 samples
    expected = layer.param_bytes * 5 + layer.optimizer_state_bytes + layer.activation_bytes_per_sample * 4 * 3
    assert layer_memory_bytes(layer, job) == expected
    assert layer_memory_bytes(layer, job.model_copy(update={"memory_headroom": 2.0})) == 2 * expected


@pytest.mark.parametrize("seed", range(40))
def test_partition_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, int(rng.integers(3, 9)))
    need = model_memory_bytes(layers, JOB)
    num_stages = int(rng.integers(1, min(4, len(layers)) + 1))
    # Memory between "barely anything" and "whole model": some cases are infeasible on purpose.
    peers = random_peers(rng, num_stages, (need // 6, need + 1))
    expected = brute_force(peers, layers, JOB)
    if expected is None:
        with pytest.raises(InfeasiblePlan):
            partition_layers(peers, layers, JOB)
        return
    cuts, bottleneck = partition_layers(peers, layers, JOB)
    assert bottleneck == pytest.approx(expected, rel=1e-12)
    times, memory = evaluate_partition(peers, layers, JOB, cuts)
    assert max(times) == pytest.approx(bottleneck, rel=1e-12)
    assert all(m <= p.memory_bytes for m, p in zip(memory, peers, strict=True))


def test_partition_avoids_cutting_at_heavy_activations() -> None:
    rng = np.random.default_rng(1)
    base = random_layers(rng, 4)
    heavy = [
        layer.model_copy(
            update={"flops_per_sample": 1e6, "activation_bytes_per_sample": 10_000_000 if i == 1 else 10}
        )
        for i, layer in enumerate(base)
    ]
    peers = random_peers(rng, 2, (10**12, 10**12 + 1))
    cuts, _ = partition_layers(peers, heavy, JOB)
    assert cuts != (2,)  # cutting after layer 1 would ship its huge output


def test_more_stages_than_layers_is_infeasible() -> None:
    rng = np.random.default_rng(2)
    with pytest.raises(InfeasiblePlan):
        partition_layers(random_peers(rng, 3, (10**12, 10**12 + 1)), random_layers(rng, 2), JOB)
