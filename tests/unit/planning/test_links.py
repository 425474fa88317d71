"""The measured link matrix: building, hostile reports, estimates, and what it changes in a plan."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from ravnest_p2p.planning import (
    DEFAULT_LATENCY_S,
    JobParams,
    LinkMatrix,
    LinkReport,
    PeerCapacity,
    cluster_peers,
    make_plan,
    order_stages,
)
from ravnest_p2p.planning.sites import split_sites
from ravnest_p2p.types import LayerProfile
from tests.unit.planning.helpers import random_layers, random_peers

MB = 1e6


def peer(peer_id: str, *, up: float = 100 * MB, down: float = 100 * MB, memory: int = 10**12) -> PeerCapacity:
    return PeerCapacity(
        peer_id=peer_id,
        flops_per_s=1e12,
        memory_bytes=memory,
        upload_bytes_per_s=up,
        download_bytes_per_s=down,
    )


def test_one_report_fills_both_directions_and_estimates_the_rest() -> None:
    a, b, c = peer("a", up=50 * MB), peer("b"), peer("c", down=20 * MB)
    links = LinkMatrix.build([a, b, c], {"a": [LinkReport("b", 10 * MB, 30 * MB, 0.04)]})
    assert links.rate("a", "b") == 10 * MB
    assert links.rate("b", "a") == 30 * MB
    assert links.latency_s("a", "b") == links.latency_s("b", "a") == pytest.approx(0.02)
    assert links.is_measured("b", "a")
    assert not links.is_measured("a", "c")
    assert links.rate("a", "c") == 20 * MB  # min(up(a), down(c))
    assert links.rate("c", "a") == 100 * MB
    # an unmeasured pair takes the larger typical latency of its peers, else the default
    assert links.latency_s("a", "c") == pytest.approx(0.02)
    assert LinkMatrix.build([a, b, c], {}).latency_s("a", "c") == DEFAULT_LATENCY_S
    assert len(links) == 2


def test_two_reports_of_a_pair_keep_the_slower_reading_and_rates_are_capped() -> None:
    a, b = peer("a", up=40 * MB), peer("b")
    links = LinkMatrix.build(
        [a, b],
        {
            "a": [LinkReport("b", 90 * MB, 30 * MB, 0.010)],  # a->b capped at up(a) = 40 MB/s
            "b": [LinkReport("a", 25 * MB, 35 * MB, 0.030)],  # b->a 25, a->b 35
        },
    )
    assert links.rate("a", "b") == 35 * MB
    assert links.rate("b", "a") == 25 * MB
    assert links.latency_s("a", "b") == pytest.approx(0.015)


@pytest.mark.parametrize(
    "report",
    [
        LinkReport("nobody", 1 * MB, 1 * MB, 0.01),  # not a planned peer
        LinkReport("a", 1 * MB, 1 * MB, 0.01),  # a link to itself
        LinkReport("b", math.nan, 1 * MB, 0.01),
        LinkReport("b", 1 * MB, math.inf, 0.01),
        LinkReport("b", 0.0, 1 * MB, 0.01),
        LinkReport("b", 1 * MB, 1 * MB, -1.0),
    ],
)
def test_hostile_reports_are_ignored(report: LinkReport) -> None:
    links = LinkMatrix.build([peer("a"), peer("b")], {"a": [report], "stranger": [LinkReport("a", 1, 1, 1)]})
    assert len(links) == 0
    assert links.rate("a", "b") == 100 * MB


def test_a_peer_cannot_make_a_pair_faster_than_the_figures_allow() -> None:
    a, b = peer("a", up=1 * MB), peer("b", down=2 * MB)
    links = LinkMatrix.build([a, b], {"a": [LinkReport("b", 1e12, 1e12, 0.0)]})
    assert links.rate("a", "b") == 1 * MB
    assert links.rate("b", "a") == 100 * MB  # min(up(b), down(a))


def _sparse_reports(
    peers: list[PeerCapacity], rng: np.random.Generator, k: int
) -> dict[str, list[LinkReport]]:
    ids = [p.peer_id for p in peers]
    reports: dict[str, list[LinkReport]] = {}
    for pid in ids:
        others = [o for o in rng.choice(ids, size=k + 1, replace=False).tolist() if o != pid][:k]
        reports[pid] = [
            LinkReport(
                o, float(rng.uniform(1e5, 1e8)), float(rng.uniform(1e5, 1e8)), float(rng.uniform(0, 0.2))
            )
            for o in others
        ]
    return reports


def test_plan_with_a_matrix_is_identical_under_shuffled_input() -> None:
    rng = np.random.default_rng(7)
    layers = random_layers(rng, 10)
    peers = random_peers(rng, 120, (200_000, 2_000_000))
    reports = _sparse_reports(peers, rng, 6)
    job = JobParams(micro_batch_size=4, min_stages=2)
    digests = set()
    for seed in range(3):
        shuffler = random.Random(seed)
        shuffled_peers = peers[:]
        shuffler.shuffle(shuffled_peers)
        items = list(reports.items())
        shuffler.shuffle(items)
        shuffled_reports = {pid: shuffler.sample(rs, len(rs)) for pid, rs in items}
        links = LinkMatrix.build(shuffled_peers, shuffled_reports)
        digests.add(make_plan(shuffled_peers, layers, job, epoch=3, links=links).digest())
    assert len(digests) == 1


def test_no_matrix_is_the_old_plan_and_an_empty_matrix_keeps_the_clusters() -> None:
    rng = np.random.default_rng(11)
    layers = random_layers(rng, 8)
    peers = random_peers(rng, 40, (200_000, 2_000_000))
    job = JobParams(micro_batch_size=4, min_stages=2)
    old = make_plan(peers, layers, job, epoch=1)
    assert make_plan(peers, layers, job, epoch=1, links=None).digest() == old.digest()
    empty = make_plan(peers, layers, job, epoch=1, links=LinkMatrix.build(peers, {}))
    assert sorted(sorted(c.peer_ids) for c in empty.clusters) == sorted(
        sorted(c.peer_ids) for c in old.clusters
    )


def _uniform_layers(count: int, activation_bytes: int) -> list[LayerProfile]:
    return [
        LayerProfile(
            name=f"l{i}",
            flops_per_sample=1e6,
            param_bytes=1000,
            optimizer_state_bytes=0,
            activation_bytes_per_sample=activation_bytes,
        )
        for i in range(count)
    ]


def test_a_slow_pair_is_never_made_consecutive_stages() -> None:
    peers = [peer("a"), peer("b"), peer("c")]
    layers = _uniform_layers(6, 100_000)
    job = JobParams(micro_batch_size=4, min_stages=3)  # one pipeline of all three
    slow = {"a": [LinkReport("b", 0.1 * MB, 0.1 * MB, 0.2)]}
    order, _, with_matrix = order_stages(peers, layers, job, LinkMatrix.build(peers, slow))
    ids = [p.peer_id for p in order]
    assert ids.index("c") == 1, ids  # c sits between a and b, so a->b is never a stage boundary
    plain_order, _, _ = order_stages(peers, layers, job)
    assert [p.peer_id for p in plain_order] == ["a", "b", "c"]  # all alike: the first order wins
    plan = make_plan(peers, layers, job, epoch=0, links=LinkMatrix.build(peers, slow))
    assert plan.clusters[0].peer_ids == tuple(ids)
    assert plan.clusters[0].bottleneck_s == pytest.approx(with_matrix)


def _two_cities(num_per_city: int) -> tuple[list[PeerCapacity], dict[str, list[LinkReport]]]:
    # ids interleave the cities, so nothing in the ids or the per-peer figures tells them apart
    peers = [peer(f"p{i:02d}", memory=3_000_000) for i in range(2 * num_per_city)]
    city = {p.peer_id: i % 2 for i, p in enumerate(peers)}
    reports: dict[str, list[LinkReport]] = {}
    for a, b in itertools.combinations(peers, 2):
        near = city[a.peer_id] == city[b.peer_id]
        rate, rtt = (100 * MB, 0.002) if near else (2 * MB, 0.15)
        reports.setdefault(a.peer_id, []).append(LinkReport(b.peer_id, rate, rate, rtt))
    return peers, reports


def test_two_cities_are_separated_by_the_matrix_and_not_by_the_old_features() -> None:
    peers, reports = _two_cities(4)
    city = {p.peer_id: i % 2 for i, p in enumerate(peers)}
    layers = _uniform_layers(8, 50_000)
    job = JobParams(micro_batch_size=4, max_in_flight=1, memory_headroom=1.0, min_stages=2)
    old_clusters, _ = cluster_peers(peers, layers, job, epoch=1)
    assert any(len({city[p.peer_id] for p in members}) == 2 for members in old_clusters)
    plan = make_plan(peers, layers, job, epoch=1, links=LinkMatrix.build(peers, reports))
    assert len(plan.clusters) >= 2
    for cluster in plan.clusters:
        assert len({city[pid] for pid in cluster.peer_ids}) == 1, cluster.peer_ids


def test_a_site_too_small_for_the_model_joins_its_best_bridge() -> None:
    peers, reports = _two_cities(2)  # cities {p00, p02} and {p01, p03}
    loner = peer("p99", memory=1)
    reports["p99"] = [LinkReport("p01", 50 * MB, 50 * MB, 0.01), LinkReport("p00", 1 * MB, 1 * MB, 0.3)]
    everyone = [*peers, loner]
    links = LinkMatrix.build(everyone, reports)
    sites = split_sites(everyone, links, need_bytes=2.0, min_size=2)
    assert [[p.peer_id for p in site] for site in sites] == [["p00", "p02"], ["p01", "p03", "p99"]]
    newcomer = peer("p50")
    sites = split_sites([*everyone, newcomer], links, need_bytes=2.0, min_size=1)
    assert ["p50"] in [[p.peer_id for p in site] for site in sites]  # unmeasured: a pool of its own
