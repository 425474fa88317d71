from __future__ import annotations

import numpy as np
import pytest

from ravnest_p2p.planning import JobParams, layer_memory_bytes, make_plan, model_memory_bytes
from ravnest_p2p.planning.cluster_plans import cluster_plan, fixed_cluster_plan
from tests.unit.planning.helpers import random_layers, random_peers

JOB = JobParams(micro_batch_size=4, max_in_flight=3)


def _population(seed: int):
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, int(rng.integers(4, 10)))
    need = model_memory_bytes(layers, JOB)
    peers = random_peers(rng, int(rng.integers(2, 16)), (need // 4, need // 2))
    return rng, layers, peers


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_identical_under_shuffled_inputs(seed: int) -> None:
    rng, layers, peers = _population(seed)
    reference = make_plan(peers, layers, JOB, epoch=3)
    for _ in range(3):
        shuffled = [peers[i] for i in rng.permutation(len(peers))]
        plan = make_plan(shuffled, layers, JOB, epoch=3)
        assert plan == reference
        assert plan.digest() == reference.digest()


def test_digest_depends_on_content() -> None:
    _, layers, peers = _population(1)
    assert make_plan(peers, layers, JOB, epoch=1).digest() != make_plan(peers, layers, JOB, epoch=2).digest()


@pytest.mark.parametrize("seed", range(20))
def test_plan_respects_memory_and_covers_the_model(seed: int) -> None:
    _, layers, peers = _population(seed)
    plan = make_plan(peers, layers, JOB, epoch=seed)
    by_id = {p.peer_id: p for p in peers}
    assigned = [pid for cluster in plan.clusters for pid in cluster.peer_ids]
    assert sorted(assigned + list(plan.spare_peer_ids)) == sorted(by_id)
    for cluster in plan.clusters:
        assert cluster.stages[0].first_layer == 0
        assert cluster.stages[-1].last_layer_exclusive == len(layers)
        for before, after in zip(cluster.stages, cluster.stages[1:], strict=False):
            assert before.last_layer_exclusive == after.first_layer
        for stage in cluster.stages:
            need = sum(
                layer_memory_bytes(layer, JOB)
                for layer in layers[stage.first_layer : stage.last_layer_exclusive]
            )
            assert stage.memory_bytes == need <= by_id[stage.peer_id].memory_bytes
        assert cluster.bottleneck_s == pytest.approx(max(s.stage_time_s for s in cluster.stages))


def test_swarm_without_enough_memory_has_only_spares() -> None:
    rng = np.random.default_rng(0)
    layers = random_layers(rng, 4)
    peers = random_peers(rng, 3, (1, 10))
    plan = make_plan(peers, layers, JOB, epoch=0)
    assert plan.clusters == ()
    assert len(plan.spare_peer_ids) == 3


@pytest.mark.parametrize("seed", range(12))
def test_a_fresh_cluster_plan_is_its_fixed_plan_with_the_dp_bottleneck(seed: int) -> None:
    """`cluster_plan` prices its order and cuts through `fixed_cluster_plan`: same stages, and the
    DP's bottleneck, which differs from the largest stage time by a few ulps at most."""
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, int(rng.integers(3, 12)))
    peers = random_peers(rng, int(rng.integers(1, 4)), (10**7, 10**8))
    fresh = cluster_plan(0, peers, layers, JOB, None)
    by_id = {p.peer_id: p for p in peers}
    order = [by_id[pid] for pid in fresh.peer_ids]
    fixed = fixed_cluster_plan(0, order, [s.first_layer for s in fresh.stages[1:]], layers, JOB, None)
    assert fixed.stages == fresh.stages
    assert [s.memory_bytes for s in fresh.stages] == [
        sum(layer_memory_bytes(layer, JOB) for layer in layers[s.first_layer : s.last_layer_exclusive])
        for s in fresh.stages
    ]
    assert fixed.bottleneck_s == pytest.approx(fresh.bottleneck_s, rel=1e-12)
