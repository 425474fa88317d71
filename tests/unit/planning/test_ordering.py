from __future__ import annotations

import itertools

import numpy as np
import pytest

from ravnest_p2p.planning import InfeasiblePlan, JobParams, PeerCapacity, order_stages, partition_layers
from tests.unit.planning.helpers import random_layers, random_peers

JOB = JobParams(micro_batch_size=4)


@pytest.mark.parametrize("seed", range(10))
def test_small_cluster_order_is_the_joint_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, 6)
    peers = random_peers(rng, 4, (10**12, 10**12 + 1))
    best = min(partition_layers(perm, layers, JOB)[1] for perm in itertools.permutations(peers))
    order, cuts, bottleneck = order_stages(peers, layers, JOB)
    assert sorted(p.peer_id for p in order) == sorted(p.peer_id for p in peers)
    assert bottleneck == pytest.approx(best, rel=1e-12)
    assert partition_layers(order, layers, JOB) == (cuts, bottleneck)


def test_slowest_uplink_goes_last() -> None:
    rng = np.random.default_rng(3)
    layers = random_layers(rng, 6)
    fast = [
        PeerCapacity(
            peer_id=f"p{i}",
            flops_per_s=1e12,
            memory_bytes=10**12,
            upload_bytes_per_s=1e9,
            download_bytes_per_s=1e9,
        )
        for i in range(3)
    ]
    slow = fast[0].model_copy(update={"peer_id": "a-slow", "upload_bytes_per_s": 1e3})
    order, _, _ = order_stages([*fast, slow], layers, JOB)
    assert order[-1].peer_id == "a-slow"


def test_large_cluster_uses_local_search_and_is_no_worse_than_sorted_start() -> None:
    rng = np.random.default_rng(4)
    layers = random_layers(rng, 12)
    peers = random_peers(rng, 8, (10**12, 10**12 + 1))
    start = sorted(peers, key=lambda p: (-p.link_bytes_per_s, p.peer_id))
    _, _, bottleneck = order_stages(peers, layers, JOB)
    assert bottleneck <= partition_layers(start, layers, JOB)[1]


def test_no_memory_anywhere_is_infeasible() -> None:
    rng = np.random.default_rng(5)
    with pytest.raises(InfeasiblePlan):
        order_stages(random_peers(rng, 2, (1, 2)), random_layers(rng, 4), JOB)
