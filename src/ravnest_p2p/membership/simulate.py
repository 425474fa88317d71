"""Simulate gossip agreement for 10^3-10^4 peers in one process: rounds and bytes until views agree.

Why not the RPC layer: 10^4 `Gossiper`s over the fake transport means ~3x10^4 pydantic round trips
per round; the simulator instead drives the *same pure core* (`MembershipView`: bucket digests, diff,
last-writer-wins merge) in synchronous rounds and counts the bytes the `gossip_view` messages would
carry (sizes measured from the real message types). The protocol per contact is the one in `gossip`:
pull (epoch, view digest, bucket digests) -> differing buckets' items -> push back what the peer lacks.

What is modelled: a swarm that agrees on N live peers, then one burst of churn (``churn`` x N graceful
leaves, whose draining record reaches a random fanout in their last round, and as many joins, each
knowing itself and one random bootstrap peer). A peer adopts a summary item only after fetching the
signed record from the DHT (counted as one record per adopted item, point lookups); this is the
simulator's stand-in for the service's re-read of the directory. Not modelled: message loss, latency
within a round, record expiry after crashes (every peer derives it from the same signed expiry time,
with no message), and planning time (``make_plan`` is far slower than gossip beyond ~100 peers).

Run: ``python -m ravnest_p2p.membership.simulate --peers 1000 10000``.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ravnest_p2p.membership.gossip import GossipItem, GossipReply, GossipRequest
from ravnest_p2p.membership.view import Capacity, MembershipView, SummaryItem, ViewEntry, bucket_of

__all__ = ["SimResult", "main", "simulate"]

_PEER_ID = "Qm" + "x" * 44  # the length of a real base58 peer id
_ITEM_BYTES = len(GossipItem(peer_id=_PEER_ID, version=1.7e9, digest="0" * 16).model_dump_json()) + 1
_RECORD_BYTES = 520  # a msgpack PeerRecord with two maddrs plus the DHT's signature and expiry
_CAPS = [
    Capacity.from_figures(flops=f, memory_bytes=m, upload_mbps=u, download_mbps=200)
    for f in (2e10, 1e11, 4e11)
    for m in (4e9, 16e9)
    for u in (10, 50, 200)
]


def _request_bytes(num_buckets: int) -> int:
    empty = GossipRequest(epoch=1, view_digest="0" * 64, bucket_digests=("0" * 16,) * num_buckets)
    return len(empty.model_dump_json())


_REPLY_BYTES = len(GossipReply(epoch=1, view_digest="0" * 64).model_dump_json())


@dataclass(frozen=True)
class SimResult:
    num_peers: int
    num_buckets: int
    fanout: int
    churn_events: int
    rounds_to_agree: int
    bytes_total: int
    bytes_per_peer_per_round: float
    record_fetch_bytes: int
    converged: bool

    @property
    def round_goal(self) -> float:
        return 2 * math.log2(self.num_peers)


class _Swarm:
    """Views as *base + delta*: every old peer holds the agreed base view (shared, never copied: 10^4
    full views would need ~10^8 entries), plus its own `MembershipView` of the churned entries only.
    Two base holders agree iff their deltas agree; bucket digests and summaries are those of base +
    delta (summary bytes count the base entries of every differing bucket)."""

    def __init__(self, base: MembershipView, rng: random.Random) -> None:
        self.num_buckets = base.num_buckets
        self.rng = rng
        self.base_size = len(base)
        self.bucket_pop = [0] * base.num_buckets
        for item in base.summary():
            self.bucket_pop[bucket_of(item.peer_id, base.num_buckets)] += 1
        self.store: dict[str, ViewEntry] = {}  # the churned signed records in the DHT (truth)
        self.views: dict[str, MembershipView] = {}
        self.has_base: dict[str, bool] = {}
        self.base_alive: list[str] = []
        self.base_set: set[str] = set()
        self.gossip_bytes = 0
        self.fetch_bytes = 0

    def new_delta(self) -> MembershipView:
        return MembershipView(num_buckets=self.num_buckets)

    def fetch(self, view: MembershipView, item: SummaryItem) -> None:
        """Adopt an item by fetching its signed record (never the gossiped claim itself)."""
        record = self.store.get(item.peer_id)
        if record is not None:
            self.fetch_bytes += _RECORD_BYTES
            view.merge(item.peer_id, record)

    def exchange(self, pa: str, pb: str) -> None:
        a, b = self.views[pa], self.views[pb]
        self.gossip_bytes += _request_bytes(self.num_buckets) + _REPLY_BYTES
        for lacking, holder in ((pa, pb), (pb, pa)):
            if self.has_base[holder] and not self.has_base[lacking]:  # a newcomer pulls everything once
                self.gossip_bytes += _ITEM_BYTES * self.base_size
                self.fetch_bytes += _RECORD_BYTES * self.base_size
                self.has_base[lacking] = True
        if a.digest() == b.digest():
            return
        buckets = b.differing_buckets(a.bucket_digests())
        remote = b.summary(buckets)
        shown = sum(self.bucket_pop[i] for i in buckets) + len(remote)
        self.gossip_bytes += _ITEM_BYTES * shown + 4 * len(buckets)
        they_need, we_need = a.diff(remote, buckets)
        for item in we_need:
            self.fetch(a, item)
        if they_need:
            self.gossip_bytes += _request_bytes(self.num_buckets) + _ITEM_BYTES * len(they_need)
            for item in they_need:
                if b.is_news(item):
                    self.fetch(b, item)

    def contacts(self, pid: str, fanout: int) -> list[str]:
        view = self.views[pid]
        extra = [p for p in view.live_ids() if p != pid and p in self.views and p not in self.base_set]
        pool = (len(self.base_alive) if self.has_base[pid] else 0) + len(extra)
        out = []
        for i in self.rng.sample(range(pool), min(fanout, pool)):
            other = self.base_alive[i] if i < pool - len(extra) else extra[i - (pool - len(extra))]
            if other != pid and other in self.views:
                out.append(other)
        return out

    def round(self, fanout: int) -> None:
        self.base_set = set(self.base_alive)
        for pid in self.rng.sample(list(self.views), len(self.views)):
            for other in self.contacts(pid, fanout):
                self.exchange(pid, other)

    def agreed(self) -> bool:
        truth = {pid for pid, e in self.store.items() if e.alive}
        digests = {v.digest() for v in self.views.values()}
        first = next(iter(self.views.values()))
        return len(digests) == 1 and all(self.has_base.values()) and first.live_ids() == truth


def simulate(
    num_peers: int,
    *,
    fanout: int = 3,
    churn: float = 0.01,
    num_buckets: int | None = None,
    max_rounds: int = 100,
    seed: int = 0,
) -> SimResult:
    """Agree on ``num_peers``, apply one churn burst, count rounds and bytes until views agree again."""
    rng = random.Random(seed)
    buckets = num_buckets or max(16, 2 ** round(math.log2(math.sqrt(num_peers))))
    base = MembershipView(num_buckets=buckets)
    ids = [f"Qm{i:044d}" for i in range(num_peers)]
    for pid in ids:
        base.merge(pid, ViewEntry(1.0, rng.choice(_CAPS)))
    swarm = _Swarm(base, rng)
    for pid in ids:
        swarm.views[pid] = swarm.new_delta()
        swarm.has_base[pid] = True
    num_events = max(1, round(churn * num_peers))
    leavers = rng.sample(ids, num_events)
    swarm.base_alive = [pid for pid in ids if pid not in set(leavers)]
    swarm.base_set = set(swarm.base_alive)
    for pid in leavers:  # graceful leaves: a draining record, pushed to a fanout in the last round
        swarm.store[pid] = ViewEntry(2.0, None)
        swarm.views[pid].merge(pid, swarm.store[pid])
        for other in rng.sample(swarm.base_alive, fanout):
            swarm.exchange(pid, other)
        del swarm.views[pid]
    for j in range(num_events):  # joins: the newcomer knows itself and one bootstrap peer
        pid = f"Qn{j:044d}"
        swarm.store[pid] = ViewEntry(1.0, rng.choice(_CAPS))
        swarm.views[pid] = swarm.new_delta()
        swarm.views[pid].merge(pid, swarm.store[pid])
        swarm.has_base[pid] = False
        swarm.exchange(pid, rng.choice(swarm.base_alive))
    rounds = 0
    while not swarm.agreed() and rounds < max_rounds:
        swarm.round(fanout)
        rounds += 1
    total = swarm.gossip_bytes + swarm.fetch_bytes
    return SimResult(
        num_peers=num_peers,
        num_buckets=buckets,
        fanout=fanout,
        churn_events=2 * num_events,
        rounds_to_agree=rounds,
        bytes_total=total,
        bytes_per_peer_per_round=total / max(1, rounds) / len(swarm.views),
        record_fetch_bytes=swarm.fetch_bytes,
        converged=swarm.agreed(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ravnest_p2p.membership.simulate")
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--fanout", type=int, default=3)
    parser.add_argument("--churn", type=float, default=0.01, help="fraction leaving (and as many joining)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for n in args.peers:
        r = simulate(n, fanout=args.fanout, churn=args.churn, seed=args.seed)
        print(
            f"N={n} buckets={r.num_buckets} churn events={r.churn_events}: "
            f"{'agreed' if r.converged else 'NOT agreed'} in {r.rounds_to_agree} rounds "
            f"(goal <= {r.round_goal:.1f}); {r.bytes_total / 1e6:.1f} MB total, "
            f"{r.bytes_per_peer_per_round / 1e3:.1f} kB/peer/round, "
            f"{r.record_fetch_bytes / 1e6:.1f} MB of record fetches"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
