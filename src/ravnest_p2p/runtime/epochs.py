"""Which plan epochs a running stage accepts and sends, across an in-place switch to a new plan.

Problem: when the swarm re-plans, a cluster whose peers and layer split did not change keeps its
pipeline running (`training.continuity`); its stages move to the new epoch one by one, each when its
own supervisor sees the plan (up to a poll period apart). Until every stage of the cluster switched,
neighbours still send the old epoch; a stage that already switched must accept both, and must not send
the new epoch to a neighbour that would refuse it (a refused forward drops its micro-batch).

Rule: after `move_to(new)`, the stage accepts the new epoch and, for `transition_s`, the epochs it
served before (from the same cluster peers only: the handlers check the sender first). To each peer it
sends the newest epoch that peer is known to accept: the epoch of a message received from it, or of a
ping it answered (`runtime.liveness` probes a neighbour with the new epoch each heartbeat until it
answers); until then the old one. Once the transition window is over it sends the new epoch to everyone.
A stage never accepts an epoch newer than its own: a neighbour only sends it once we answered for it.

Alternatives rejected: accepting any epoch from the cluster's peers (a neighbour that restarted on a
changed cluster of a newer plan could then feed activations of another layer split); restarting the
pipeline with a brief flush (stalls the cluster, which is what the in-place switch avoids).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["EpochSwitch"]


class EpochSwitch:
    """The epochs one stage accepts and sends (see module docstring).

    Args:
        epoch: the epoch the stage starts on.
        transition_s: how long older epochs stay accepted after a switch.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self, epoch: int, *, transition_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.current = epoch
        self.transition_s = transition_s
        self._clock = clock
        self._older: dict[int, float] = {}  # an epoch served before -> accepted until (clock)
        self._known: dict[str, int] = {}  # peer -> newest epoch it is known to accept

    def move_to(self, epoch: int) -> None:
        """Switch to `epoch` (newer than the current one); older epochs stay accepted for a while."""
        if epoch <= self.current:
            raise ValueError(f"epoch {epoch} is not newer than {self.current}")
        now = self._clock()
        self._older = {e: until for e, until in self._older.items() if until > now}
        self._older[self.current] = now + self.transition_s
        self.current = epoch

    def _live_older(self) -> list[int]:
        now = self._clock()
        return sorted(e for e, until in self._older.items() if until > now)

    def accepts(self, epoch: int) -> bool:
        """Whether a message of `epoch` (from a cluster peer) is accepted now."""
        return epoch == self.current or epoch in self._live_older()

    def heard(self, peer_id: str, epoch: int) -> None:
        """`peer_id` sent (or answered) a message of `epoch`: it accepts that epoch."""
        if self.accepts(epoch) and epoch > self._known.get(peer_id, -1):
            self._known[peer_id] = epoch

    def for_peer(self, peer_id: str) -> int:
        """The epoch to put on a message to `peer_id`."""
        known = self._known.get(peer_id, -1)
        older = self._live_older()
        if known >= self.current or not older:
            return self.current
        fitting = [e for e in older if e <= known]
        return fitting[-1] if fitting else older[0]

    def pending(self, peer_id: str) -> int | None:
        """The current epoch if `peer_id` is not yet known to accept it (during a transition), else None."""
        return self.current if self.for_peer(peer_id) != self.current else None

    @property
    def in_transition(self) -> bool:
        return bool(self._live_older())
