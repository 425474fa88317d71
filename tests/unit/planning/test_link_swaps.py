"""Swaps of peers between clusters by the measured links (`planning.link_swaps`)."""

from __future__ import annotations

import itertools

import pytest

from ravnest_p2p.planning import JobParams, LinkMatrix, LinkReport, PeerCapacity, link_swaps, make_plan
from ravnest_p2p.types import LayerProfile

FAST, SLOW = 100e6, 4e6
# Eight identical peers whose fast pairs form one chain in this (scrambled) order: one site for
# single linkage, and the only splits into two 4-stage pipelines with fast hops only are the chain's
# two halves.
CHAIN = ["p5", "p2", "p7", "p0", "p3", "p6", "p1", "p4"]


def _swarm() -> tuple[list[PeerCapacity], list[LayerProfile], JobParams, LinkMatrix]:
    peers = [
        PeerCapacity(
            peer_id=f"p{i}",
            flops_per_s=1e12,
            memory_bytes=12_000_000,
            upload_bytes_per_s=FAST,
            download_bytes_per_s=FAST,
        )
        for i in range(8)
    ]
    layers = [
        LayerProfile(
            name=f"l{i}",
            flops_per_sample=1e6,
            param_bytes=1_000_000,
            optimizer_state_bytes=0,
            activation_bytes_per_sample=100_000,
        )
        for i in range(4)
    ]
    fast = {frozenset(pair) for pair in itertools.pairwise(CHAIN)}
    reports = {
        a.peer_id: [
            LinkReport(b.peer_id, rate, rate, 0.01)
            for b in peers
            if b is not a
            for rate in [FAST if frozenset((a.peer_id, b.peer_id)) in fast else SLOW]
        ]
        for a in peers
    }
    return peers, layers, JobParams(micro_batch_size=8, min_stages=4), LinkMatrix.build(peers, reports)


def _slowest_hop(plan, links: LinkMatrix) -> float:  # type: ignore[no-untyped-def]
    return min(
        links.rate(s.peer_id, t.peer_id) for c in plan.clusters for s, t in itertools.pairwise(c.stages)
    )


@pytest.mark.parametrize("swaps", [True, False])
def test_swaps_put_the_fast_chain_halves_into_the_two_pipelines(
    swaps: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not swaps:
        monkeypatch.setattr(link_swaps, "MAX_PEERS", 0)
    peers, layers, job, links = _swarm()
    plan = make_plan(peers, layers, job, epoch=1, links=links)
    assert [len(c.stages) for c in plan.clusters] == [4, 4]
    assert (_slowest_hop(plan, links) == FAST) == swaps
    if swaps:
        assert sorted(sorted(c.peer_ids) for c in plan.clusters) == sorted(
            [sorted(CHAIN[:4]), sorted(CHAIN[4:])]
        )


def test_swapped_plans_agree_under_shuffled_input() -> None:
    peers, layers, job, links = _swarm()
    digests = {make_plan(peers, layers, job, epoch=1, links=links).digest()}
    for order in itertools.islice(itertools.permutations(peers), 1, 40, 7):
        digests.add(make_plan(list(order), layers, job, epoch=1, links=links).digest())
    assert len(digests) == 1
