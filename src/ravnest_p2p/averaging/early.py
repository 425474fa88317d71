"""Who may hold a stream open waiting for a ring round this member has not reached yet ("early").

Problem. Ring members start a round at about the same time, never exactly: a left neighbour's part
stream often arrives before this member created its session, and waits (unread, bounded by the step
deadline) instead of being refused. Those waiting streams must be capped (each holds a daemon stream
and a task), and a single cap shared by everyone let an outsider fill it: the honest neighbour's stream
was then refused ``busy`` and the round failed.

Policy. For a ring this member expects (the shard map of its current or last round, or one announced
with `expect`), only members of that ring may wait, at most `PER_PEER` streams each, and they do not
count against the shared cap: no outsider can make a partner ``busy``. A stream for a ring this member
does not know yet (its first round, before the map was handed over) may wait only if the optional
allow-list callback admits the sender; without one it goes to a shared pool (`max_total` streams,
`PER_PEER` per sender). Limit: without the map or a callback, several outsider identities together can
still fill the shared pool; give the ring its shard map (`RingAllReduce.expect`) before the round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from ravnest_p2p.averaging.session import RingRefused
from ravnest_p2p.averaging.shards import ShardMap

__all__ = ["PER_PEER", "AllowEarly", "EarlySlots"]

PER_PEER = 8  # a member opens at most `RingConfig.streams_per_neighbour` (<= 8) streams per attempt

AllowEarly = Callable[[str, str], bool]
"""(ring id, sender peer id) -> whether the sender may wait for a ring this member does not know yet."""


class EarlySlots:
    """Counts the early streams waiting at this member and decides who may add one.

    Args:
        max_total: streams of senders outside the expected rings that may wait at once (all together).
        allow: the optional allow-list for rings this member does not know yet (see `AllowEarly`).
    """

    def __init__(self, max_total: int, allow: AllowEarly | None = None) -> None:
        self.max_total = max_total
        self.allow = allow
        self._current: dict[str, frozenset[str]] = {}  # ring id -> its members, of the expected map
        self._previous: dict[str, frozenset[str]] = {}
        self._members: dict[str, frozenset[str]] = {}  # both
        self._held: dict[str, int] = {}  # sender -> early streams waiting
        self._shared = 0
        self.refused = 0

    def expect(self, shard_map: ShardMap) -> None:
        """The rings of `shard_map` are the ones whose members may wait (with those of the map before
        it, so that a round of the last epoch still finishing keeps its partners)."""
        current = {shard.ring_id: frozenset(shard.ring) for shard in shard_map.shards}
        if current != self._current:
            self._previous, self._current = self._current, current
            self._members = {**self._previous, **self._current}

    @contextlib.contextmanager
    def hold(self, ring_id: str, sender: str) -> Iterator[None]:
        """Hold an early slot for `sender`'s stream of ring `ring_id` while the block runs.

        Raises:
            RingRefused: ``not_partner`` (the sender is not a member of a ring this member expects, or
                the allow-list refused it) or ``busy`` (the sender's or the shared slots are taken).
        """
        members = self._members.get(ring_id)
        if members is not None and sender not in members:
            self.refused += 1
            raise RingRefused("not_partner", f"{ring_id}: {sender} is not a member")
        if members is None and self.allow is not None and not self.allow(ring_id, sender):
            self.refused += 1
            raise RingRefused("not_partner", f"{ring_id}: {sender} may not wait for an unknown ring")
        shared = members is None and self.allow is None
        held = self._held.get(sender, 0)
        if held >= PER_PEER or (shared and self._shared >= self.max_total):
            self.refused += 1
            raise RingRefused("busy", "too many early streams waiting")
        self._held[sender] = held + 1
        self._shared += shared
        try:
            yield
        finally:
            self._shared -= shared
            if self._held[sender] <= 1:
                del self._held[sender]
            else:
                self._held[sender] -= 1

    def waiting(self) -> int:
        return sum(self._held.values())
