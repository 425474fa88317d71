from __future__ import annotations

import numpy as np
import pytest

from ravnest_p2p.planning import (
    JobParams,
    PeerCapacity,
    cluster_peers,
    homogeneity,
    model_memory_bytes,
    peer_features,
)
from tests.unit.planning.helpers import random_layers, random_peers

JOB = JobParams(micro_batch_size=4, max_in_flight=2, spare_ratio=0.0)


def _tiered_population(rng: np.random.Generator, count: int, memory_bytes: int) -> list[PeerCapacity]:
    """Three hardware tiers (laptop, workstation, server) with 20 % jitter on every number."""
    tiers = [(1e11, 2e6), (1e12, 2e7), (1e13, 2e8)]
    peers = []
    for i in range(count):
        flops, link = tiers[int(rng.integers(3))]
        jitter = rng.uniform(0.8, 1.2, 3)
        peers.append(
            PeerCapacity(
                peer_id=f"p{i:03d}",
                flops_per_s=flops * jitter[0],
                memory_bytes=memory_bytes,
                upload_bytes_per_s=link * jitter[1],
                download_bytes_per_s=link * jitter[2],
            )
        )
    return peers


@pytest.mark.parametrize("seed", range(25))
def test_every_cluster_holds_the_whole_model(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, int(rng.integers(4, 12)))
    need = model_memory_bytes(layers, JOB)
    peers = random_peers(rng, int(rng.integers(1, 30)), (need // 8, need))
    clusters, spares = cluster_peers(peers, layers, JOB, epoch=seed)
    for cluster in clusters:
        assert sum(p.memory_bytes for p in cluster) >= need
    placed = [p.peer_id for c in clusters for p in c] + [p.peer_id for p in spares]
    assert sorted(placed) == sorted(p.peer_id for p in peers)  # everyone is placed exactly once
    # The number of clusters is as large as memory allows: no leftover set of spares could form one.
    if clusters:
        assert sum(p.memory_bytes for p in spares) < need or JOB.spare_ratio > 0


def test_too_little_memory_makes_everyone_a_spare() -> None:
    rng = np.random.default_rng(0)
    layers = random_layers(rng, 4)
    peers = random_peers(rng, 3, (1, 10))
    assert cluster_peers(peers, layers, JOB, epoch=0) == ((), tuple(sorted(peers, key=lambda p: p.peer_id)))


@pytest.mark.parametrize("seed", range(5))
def test_clusters_are_more_homogeneous_than_random_groupings(seed: int) -> None:
    """Measure: mean squared distance of a peer to its cluster centroid in standardised log
    (FLOP/s, link) space. On a three-tier population ours must be under half of random groupings'
    (same cluster sizes, 20 shuffles); in practice it is ~5-10x lower."""
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, 6)
    need = model_memory_bytes(layers, JOB)
    peers = sorted(_tiered_population(rng, 36, need // 4 + 1), key=lambda p: p.peer_id)
    clusters, spares = cluster_peers(peers, layers, JOB, epoch=seed)
    assert not spares
    assert len(clusters) >= 3
    features = peer_features(peers)
    index = {p.peer_id: i for i, p in enumerate(peers)}
    labels = np.empty(len(peers), dtype=int)
    for c, cluster in enumerate(clusters):
        labels[[index[p.peer_id] for p in cluster]] = c
    ours = homogeneity(features, labels)
    shuffled = np.mean([homogeneity(features, rng.permutation(labels)) for _ in range(20)])
    assert ours < 0.5 * shuffled


def test_cluster_throughputs_are_balanced_on_a_uniform_population() -> None:
    rng = np.random.default_rng(7)
    layers = random_layers(rng, 6)
    need = model_memory_bytes(layers, JOB)
    peers = _tiered_population(rng, 30, need // 3 + 1)
    peers = [p.model_copy(update={"flops_per_s": 1e12 * rng.uniform(0.9, 1.1)}) for p in peers]
    clusters, _ = cluster_peers(peers, layers, JOB, epoch=0)
    throughput = [sum(p.flops_per_s for p in c) for c in clusters]
    assert max(throughput) / min(throughput) < 1.6


def test_laggard_cluster_waits_as_spare() -> None:
    rng = np.random.default_rng(8)
    layers = random_layers(rng, 6)
    need = model_memory_bytes(layers, JOB)
    fast = [
        PeerCapacity(
            peer_id=f"fast{i}",
            flops_per_s=1e12,
            memory_bytes=need,
            upload_bytes_per_s=1e8,
            download_bytes_per_s=1e8,
        )
        for i in range(3)
    ]
    slow = fast[0].model_copy(update={"peer_id": "slow", "flops_per_s": 1e9})
    job = JOB.model_copy(update={"spare_ratio": 0.25})
    clusters, spares = cluster_peers([*fast, slow], layers, job, epoch=0)
    assert [p.peer_id for p in spares] == ["slow"]
    assert sum(len(c) for c in clusters) == 3


def test_duplicate_peer_ids_are_rejected() -> None:
    rng = np.random.default_rng(9)
    peers = random_peers(rng, 2, (1, 2))
    with pytest.raises(ValueError, match="duplicate"):
        cluster_peers([peers[0], peers[0]], random_layers(rng, 2), JOB, epoch=0)


def test_laggard_inside_a_cluster_waits_as_spare() -> None:
    rng = np.random.default_rng(9)
    layers = random_layers(rng, 6)
    need = model_memory_bytes(layers, JOB)
    fast = [
        PeerCapacity(
            peer_id=f"fast{i}",
            flops_per_s=1e12,
            memory_bytes=need // 3 + 1,
            upload_bytes_per_s=1e8,
            download_bytes_per_s=1e8,
        )
        for i in range(4)
    ]
    slow = fast[0].model_copy(update={"peer_id": "slow", "upload_bytes_per_s": 1e5})
    job = JOB.model_copy(update={"spare_ratio": 0.25})
    clusters, spares = cluster_peers([slow, *fast], layers, job, epoch=0)
    assert [p.peer_id for p in spares] == ["slow"]
    assert [[p.peer_id for p in c] for c in clusters] == [["fast0", "fast1", "fast2", "fast3"]]
    # Without the spare policy the slow peer is kept (the cluster needs no more memory, but it is allowed).
    clusters, spares = cluster_peers([slow, *fast], layers, JOB, epoch=0)
    assert spares == ()
