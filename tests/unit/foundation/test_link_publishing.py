"""Which links a peer publishes (stable set, steady figures) and which peers it probes first."""

from __future__ import annotations

import time

from ravnest_p2p.measurement import LinkEstimate, LinkPublisher, NetworkMeter, ProbeConfig


def estimate(up: float, down: float, rtt: float, probes: int = 1, last: float = 1.0) -> LinkEstimate:
    return LinkEstimate(
        rtt_ms=rtt, upload_mbps=up, download_mbps=down, num_probes=probes, last_probe_monotonic=last
    )


def test_selection_prefers_priority_then_published_then_most_probed() -> None:
    publisher = LinkPublisher(max_links=2)
    links = {"a": estimate(10, 10, 5, probes=3), "b": estimate(10, 10, 5, probes=1), "c": estimate(10, 10, 5)}
    first = publisher.select(links, alive={"a", "b", "c"})
    assert [link.peer_id for link in first] == ["a", "b"]  # a most probed, then by id
    links["c"] = estimate(10, 10, 5, probes=9)  # a newcomer probed a lot does not push b out
    assert [link.peer_id for link in publisher.select(links, alive={"a", "b", "c"})] == ["a", "b"]
    chosen = publisher.select(links, alive={"a", "b", "c"}, priority={"c"})
    assert [link.peer_id for link in chosen] == ["a", "c"]
    assert [link.peer_id for link in publisher.select(links, alive={"b", "c"})] == ["b", "c"]


def test_figures_move_only_past_the_hysteresis_band_and_are_rounded() -> None:
    publisher = LinkPublisher(max_links=4)
    (link,) = publisher.select({"a": estimate(12.3456, 80.0, 0.4)}, alive={"a"})
    assert (link.up_mbps, link.down_mbps, link.rtt_ms) == (12.3, 80.0, 0.4)
    (link,) = publisher.select({"a": estimate(15.0, 60.0, 1.9)}, alive={"a"})  # noise: unchanged
    assert (link.up_mbps, link.down_mbps, link.rtt_ms) == (12.3, 80.0, 0.4)
    (link,) = publisher.select({"a": estimate(30.0, 20.0, 40.0)}, alive={"a"})  # real changes
    assert (link.up_mbps, link.down_mbps, link.rtt_ms) == (30.0, 20.0, 40.0)


def test_unmeasured_links_and_lab_caps() -> None:
    publisher = LinkPublisher(max_links=4)
    links = {"a": LinkEstimate(rtt_ms=3.0), "b": estimate(500.0, 500.0, 1.0)}
    (link,) = publisher.select(links, alive={"a", "b"}, up_cap_mbps=10.0, down_cap_mbps=20.0)
    assert (link.peer_id, link.up_mbps, link.down_mbps) == ("b", 10.0, 20.0)


def test_probe_order_is_stale_priority_then_unprobed_then_least_recent() -> None:
    meter = NetworkMeter(rpc=None, config=ProbeConfig(fanout=3, priority_refresh_s=60.0))  # type: ignore[arg-type]
    now = time.monotonic()
    meter.links = {
        "old": estimate(1, 1, 1, last=now - 500),
        "neighbour-fresh": estimate(1, 1, 1, last=now - 1),
        "neighbour-stale": estimate(1, 1, 1, last=now - 100),
    }
    candidates = ["old", "neighbour-fresh", "neighbour-stale", "new", "neighbour-new"]
    picked = meter._pick(candidates, priority={"neighbour-fresh", "neighbour-stale", "neighbour-new"})
    assert picked == ["neighbour-new", "neighbour-stale", "new"]
    assert meter._pick(candidates) == ["neighbour-new", "new", "old"]  # no plan: unprobed, then oldest
