"""`LinkMatrix`: pairwise rates and latencies between the planned peers, measured where known.

Problem. The planner's send term ``bytes / min(upload(a), download(b))`` assumes every peer's link is
its own access link: two peers in one city and two peers on two continents look alike. Peers measure
each other (`measurement.network`), and each peer's signed record carries the links it measured. The
matrix is built only from what every peer reads alike (the agreed view, itself built from those signed
records), never from this peer's private probe results, so every peer computes the same plan.

What a cell holds. Directed: ``rate(a, b)`` is the bytes/s from ``a`` to ``b``, ``latency_s(a, b)``
the one-way latency (half the measured round trip). A report by ``a`` about ``b`` gives both
directions (``a`` timed an upload to ``b`` and a download from it). Combining:

* both ``a`` and ``b`` reported the pair: per direction, the *smaller* rate and the *larger* latency
  (the conservative reading; it is also the only one a peer cannot talk up alone);
* a measured rate is capped by the estimate ``min(upload(a), download(b))``: a record can make a pair
  slower than the two peers' own figures allow, never faster (a peer's figure is already the best over
  its probes, so an honest measurement stays below it, up to quantisation);
* unmeasured: rate ``min(upload(a), download(b))`` (today's planner), latency the larger of the two
  peers' median measured latencies, or `DEFAULT_LATENCY_S` when neither measured anything.

Storage is sparse (a dict of measured directed pairs, at most ``2 K n`` for ``K`` links per record):
a dense matrix at 10,000 peers would be 800 MB per figure. Reports naming peers outside the plan, the
reporter itself, or non-finite/non-positive figures are ignored (the record layer refuses them first).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

from ravnest_p2p.planning.types import PeerCapacity

__all__ = ["DEFAULT_LATENCY_S", "LinkMatrix", "LinkReport"]

DEFAULT_LATENCY_S = 0.01
"""One-way latency assumed for a pair neither of whose peers measured any link (a regional path)."""


class LinkReport(NamedTuple):
    """One peer's measurement of its link to ``peer_id`` (a NamedTuple: thousands per plan)."""

    peer_id: str
    upload_bytes_per_s: float  # reporter -> peer_id
    download_bytes_per_s: float  # peer_id -> reporter
    rtt_s: float


def _valid(report: LinkReport) -> bool:
    figures = (report.upload_bytes_per_s, report.download_bytes_per_s, report.rtt_s)
    return all(isinstance(x, int | float) and math.isfinite(x) for x in figures) and (
        report.upload_bytes_per_s > 0 and report.download_bytes_per_s > 0 and report.rtt_s >= 0
    )


class LinkMatrix:
    """Directed pairwise rate (bytes/s) and one-way latency (s); immutable once built."""

    def __init__(
        self,
        peers: Sequence[PeerCapacity],
        measured: Mapping[tuple[str, str], tuple[float, float]],
        *,
        default_latency_s: float = DEFAULT_LATENCY_S,
    ) -> None:
        """Prefer `build`; ``measured`` maps ``(sender, receiver)`` to ``(rate, latency_s)``."""
        self._peers = {p.peer_id: p for p in peers}
        self._measured = dict(measured)
        self.default_latency_s = default_latency_s
        per_peer: dict[str, list[float]] = {}
        for (a, b), (_, latency) in sorted(self._measured.items()):
            per_peer.setdefault(a, []).append(latency)
            per_peer.setdefault(b, []).append(latency)
        self._typical_latency = {p: statistics.median(v) for p, v in per_peer.items()}

    @classmethod
    def build(
        cls,
        peers: Sequence[PeerCapacity],
        reports: Mapping[str, Iterable[LinkReport]],
        *,
        default_latency_s: float = DEFAULT_LATENCY_S,
    ) -> LinkMatrix:
        """The matrix of ``peers`` from each reporter's link reports (see the module doc).

        Args:
            peers: the planned peers (their up/down figures give the estimates and the caps).
            reports: reporter peer id -> its reports; reporters and reported peers outside ``peers``
                are ignored.
            default_latency_s: latency of a pair with no measurement near it.
        """
        by_id = {p.peer_id: p for p in peers}
        measured: dict[tuple[str, str], tuple[float, float]] = {}

        def put(sender: str, receiver: str, rate: float, latency: float) -> None:
            cap = min(by_id[sender].upload_bytes_per_s, by_id[receiver].download_bytes_per_s)
            rate = min(rate, cap)
            old = measured.get((sender, receiver))
            if old is not None:  # min / max are order-free: the input order cannot change the result
                rate, latency = min(rate, old[0]), max(latency, old[1])
            measured[(sender, receiver)] = (rate, latency)

        for reporter in sorted(reports):
            if reporter not in by_id:
                continue
            for report in reports[reporter]:
                other = report.peer_id
                if other == reporter or other not in by_id or not _valid(report):
                    continue
                one_way_s = report.rtt_s / 2
                put(reporter, other, float(report.upload_bytes_per_s), one_way_s)
                put(other, reporter, float(report.download_bytes_per_s), one_way_s)
        return cls(peers, measured, default_latency_s=default_latency_s)

    def __len__(self) -> int:
        """Number of measured directed pairs."""
        return len(self._measured)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def is_measured(self, sender: str, receiver: str) -> bool:
        return (sender, receiver) in self._measured

    def estimated_rate(self, sender: str, receiver: str) -> float:
        """The per-peer estimate ``min(upload(sender), download(receiver))``."""
        return min(self._peers[sender].upload_bytes_per_s, self._peers[receiver].download_bytes_per_s)

    def rate(self, sender: str, receiver: str) -> float:
        """Bytes/s from ``sender`` to ``receiver``: measured if known, else estimated."""
        cell = self._measured.get((sender, receiver))
        return cell[0] if cell is not None else self.estimated_rate(sender, receiver)

    def latency_s(self, sender: str, receiver: str) -> float:
        """One-way latency from ``sender`` to ``receiver``: measured if known, else estimated."""
        cell = self._measured.get((sender, receiver))
        if cell is not None:
            return cell[1]
        typical = [self._typical_latency[p] for p in (sender, receiver) if p in self._typical_latency]
        return max(typical) if typical else self.default_latency_s

    def send_time_s(self, sender: str, receiver: str, num_bytes: float) -> float:
        """Latency plus transfer time of ``num_bytes`` (the planner's send term)."""
        return num_bytes / self.rate(sender, receiver) + self.latency_s(sender, receiver)

    def measured_pairs(self) -> Iterator[tuple[str, str, float, float]]:
        """``(sender, receiver, rate, latency_s)`` of every measured directed pair, sorted."""
        for (a, b), (rate, latency) in sorted(self._measured.items()):
            yield a, b, rate, latency
