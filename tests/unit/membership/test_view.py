"""The pure view: digests, diff, merge order, observe, quantisation."""

import itertools

from ravnest_p2p.membership import Capacity, MembershipView, SummaryItem, ViewEntry

CAP = Capacity.from_figures(flops=1e11, memory_bytes=8e9, upload_mbps=100, download_mbps=200)
CAP2 = Capacity.from_figures(flops=4e11, memory_bytes=8e9, upload_mbps=100, download_mbps=200)


def make_view(entries: dict[str, ViewEntry], num_buckets: int = 8) -> MembershipView:
    view = MembershipView(num_buckets=num_buckets)
    for pid, entry in entries.items():
        view.merge(pid, entry)
    return view


def test_digest_ignores_versions_and_insertion_order():
    a = make_view({"p1": ViewEntry(1.0, CAP), "p2": ViewEntry(2.0, CAP2)})
    b = make_view({"p2": ViewEntry(9.0, CAP2), "p1": ViewEntry(5.0, CAP)})
    assert a.digest() == b.digest()
    c = make_view({"p1": ViewEntry(1.0, CAP), "p2": ViewEntry(2.0, CAP)})
    assert c.digest() != a.digest()


def test_quantisation_absorbs_jitter_but_not_real_changes():
    base = Capacity.from_figures(flops=1.0e11, memory_bytes=8.1e9, upload_mbps=101, download_mbps=203)
    jitter = Capacity.from_figures(flops=1.02e11, memory_bytes=8.2e9, upload_mbps=103, download_mbps=199)
    assert base == jitter
    assert base != Capacity.from_figures(flops=3e11, memory_bytes=8.1e9, upload_mbps=101, download_mbps=203)
    cap = base.to_peer_capacity("p")
    assert 0.7e11 <= cap.flops_per_s <= 1.0e11  # a lower bucket edge: never more than reported
    assert cap.upload_bytes_per_s > 0


def test_merge_is_last_writer_wins_with_tombstone_on_tie():
    view = make_view({"p1": ViewEntry(2.0, CAP)})
    assert not view.merge("p1", ViewEntry(1.0, CAP2))  # older: ignored
    assert view.merge("p1", ViewEntry(2.0, None))  # tombstone wins the tie
    assert view.live_ids() == frozenset()
    assert not view.merge("p1", ViewEntry(2.0, CAP))  # the old copy cannot resurrect it
    assert view.merge("p1", ViewEntry(3.0, CAP))  # a newer record does
    assert not view.merge("ghost", ViewEntry(1.0, None))  # kept (no live change) ...
    assert not view.merge("ghost", ViewEntry(0.5, CAP))  # ... so an older live copy cannot win


def test_merge_converges_whatever_the_order():
    updates = [
        ("p1", ViewEntry(1.0, CAP)),
        ("p1", ViewEntry(2.0, CAP2)),
        ("p2", ViewEntry(1.0, CAP)),
        ("p2", ViewEntry(1.0, None)),
        ("p3", ViewEntry(4.0, CAP2)),
    ]
    digests = set()
    for order in itertools.permutations(updates):
        view = MembershipView(num_buckets=4)
        for pid, entry in order:
            view.merge(pid, entry)
        digests.add(view.digest())
    assert len(digests) == 1


def test_diff_exchanges_only_differing_buckets():
    common = {f"peer{i:04d}": ViewEntry(1.0, CAP) for i in range(200)}
    a = make_view(common, num_buckets=32)
    b = make_view(common, num_buckets=32)
    a.merge("newcomer", ViewEntry(1.0, CAP2))
    b.merge("peer0007", ViewEntry(2.0, None))
    buckets = a.differing_buckets(b.bucket_digests())
    assert 1 <= len(buckets) <= 2
    remote = b.summary(buckets)
    assert len(remote) < 30  # not the whole view
    they_need, we_need = a.diff(remote, buckets)
    assert [i.peer_id for i in they_need] == ["newcomer"]
    assert [i.peer_id for i in we_need] == ["peer0007"]
    for item in we_need:
        a.merge(item.peer_id, ViewEntry(item.version, None if not item.digest else CAP))
    for item in they_need:
        b.merge(item.peer_id, ViewEntry(item.version, CAP2))
    assert a.digest() == b.digest()


def test_is_news():
    view = make_view({"p1": ViewEntry(2.0, CAP)})
    assert view.is_news(SummaryItem("p1", 3.0, CAP.digest()))
    assert not view.is_news(SummaryItem("p1", 1.0, CAP2.digest()))
    assert view.is_news(SummaryItem("p1", 2.0, ""))
    assert view.is_news(SummaryItem("p9", 1.0, CAP.digest()))
    assert view.is_news(SummaryItem("p9", 1.0, ""))


def test_observe_snapshot_tombstones_missing_and_keeps_newer():
    view = make_view({"p1": ViewEntry(5.0, CAP), "p2": ViewEntry(1.0, CAP)})
    changed = view.observe({"p1": (4.0, CAP2), "p3": (1.0, CAP)})  # p1 stale replica, p2 gone
    assert changed == {"p2", "p3"}
    assert view.live() == {"p1": CAP, "p3": CAP}
    assert view.observe({"p1": (5.0, CAP), "p2": (1.0, CAP), "p3": (1.0, CAP)}) == {"p2"}  # back
    assert view.gc(older_than_version=10.0) == 0
    view.observe({})
    assert view.gc(older_than_version=10.0) == 3
    assert len(view) == 0
