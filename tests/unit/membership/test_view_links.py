"""Links in the membership view: bucketed like the other figures, and the plan's probe neighbours."""

from __future__ import annotations

from ravnest_p2p.membership import Capacity
from ravnest_p2p.membership.agreement import plan_neighbours, view_links
from ravnest_p2p.planning import ClusterPlan, Plan, StageAssignment

FIGURES = {"flops": 1e12, "memory_bytes": 8e9, "upload_mbps": 100.0, "download_mbps": 100.0}


def test_a_record_without_links_keeps_its_old_digest() -> None:
    plain = Capacity.from_figures(**FIGURES)
    assert plain.digest() == Capacity.from_figures(**FIGURES, links=[]).digest()
    with_links = Capacity.from_figures(**FIGURES, links=[("b", 10.0, 20.0, 5.0)])
    assert with_links.digest() != plain.digest()


def test_link_jitter_within_a_bucket_does_not_change_the_view() -> None:
    a = Capacity.from_figures(**FIGURES, links=[("b", 10.0, 20.0, 5.0), ("c", 1.0, 1.0, 100.0)])
    b = Capacity.from_figures(**FIGURES, links=[("c", 1.05, 1.1, 101.0), ("b", 10.5, 21.0, 5.2)])
    assert a == b
    c = Capacity.from_figures(**FIGURES, links=[("b", 30.0, 20.0, 5.0), ("c", 1.0, 1.0, 100.0)])
    assert c.digest() != a.digest()


def test_view_links_err_on_the_slow_side() -> None:
    live = {
        "a": Capacity.from_figures(**FIGURES, links=[("b", 10.0, 20.0, 5.0)]),
        "b": Capacity.from_figures(**FIGURES),
    }
    peers = [cap.to_peer_capacity(pid) for pid, cap in live.items()]
    links = view_links(live, peers)
    assert 10.0 / 2**0.5 * 1e6 / 8 <= links.rate("a", "b") <= 10.0 * 1e6 / 8
    assert 20.0 / 2**0.5 * 1e6 / 8 <= links.rate("b", "a") <= 20.0 * 1e6 / 8
    assert 0.0025 <= links.latency_s("a", "b") <= 0.0025 * 2**0.5


def _stage(peer_id: str, first: int) -> StageAssignment:
    return StageAssignment(
        peer_id=peer_id, first_layer=first, last_layer_exclusive=first + 1, stage_time_s=1.0, memory_bytes=1
    )


def test_plan_neighbours_are_pipeline_and_ring_neighbours() -> None:
    clusters = tuple(
        ClusterPlan(
            index=c,
            stages=(_stage(f"c{c}s0", 0), _stage(f"c{c}s1", 1), _stage(f"c{c}s2", 2)),
            bottleneck_s=1.0,
        )
        for c in range(4)
    )
    plan = Plan(epoch=1, clusters=clusters, spare_peer_ids=("spare",))
    assert plan_neighbours(plan, "c1s1") == {"c1s0", "c1s2", "c0s1", "c2s1"}
    assert plan_neighbours(plan, "c0s0") == {"c0s1", "c3s0", "c1s0"}
    assert plan_neighbours(plan, "spare") == frozenset()
    assert plan_neighbours(None, "c0s0") == frozenset()
