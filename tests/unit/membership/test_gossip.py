"""Gossip over the in-memory transport: convergence, bytes, and refusal of malformed requests."""

import random

import pytest

from ravnest_p2p.errors import RemoteError
from ravnest_p2p.membership import (
    GOSSIP_VIEW,
    Capacity,
    Gossiper,
    GossipItem,
    GossipRequest,
    MembershipView,
    ViewEntry,
)
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

CAPS = [
    Capacity.from_figures(flops=1e9 * 2**i, memory_bytes=8e9, upload_mbps=50, download_mbps=50)
    for i in range(4)
]


def build(num_peers: int, num_buckets: int = 8):
    """Peers that each know only themselves; news is checked against a shared 'signed record' store."""
    net = FakeNetwork()
    records = {f"peer{i:03d}": (1.0, CAPS[i % 4]) for i in range(num_peers)}
    gossipers: list[Gossiper] = []
    rng = random.Random(1)
    for pid in records:
        view = MembershipView(num_buckets=num_buckets)
        view.merge(pid, ViewEntry(*records[pid]))

        def on_news(sender, items, view=view):
            for item in items:  # adopt only what the record store (the DHT stand-in) confirms
                if item.peer_id in records:
                    view.merge(item.peer_id, ViewEntry(*records[item.peer_id]))

        gossipers.append(
            Gossiper(
                RpcEndpoint(net.create(pid), "run"),
                view,
                get_epoch=lambda: 0,
                on_epoch=lambda sender, e: None,
                on_news=on_news,
                fanout=2,
                call_timeout_s=1.0,
                rng=rng,
            )
        )
    return net, records, gossipers


async def test_push_pull_converges_in_logarithmic_rounds():
    net, records, gossipers = build(32)
    for g in gossipers:
        await g.serve()
    rounds = 0
    while len({g.view.digest() for g in gossipers}) > 1:
        rounds += 1
        assert rounds <= 12
        for g in gossipers:  # everyone bootstraps through peer000, which starts knowing nobody
            known = sorted(g.view.live_ids() - {g.rpc.peer_id}) or ["peer000"]
            if known != [g.rpc.peer_id]:
                await g.gossip_round(known)
    assert all(g.view.live_ids() == frozenset(records) for g in gossipers)
    before = net.bytes_sent
    await gossipers[0].gossip_round(sorted(records)[1:])
    assert net.bytes_sent - before < 2 * 2 * 600  # agreed views: digests only, no summaries


async def test_malformed_gossip_is_refused_and_state_untouched():
    _, _, (a, b) = build(2)
    await a.serve()
    digest_before = a.view.digest()
    bad_requests = [
        GossipRequest(epoch=0, view_digest="0" * 64, bucket_digests=("0" * 16,) * 3),  # wrong bucket count
        GossipRequest(
            epoch=0,
            view_digest="0" * 64,
            bucket_digests=("0" * 16,) * 8,
            push_buckets=(99,),
        ),
        GossipRequest(  # an item outside the bucket it is pushed under
            epoch=0,
            view_digest="0" * 64,
            bucket_digests=("0" * 16,) * 8,
            push_buckets=(0,),
            push=tuple(GossipItem(peer_id=f"x{i}", version=1.0, digest="") for i in range(20)),
        ),
        GossipRequest.model_construct(epoch=-1, view_digest="zz", bucket_digests=()),  # fails validation
    ]
    for request in bad_requests:
        with pytest.raises(RemoteError) as err:
            await b.rpc.call("peer000", GOSSIP_VIEW, request, timeout_s=1.0)
        assert err.value.code == "invalid_message"
    assert a.view.digest() == digest_before
    assert await b.exchange("peer000") is False  # and it still serves good requests


async def test_a_view_larger_than_one_message_reconciles_over_rounds():
    """2,500 entries (> MAX_ITEMS per message): each reply carries a prefix of the differing buckets."""
    from ravnest_p2p.membership.gossip import MAX_ITEMS

    net = FakeNetwork()
    big = MembershipView(num_buckets=16)
    for i in range(2500):
        big.merge(f"p{i:05d}", ViewEntry(1.0, CAPS[i % 4]))
    small = MembershipView(num_buckets=16)
    learned: list[int] = []

    def adopt(sender, items):
        learned.append(len(items))
        for item in items:
            small.merge(item.peer_id, ViewEntry(1.0, CAPS[int(item.peer_id[1:]) % 4]))

    def gossiper(pid, view, on_news):
        return Gossiper(
            RpcEndpoint(net.create(pid), "run"),
            view,
            get_epoch=lambda: 0,
            on_epoch=lambda sender, e: None,
            on_news=on_news,
            fanout=1,
            call_timeout_s=1.0,
            rng=random.Random(0),
        )

    server = gossiper("p00000", big, lambda sender, items: None)
    client = gossiper("newcomer", small, adopt)
    await server.serve()
    for _ in range(10):
        if small.digest() == big.digest():
            break
        await client.exchange("p00000")
    assert small.live_ids() == big.live_ids()
    assert len(learned) >= 3
    assert max(learned) <= MAX_ITEMS
