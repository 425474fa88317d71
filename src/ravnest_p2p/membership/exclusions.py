"""Which peers this member leaves out of its view, until when, and when one may come back early.

A peer is excluded for `exclude_for_s` when it is found dead (a verified suspect), silent on a plan,
or misbehaving. A peer excluded as dead or silent is back as soon as it signs a ready record after the
exclusion (by `RETURN_MARGIN_S` of clock skew): a restarted peer, or a member that was only slow; a dead
peer signs nothing new. Its exclusion then ends at once, so every member that reads the record includes
it again at the next epoch instead of each waiting out its own timer (timers that ended at different
moments kept the views of a churning swarm from ever matching: 10 minutes without an active plan in
the churn soak). A peer comes back early at most once per `exclude_for_s` (a live peer that keeps
stalling agreement waits the time out), and a misbehaving peer never does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from ravnest_p2p.discovery import PeerRecord

__all__ = ["RETURN_MARGIN_S", "Exclusions"]

logger = logging.getLogger(__name__)

RETURN_MARGIN_S = 5.0  # a record must be this much newer than the exclusion to end it (clock skew)


class Exclusions:
    """Exclusion times by peer (`clock`), and the wall times (`wall_clock`, as records carry) of the
    exclusions a new record may end."""

    def __init__(
        self, exclude_for_s: float, *, clock: Callable[[], float], wall_clock: Callable[[], float]
    ) -> None:
        self.exclude_for_s = exclude_for_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._until: dict[str, float] = {}
        self._may_return: dict[str, float] = {}  # peer -> wall time of an exclusion a record may end
        self._returned_at: dict[str, float] = {}

    def exclude(self, peer_id: str, *, may_return: bool) -> None:
        """Exclude `peer_id` for `exclude_for_s`; `may_return`: dead or silent, not misbehaving."""
        self._until[peer_id] = self._clock() + self.exclude_for_s
        now = self._wall_clock()
        if may_return and now - self._returned_at.get(peer_id, -math.inf) >= self.exclude_for_s:
            self._may_return[peer_id] = now
        else:
            self._may_return.pop(peer_id, None)

    def is_excluded(self, peer_id: str) -> bool:
        return self._until.get(peer_id, -1.0) > self._clock()

    def admits(self, record: PeerRecord) -> bool:
        """Whether `record`'s peer is not excluded, or is back (its exclusion then ends)."""
        if not self.is_excluded(record.peer_id):
            return True
        excluded_at = self._may_return.get(record.peer_id)
        if excluded_at is None or record.updated_at <= excluded_at + RETURN_MARGIN_S:
            return False
        del self._may_return[record.peer_id]
        self._until.pop(record.peer_id, None)
        self._returned_at[record.peer_id] = self._wall_clock()
        logger.info(
            "%s is back (a record of epoch %d signed after its exclusion)", record.peer_id, record.epoch
        )
        return True
