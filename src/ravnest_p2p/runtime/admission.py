"""Which micro-batch ids a downstream stage still accepts: no replays, nothing outside the window.

Problem. A forward for a micro-batch that already completed here passes every type check, yet
processing it again trains on it twice (the last stage would even step its optimizer on it). The
first stage issues ids in increasing order and keeps at most a window of them in flight, so a
downstream stage can refuse, before any state changes:

* a *replay*: an id that completed here (backward done, loss computed, evaluated, or dropped);
* an id *outside the window*: more than ``span`` below or above the highest id accepted so far.

``span`` is generous (several windows, and room for a burst of evaluation ids, which share the id
space): the check exists to bound what a sender can make us remember and to refuse ancient or absurd
ids, not to police ordering, which the network does not preserve. Completed ids are remembered only
while they are inside the window; older ones are refused by the window itself.
"""

from __future__ import annotations

from ravnest_p2p.errors import InvalidMessage

__all__ = ["MicroBatchIds"]


class MicroBatchIds:
    """Replay and window check of one stage for one epoch."""

    def __init__(self, *, span: int) -> None:
        if span < 1:
            raise ValueError("span must be positive")
        self.span = span
        self.horizon = -1  # highest id accepted
        self._done: set[int] = set()

    def check(self, micro_batch_id: int) -> None:
        """Raise `InvalidMessage` for a replay or an id outside the window; changes nothing."""
        mb = micro_batch_id
        if mb in self._done:
            raise InvalidMessage(f"micro-batch {mb} already completed here (replay)")
        if mb <= self.horizon - self.span or mb > self.horizon + self.span:
            low, high = self.horizon - self.span, self.horizon + self.span
            raise InvalidMessage(f"micro-batch {mb} outside the window ({low}, {high}]")

    def accept(self, micro_batch_id: int) -> None:
        """The id passed `check` and was queued."""
        if micro_batch_id > self.horizon:
            self.horizon = micro_batch_id
            if len(self._done) > 2 * self.span:
                floor = self.horizon - self.span
                self._done = {mb for mb in self._done if mb > floor}

    def done(self, micro_batch_id: int) -> None:
        """The id completed (or was dropped) here: any later copy is a replay."""
        self._done.add(micro_batch_id)

    def is_done(self, micro_batch_id: int) -> bool:
        return micro_batch_id in self._done
