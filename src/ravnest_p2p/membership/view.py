"""The membership view: who is in the run, with what capacity, as one comparable, mergeable value.

Problem. Every peer must compute the *same* plan, so it must feed the planner the same inputs. Each
peer sees the swarm through its own DHT reads, at its own moments; the view is the small summary peers
compare (by digest) and reconcile (by diff and merge) until they hold the same one.

What is in an entry. ``peer id -> (version, capacity)``: the version is the owner's record
``updated_at`` (its own clock, monotone per owner), the capacity is the record's figures *quantised to
log-scale buckets* (integers): half-octaves for compute and bandwidth, sixteenths of an octave for
memory. Quantising is what makes agreement possible at all: measured bandwidth and free memory move a
little on every refresh, and raw floats would change the view every few seconds. Whole buckets are also
canonical (no float printing in digests). Memory is finer because the planner's fit decisions are hard
edges: a half-octave bucket lost up to 29 % of a peer's memory (a peer with 1.05e9 bytes free was
planned with 0.76e9, and a model that fit was not planned); a sixteenth loses at most 4.2 %. An
uncapped peer publishes free memory with hysteresis (`measurement.memory.steady_memory_bytes`), so the
finer bucket does not flap with the OS's available-memory figure (a capped peer's does not jitter).
The epoch/cluster/stage a record carries are deliberately left out: they are outputs of the plan, not
inputs. The record's
measured links (`discovery.PeerRecord.links`) are in, bucketed the same way (rates in half-octaves,
round trips in half-octaves of milliseconds): the planner's `planning.LinkMatrix` is built from the
view, so peers that agree on the view agree on the matrix. A record without links has the same content
digest as before links existed.

Digests. The view digest and the per-bucket digests cover ``(peer id, content digest)`` of live entries
only, never versions: a peer re-announcing an unchanged record (every TTL/3) changes nothing anyone
needs to act on. Peer ids are spread over ``num_buckets`` by sha256 (not ``hash()``, which is salted
per process), so two peers can find *which* buckets differ and exchange only those (a one-level Merkle
tree; at 10^4 peers two views differing in a few entries exchange a few buckets, not the whole view).
A bucket digest is the XOR of 64-bit hashes of its entries, updated in O(1) per change (the simulator
runs 10^4 views); XOR set hashes can be forged by someone who chooses many entries, but entries come
only from signed records, and a collision would only delay agreement until the plan digests disagree.

Merge. Last-writer-wins per peer id on ``(version, tombstone, content digest)``: commutative,
associative and idempotent, so views converge whatever the order of exchanges (a state-based CRDT).
A tombstone wins a tie, so a peer's departure at version v is not undone by an old copy of version v.

Alternatives rejected: a full list exchange every round (O(N) bytes per contact even when nothing
changed); a consensus protocol (Raft/Paxos) per epoch (needs a stable leader among volunteers, and the
plan only needs eventual agreement plus a check, which `agreement` does through the DHT).

Limits. A figure sitting exactly on a bucket boundary can flap between two buckets; it delays a plan
that is still forming (stability resets) but never re-plans an active epoch (only joins and departures
do). Tombstones are kept until `gc` drops those older than a horizon.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ravnest_p2p.planning import LinkReport, PeerCapacity

__all__ = ["MEMORY_STEPS_PER_OCTAVE", "Capacity", "MembershipView", "SummaryItem", "ViewEntry", "bucket_of"]

_MBPS_TO_BYTES_PER_S = 1e6 / 8
# Floors so that a peer that has not measured yet still yields a valid planner input.
_MIN_FLOPS = 1e6
_MIN_MBPS = 1.0
_MIN_MEMORY_BYTES = 2**20
_MIN_RTT_MS = 0.05

LinkBuckets = tuple[str, int, int, int]
"""``(peer id, up bucket, down bucket, rtt bucket)`` of one measured link."""


MEMORY_STEPS_PER_OCTAVE = 16
"""Memory buckets per doubling: a bucket's lower edge is at most 4.2 % under the figure it holds."""


def _bucket(value: float, floor: float) -> int:
    """Half-octave bucket index of ``max(value, floor)``: ``floor(2 * log2(x))``."""
    return math.floor(2 * math.log2(max(value, floor)))


def _unbucket(index: int) -> float:
    """The lower edge of a bucket; conservative (never more than the peer reported)."""
    return math.ldexp(1.0, index // 2) * (math.sqrt(2.0) if index % 2 else 1.0)


def _memory_unbucket(index: int) -> int:
    """The lower edge of a memory bucket, in whole bytes."""
    octave, step = divmod(index, MEMORY_STEPS_PER_OCTAVE)
    return math.floor(math.ldexp(2.0 ** (step / MEMORY_STEPS_PER_OCTAVE), octave))


def _memory_bucket(value_bytes: float) -> int:
    """``floor(16 * log2(bytes))``; never an edge above the figure (log2 may round up onto an edge)."""
    value = max(value_bytes, _MIN_MEMORY_BYTES)
    index = math.floor(MEMORY_STEPS_PER_OCTAVE * math.log2(value))
    return index - 1 if _memory_unbucket(index) > value else index


@dataclass(frozen=True)
class Capacity:
    """A peer's quantised figures: bucket indices (integers, so canonical everywhere).

    Compute and bandwidth in half-octaves, memory in sixteenths of an octave (`MEMORY_STEPS_PER_OCTAVE`).
    """

    flops_bucket: int
    memory_bucket: int
    upload_bucket: int
    download_bucket: int
    links: tuple[LinkBuckets, ...] = ()  # sorted by peer id

    @classmethod
    def from_figures(
        cls,
        *,
        flops: float,
        memory_bytes: float,
        upload_mbps: float,
        download_mbps: float,
        links: Iterable[tuple[str, float, float, float]] = (),
    ) -> Capacity:
        """Bucket a record's figures; ``links`` are ``(peer id, up Mbit/s, down Mbit/s, rtt ms)``."""
        return cls(
            flops_bucket=_bucket(flops, _MIN_FLOPS),
            memory_bucket=_memory_bucket(memory_bytes),
            upload_bucket=_bucket(upload_mbps, _MIN_MBPS),
            download_bucket=_bucket(download_mbps, _MIN_MBPS),
            links=tuple(
                sorted(
                    (pid, _bucket(up, _MIN_MBPS), _bucket(down, _MIN_MBPS), _bucket(rtt, _MIN_RTT_MS))
                    for pid, up, down, rtt in links
                )
            ),
        )

    def digest(self) -> str:
        text = f"{self.flops_bucket},{self.memory_bucket},{self.upload_bucket},{self.download_bucket}"
        if self.links:
            text += "|" + ";".join(f"{pid},{up},{down},{rtt}" for pid, up, down, rtt in self.links)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def link_reports(self) -> list[LinkReport]:
        """The planner's link reports of this peer, bytes/s and seconds.

        Rates take the lower bucket edge and round trips the upper one: both err on the slow side.
        """
        return [
            LinkReport(
                peer_id=pid,
                upload_bytes_per_s=_unbucket(up) * _MBPS_TO_BYTES_PER_S,
                download_bytes_per_s=_unbucket(down) * _MBPS_TO_BYTES_PER_S,
                rtt_s=_unbucket(rtt + 1) / 1000,
            )
            for pid, up, down, rtt in self.links
        ]

    def to_peer_capacity(self, peer_id: str) -> PeerCapacity:
        """The planner's input for this peer (lower bucket edges, bandwidth in bytes/s)."""
        return PeerCapacity(
            peer_id=peer_id,
            flops_per_s=_unbucket(self.flops_bucket),
            memory_bytes=_memory_unbucket(self.memory_bucket),
            upload_bytes_per_s=_unbucket(self.upload_bucket) * _MBPS_TO_BYTES_PER_S,
            download_bytes_per_s=_unbucket(self.download_bucket) * _MBPS_TO_BYTES_PER_S,
        )


@dataclass(frozen=True)
class ViewEntry:
    """One peer in a view: live with a capacity, or a tombstone (``capacity is None``)."""

    version: float
    capacity: Capacity | None

    @property
    def alive(self) -> bool:
        return self.capacity is not None

    @property
    def digest(self) -> str:
        """Content digest; empty for a tombstone."""
        return "" if self.capacity is None else self.capacity.digest()

    def beats(self, other: ViewEntry) -> bool:
        """Last-writer-wins order: newer version; on a tie a tombstone; then the larger digest."""
        return (self.version, not self.alive, self.digest) > (other.version, not other.alive, other.digest)


@dataclass(frozen=True)
class SummaryItem:
    """What gossip carries about one peer: enough to tell who is newer, not the record itself."""

    peer_id: str
    version: float
    digest: str  # "" for a tombstone


def _entry_hash(peer_id: str, digest: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{peer_id}:{digest}".encode()).digest()[:8], "big")


def bucket_of(peer_id: str, num_buckets: int) -> int:
    """Stable bucket of a peer id (the same on every peer and process)."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big") % num_buckets


class MembershipView:
    """A mutable view with cached digests. Pure: no I/O, no clock; callers pass versions in."""

    def __init__(self, *, num_buckets: int = 16) -> None:
        if num_buckets < 1:
            raise ValueError("num_buckets must be positive")
        self.num_buckets = num_buckets
        self._entries: dict[str, ViewEntry] = {}
        self._bucket_xor = [0] * num_buckets
        self._bucket_members: list[set[str]] = [set() for _ in range(num_buckets)]
        self._digest_cache: str | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, peer_id: str) -> ViewEntry | None:
        return self._entries.get(peer_id)

    def live(self) -> dict[str, Capacity]:
        """Live peers and their capacities, sorted by peer id (the planner's order)."""
        return {pid: e.capacity for pid, e in sorted(self._entries.items()) if e.capacity is not None}

    def live_ids(self) -> frozenset[str]:
        return frozenset(pid for pid, e in self._entries.items() if e.alive)

    def _put(self, peer_id: str, entry: ViewEntry) -> bool:
        """Store ``entry``, keeping bucket hashes current; True if the live content changed."""
        old = self._entries.get(peer_id)
        old_digest = old.digest if old is not None else ""
        self._entries[peer_id] = entry
        bucket = bucket_of(peer_id, self.num_buckets)
        self._bucket_members[bucket].add(peer_id)
        if old_digest == entry.digest:
            return False
        if old_digest:
            self._bucket_xor[bucket] ^= _entry_hash(peer_id, old_digest)
        if entry.digest:
            self._bucket_xor[bucket] ^= _entry_hash(peer_id, entry.digest)
        self._digest_cache = None
        return True

    def bucket_digests(self) -> list[str]:
        """Per bucket, a 16-hex digest of its live ``(peer id, content digest)`` pairs."""
        return [f"{x:016x}" for x in self._bucket_xor]

    def digest(self) -> str:
        """The view digest peers compare: a hash of the bucket digests (versions excluded)."""
        if self._digest_cache is None:
            text = f"{self.num_buckets}|" + ",".join(self.bucket_digests())
            self._digest_cache = hashlib.sha256(text.encode()).hexdigest()
        return self._digest_cache

    def differing_buckets(self, remote: Sequence[str]) -> list[int]:
        """Buckets whose digest differs from ``remote``'s (all of them if the bucket counts differ)."""
        ours = self.bucket_digests()
        if len(remote) != len(ours):
            return list(range(self.num_buckets))
        return [i for i, (a, b) in enumerate(zip(ours, remote, strict=True)) if a != b]

    def summary(self, buckets: Iterable[int] | None = None) -> list[SummaryItem]:
        """Entries (tombstones included) in ``buckets`` (all if None), sorted by peer id."""
        if buckets is None:
            pids: Iterable[str] = self._entries
        else:
            pids = [pid for b in set(buckets) for pid in self._bucket_members[b]]
        entries = self._entries
        return [SummaryItem(pid, entries[pid].version, entries[pid].digest) for pid in sorted(pids)]

    def is_news(self, item: SummaryItem) -> bool:
        """Whether a remote summary item would change our entry (it is newer by the merge order)."""
        ours = self._entries.get(item.peer_id)
        if ours is None:
            return True  # even a tombstone: it must beat an older live copy arriving later
        return (item.version, not item.digest, item.digest) > (ours.version, not ours.alive, ours.digest)

    def diff(
        self, remote: Sequence[SummaryItem], buckets: Iterable[int]
    ) -> tuple[list[SummaryItem], list[SummaryItem]]:
        """Split two summaries of the same ``buckets``: (what the remote needs from us, what we need).

        Returns:
            Our items that are newer than, or absent from, ``remote``; and ``remote``'s items that are
            news to us.
        """
        theirs = {item.peer_id: item for item in remote}
        they_need = []
        for item in self.summary(buckets):
            other = theirs.get(item.peer_id)
            key = (item.version, not item.digest, item.digest)
            if other is None or (other is not None and key > (other.version, not other.digest, other.digest)):
                they_need.append(item)
        we_need = [item for item in remote if self.is_news(item)]
        return they_need, we_need

    def merge(self, peer_id: str, entry: ViewEntry) -> bool:
        """Adopt ``entry`` if it beats ours; True if the view changed."""
        ours = self._entries.get(peer_id)
        if ours is not None and not entry.beats(ours):
            return False
        # Tombstones of unknown peers are kept too: without them an older live copy arriving later
        # would win, and the merge would depend on arrival order.
        return self._put(peer_id, entry)

    def observe(self, snapshot: Mapping[str, tuple[float, Capacity]]) -> set[str]:
        """Make the view match an authoritative snapshot (our own validated DHT read).

        Peers in the snapshot are set live unless we hold a *newer* version (a stale replica); live
        peers absent from it become tombstones at their last version.

        Returns:
            The peer ids whose live/capacity state changed.
        """
        changed: set[str] = set()
        for pid, (version, capacity) in snapshot.items():
            ours = self._entries.get(pid)
            if ours is not None and ours.version > version:
                continue
            if self._put(pid, ViewEntry(version, capacity)):
                changed.add(pid)
        for pid, ours in list(self._entries.items()):
            if ours.alive and pid not in snapshot:
                self._put(pid, ViewEntry(ours.version, None))
                changed.add(pid)
        return changed

    def gc(self, *, older_than_version: float) -> int:
        """Drop tombstones older than a version horizon; returns how many were dropped."""
        dead = [p for p, e in self._entries.items() if not e.alive and e.version < older_than_version]
        for pid in dead:
            del self._entries[pid]
            self._bucket_members[bucket_of(pid, self.num_buckets)].discard(pid)
        return len(dead)
