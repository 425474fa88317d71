"""Near-linear clustering: seeding, assignment, bisection, the search over k, determinism at 1,000 peers."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_p2p.planning import (
    JobParams,
    PeerCapacity,
    cluster_peers,
    clustering,
    kmeans,
    make_plan,
    model_memory_bytes,
)
from ravnest_p2p.planning.balance import balance, objective
from ravnest_p2p.planning.clustering import _largest_feasible_k, _split_spares
from ravnest_p2p.planning.kmeans import assign_nearest, kmeans_pp_seeds, repair
from ravnest_p2p.planning.rcb import bisect_clusters
from tests.unit.planning.helpers import heterogeneous_peers, random_layers

JOB = JobParams(micro_batch_size=4, max_in_flight=2, spare_ratio=0.0)


def _swarm(seed: int, count: int, job: JobParams = JOB, memory_ratio: float = 1 / 3):
    rng = np.random.default_rng(seed)
    layers = random_layers(rng, 12)
    need = model_memory_bytes(layers, job)
    return rng, layers, need, heterogeneous_peers(rng, count, need * memory_ratio)


def _naive_seeds(features: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ the slow way: distances to every chosen centre recomputed for each new one."""
    chosen = [int(rng.integers(len(features)))]
    for _ in range(1, k):
        d2 = np.min([((features - features[c]) ** 2).sum(axis=1) for c in chosen], axis=0)
        cdf = np.cumsum(d2)
        chosen.append(min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(features) - 1))
    return features[chosen]


@pytest.mark.parametrize("seed", range(5))
def test_running_min_seeding_equals_the_naive_seeding(seed: int) -> None:
    features = np.random.default_rng(seed).normal(size=(300, 2))
    fast = kmeans_pp_seeds(features, 40, np.random.default_rng(seed))
    slow = _naive_seeds(features, 40, np.random.default_rng(seed))
    assert np.array_equal(fast, slow)
    assert len({tuple(row) for row in fast}) == 40  # a chosen point has weight 0: never drawn twice


def test_seeding_on_identical_points_still_returns_k_centres() -> None:
    features = np.ones((10, 2))
    assert kmeans_pp_seeds(features, 4, np.random.default_rng(0)).shape == (4, 2)


@pytest.mark.parametrize("chunk_cells", [7, 1 << 20])
def test_chunked_assignment_matches_brute_force(monkeypatch: pytest.MonkeyPatch, chunk_cells: int) -> None:
    monkeypatch.setattr(kmeans, "_CHUNK_CELLS", chunk_cells)
    rng = np.random.default_rng(3)
    features, centers = rng.normal(size=(500, 2)), rng.normal(size=(37, 2))
    labels, dist = assign_nearest(features, centers)
    brute = ((features[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
    assert np.array_equal(labels, np.argmin(brute, axis=1))
    assert np.allclose(dist, brute.min(axis=1))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("min_size", [1, 2, 3])
def test_bisection_clusters_are_non_empty_and_feasible_after_repair(seed: int, min_size: int) -> None:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(200, 2))
    memory = rng.integers(1, 100, size=200).astype(float)
    need = float(rng.integers(50, 400))
    k_bound = min(int(memory.sum() // need), 200 // min_size)
    repaired = 0
    for k in range(1, k_bound + 1, max(1, k_bound // 15)):
        labels = bisect_clusters(features, memory, k, need, min_size)
        assert sorted(set(labels.tolist())) == list(range(k))  # every cluster non-empty
        if repair(features, memory, labels, k, need, min_size):
            repaired += 1
            assert (np.bincount(labels, weights=memory, minlength=k) >= need).all()
            assert (np.bincount(labels, minlength=k) >= min_size).all()
    assert repaired  # k = 1 always is feasible
    with pytest.raises(ValueError, match="non-empty"):
        bisect_clusters(features, memory, 201, need, min_size)


def test_bisection_cuts_memory_evenly_between_similar_peers() -> None:
    """Two well-separated groups of equal peers and k = 2: the cut falls between the groups."""
    features = np.array([[0.0, 0.0]] * 6 + [[5.0, 5.0]] * 6) + np.linspace(0, 0.1, 12)[:, None]
    labels = bisect_clusters(features, np.full(12, 10.0), 2, 60.0, 1)
    assert labels.tolist() == [0] * 6 + [1] * 6


@pytest.mark.parametrize("boundary", [1, 2, 7, 64, 99, 100])
def test_k_search_finds_a_monotone_boundary_in_logarithmic_trials(boundary: int) -> None:
    calls: list[int] = []

    def trials(k: int) -> list[np.ndarray]:
        calls.append(k)
        return [np.zeros(1)] if k <= boundary else []

    assert _largest_feasible_k(trials, 100) == boundary  # type: ignore[arg-type]
    assert len(calls) <= 2 + int(np.ceil(np.log2(100)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_stages", [1, 2, 4])
def test_clusters_respect_memory_and_min_stages(seed: int, min_stages: int) -> None:
    job = JOB.model_copy(update={"min_stages": min_stages})
    _, layers, need, peers = _swarm(seed, 150, job)
    clusters, spares = cluster_peers(peers, layers, job, epoch=seed)
    assert clusters
    for cluster in clusters:
        assert sum(p.memory_bytes for p in cluster) >= need
        assert len(cluster) >= min_stages
    placed = sorted(p.peer_id for c in clusters for p in c) + [p.peer_id for p in spares]
    assert sorted(placed) == sorted(p.peer_id for p in peers)
    # Priority 2: no more clusters were possible by memory or by count than the boundary found.
    k_bound = min(sum(p.memory_bytes for p in peers) // need, len(peers) // min_stages)
    assert len(clusters) <= k_bound


def test_a_model_that_fits_everywhere_gives_one_cluster_per_peer_quickly() -> None:
    _, layers, _, peers = _swarm(1, 2000, memory_ratio=10.0)
    clusters, spares = cluster_peers(peers, layers, JOB, epoch=0)
    assert len(clusters) == 2000
    assert not spares


@pytest.mark.parametrize("seed", range(5))
def test_balance_never_worsens_the_objective_nor_breaks_feasibility(seed: int) -> None:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(120, 2))
    flops = 10 ** rng.uniform(11, 14, size=120)
    memory = rng.integers(1, 100, size=120).astype(float)
    k, need = 8, 150.0
    labels = np.arange(120) % k
    assert repair(features, memory, labels, k, need, 2)
    before = objective(features, flops, labels, k)
    balance(features, flops, memory, labels, k, need, 2)
    assert objective(features, flops, labels, k) <= before + 1e-12
    assert (np.bincount(labels, weights=memory, minlength=k) >= need).all()
    assert (np.bincount(labels, minlength=k) >= 2).all()


def _old_split_spares(
    cluster: list[PeerCapacity], need_bytes: float, min_size: int, ratio: float
) -> tuple[list[PeerCapacity], list[PeerCapacity]]:
    """The spare rule as it was before the rewrite (quadratic bookkeeping), for comparison."""
    if ratio <= 0:
        return cluster, []
    median_flops = float(np.median([p.flops_per_s for p in cluster]))
    median_link = float(np.median([p.link_bytes_per_s for p in cluster]))
    kept, spares = list(cluster), []
    for peer in sorted(cluster, key=lambda p: (p.flops_per_s, p.peer_id)):
        laggard = peer.flops_per_s < ratio * median_flops or peer.link_bytes_per_s < ratio * median_link
        memory_after = sum(p.memory_bytes for p in kept) - peer.memory_bytes
        if laggard and memory_after >= need_bytes and len(kept) - 1 >= min_size:
            kept.remove(peer)
            spares.append(peer)
    return kept, spares


@pytest.mark.parametrize("seed", range(20))
def test_spare_rule_is_unchanged(seed: int) -> None:
    rng, _, need, peers = _swarm(seed, int(np.random.default_rng(seed).integers(1, 25)))
    peers = sorted(peers, key=lambda p: p.peer_id)
    ratio = float(rng.choice([0.0, 0.1, 0.25, 0.5, 0.9]))
    min_size = int(rng.integers(1, 4))
    assert _split_spares(peers, need, min_size, ratio) == _old_split_spares(peers, need, min_size, ratio)


def test_kmeans_candidate_is_only_tried_when_its_table_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    _, layers, _, peers = _swarm(2, 200)
    probed: list[int] = []
    ran: list[int] = []
    original_bisect, original_runs = clustering.bisect_clusters, clustering.kmeans_runs

    def bisect_spy(features: np.ndarray, memory: np.ndarray, k: int, *args: object) -> np.ndarray | None:
        probed.append(k)
        return original_bisect(features, memory, k, *args)  # type: ignore[arg-type]

    def runs_spy(
        features: np.ndarray, k: int, rng: np.random.Generator, **kwargs: object
    ) -> list[np.ndarray]:
        ran.append(k)
        return original_runs(features, k, rng, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(clustering, "bisect_clusters", bisect_spy)
    monkeypatch.setattr(clustering, "kmeans_runs", runs_spy)
    monkeypatch.setattr(clustering, "KMEANS_MAX_CELLS", 200 * 50)
    cluster_peers(peers, layers, JOB, epoch=0)
    assert max(probed) > 50  # both sides of the limit were probed
    assert ran
    assert ran == [k for k in probed if k <= 50]


def test_thousand_peer_plans_agree_under_shuffled_input_order() -> None:
    """Every peer computes the plan from its own copy of the view, in whatever order it holds it."""
    rng, layers, _, peers = _swarm(11, 1000, memory_ratio=1.0)
    job = JOB.model_copy(update={"spare_ratio": 0.25})
    reference = make_plan(peers, layers, job, epoch=5)
    assert len(reference.clusters) > 100
    for _ in range(2):
        shuffled = [peers[i] for i in rng.permutation(len(peers))]
        assert make_plan(shuffled, layers, job, epoch=5).digest() == reference.digest()


def test_thousand_peer_clusterings_with_kmeans_trials_agree_under_shuffled_input_order() -> None:
    """Clusters of ~5 peers: the search probes k-means (k * n small) as well as the bisection."""
    rng, layers, _, peers = _swarm(12, 1000)
    reference = cluster_peers(peers, layers, JOB, epoch=5)
    assert len(reference[0]) * 1000 < 2 * clustering.KMEANS_MAX_CELLS
    shuffled = [peers[i] for i in rng.permutation(len(peers))]
    assert cluster_peers(shuffled, layers, JOB, epoch=5) == reference
