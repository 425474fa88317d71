"""Which measured links a peer publishes in its record, and how steady their figures stay.

Problem. The planner's link matrix is built from the links peers publish (`discovery.PeerRecord.links`),
and the membership view, which must be identical at every peer before a plan is agreed, is built from
those records. A record that changed on every probe round would keep the view from ever settling. So:

* Selection is stable, not "most recent": the peers the plan depends on first (the caller's
  ``priority``), then links already published, then the most probed, then by peer id; at most
  ``max_links``. Once full, the set changes only when a published peer leaves or the plan changes,
  not each time the prober moves on to another peer.
* Figures move with hysteresis: a published rate is replaced only when the new estimate differs from
  it by more than `HYSTERESIS_RATIO` (one half-octave, the view's bucket width); a round trip only when
  it also moves by more than `RTT_SLACK_MS` (sub-millisecond RTTs are mostly scheduling noise).
* Figures are rounded to three significant digits (smaller records, no noise digits).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ravnest_p2p.measurement.network import LinkEstimate

__all__ = ["HYSTERESIS_RATIO", "RTT_SLACK_MS", "LinkPublisher", "PublishedLink"]

HYSTERESIS_RATIO = math.sqrt(2.0)
RTT_SLACK_MS = 2.0


@dataclass(frozen=True)
class PublishedLink:
    """One link as it goes into the record: rates both ways (Mbit/s) and the round trip (ms)."""

    peer_id: str
    up_mbps: float
    down_mbps: float
    rtt_ms: float


def _round(value: float) -> float:
    return float(f"{value:.3g}")


def _steady(old: float, new: float, *, slack: float = 0.0) -> float:
    """``old`` unless ``new`` left the hysteresis band around it."""
    if abs(new - old) <= slack:
        return old
    if old > 0 and new > 0 and 1 / HYSTERESIS_RATIO <= new / old <= HYSTERESIS_RATIO:
        return old
    return _round(new)


class LinkPublisher:
    """Keeps the links last published; `select` returns the next set (sorted by peer id)."""

    def __init__(self, *, max_links: int) -> None:
        if max_links < 0:
            raise ValueError("max_links must be non-negative")
        self.max_links = max_links
        self._published: dict[str, PublishedLink] = {}

    def select(
        self,
        links: Mapping[str, LinkEstimate],
        *,
        alive: Collection[str],
        priority: Collection[str] = (),
        up_cap_mbps: float | None = None,
        down_cap_mbps: float | None = None,
    ) -> tuple[PublishedLink, ...]:
        """The links to publish now.

        Args:
            links: the meter's estimates by peer id (unmeasured ones are skipped).
            alive: peers that may be published (gone peers are dropped).
            priority: peers the plan depends on (pipeline neighbours, ring neighbours): kept first.
            up_cap_mbps / down_cap_mbps: lab emulation caps on the figures (as for the record's own).
        """
        measured = {
            pid: est
            for pid, est in links.items()
            if pid in alive
            and est.upload_mbps is not None
            and est.download_mbps is not None
            and est.rtt_ms is not None
            and est.upload_mbps > 0
            and est.download_mbps > 0
        }
        chosen = sorted(
            measured,
            key=lambda pid: (
                pid not in priority,
                pid not in self._published,
                -measured[pid].num_probes,
                pid,
            ),
        )[: self.max_links]
        published: dict[str, PublishedLink] = {}
        for pid in sorted(chosen):
            est = measured[pid]
            assert est.upload_mbps is not None
            assert est.download_mbps is not None
            assert est.rtt_ms is not None
            up, down = est.upload_mbps, est.download_mbps
            if up_cap_mbps is not None:
                up = min(up, up_cap_mbps)
            if down_cap_mbps is not None:
                down = min(down, down_cap_mbps)
            old = self._published.get(pid)
            if old is None:
                published[pid] = PublishedLink(pid, _round(up), _round(down), _round(est.rtt_ms))
            else:
                published[pid] = PublishedLink(
                    pid,
                    _steady(old.up_mbps, up),
                    _steady(old.down_mbps, down),
                    _steady(old.rtt_ms, est.rtt_ms, slack=RTT_SLACK_MS),
                )
        self._published = published
        return tuple(published.values())
