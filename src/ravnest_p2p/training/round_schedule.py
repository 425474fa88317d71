"""Which averaging round a replica starts, and under which index: the indices every replica agrees on.

Problem. Replicas pair a round by its index: the ring members of a shard only average together when they
run the same round number. Round r comes due on each replica when it finishes step r x period (or at
r x period seconds of the clock). The first design gave a round that came due while the previous one
still ran the index of the newest due period when it started. A round that outlasts the period ends
at about the same moment on every member of its ring (they finish it together), but at different
steps: each cluster's step count runs on its own, and clusters start training seconds apart (lab, 4
clusters, every step: the first rounds began 4 s, ~60 steps, apart). So the deferred indices almost
never matched: 4 of 1062 and 12 of 903 peer-rounds had all 4 replicas (every step), 8 of 353 in a
600-step run.

The rule (`RoundSchedule`):
- A round that comes due while this replica is idle takes the period's index (step // period, or the
  clock's), and never an index at or below the last one (it takes last + 1 then). While rounds are
  shorter than the period this is the step index, unchanged: the outer optimizer's sync k runs at step
  k x H, under index k.
- A round that comes due while the previous one (index r) runs is deferred; it starts when that one
  ends, as round r + 1 (more due periods meanwhile add nothing: they count as skipped). Members that
  ran round r together all run r + 1 next: rounds that outlast the period pair in lockstep.
- Out of phase: when a round with a deferred one behind it did not average with every member of its
  rings, the members' counters (or steps) disagree — some started late, ran another round, or one
  died. The deferred round then starts at once under the index of the wall clock's latest
  `RESYNC_S` boundary, x `RESYNC_SLOTS` (above every step index, and above the lockstep rounds of the
  previous boundaries unless more than `RESYNC_SLOTS` ran in one `RESYNC_S`); by clock
  (`averaging_period_s`), the period's own index. Members whose rounds end at about the same time (a
  ring's members finish together; a refused member fails within a round trip) take the same index,
  and a member already in that round waits for the others (the ring's step deadline). Waiting for the
  next boundary instead locked two groups into alternate boundaries on the lab (a failing round
  outlasted `RESYNC_S`), as skipping rounds once did.
- A round without a deferred one behind it that misses a member changes nothing (periods longer than
  rounds: a late cluster still pairs by index within the ring's step deadline, as before).

- A new plan (`ReplicaAverager.rebase`) starts the counter over: its rings are new, and a replica that
  joins them fresh knows only the step index.

Limits. Two groups whose rounds end on either side of a boundary take different indices once more
(chance ~ the gap / `RESYNC_S`) and meet a round later. With a member dead for good every round
misses it and takes the clock's index; those rounds still pair among the living if they end together.
Clocks must agree to well under `RESYNC_S` (NTP does). Staggered outer syncs (`averaging/stagger.py`)
keep their own step-derived indices.
"""

from __future__ import annotations

__all__ = ["RESYNC_S", "RESYNC_SLOTS", "RoundSchedule"]

# out of phase, a replica restarts at a multiple of this many seconds of the wall clock
RESYNC_S = 2.0
# resync indices are the boundary's index times this: room for the lockstep rounds between two of them
RESYNC_SLOTS = 64


class RoundSchedule:
    """The module's index rule for one replica (pure, no I/O)."""

    def __init__(self) -> None:
        self.last = 0  # the index of the last round started
        self.pending = False  # a period came due while the last round ran
        self.skipped = 0  # due periods that started no round of their own

    def due(self, index: int, *, busy: bool) -> int | None:
        """Period `index` came due (step // period, or the clock's); the round to start now, or None."""
        if busy:
            self.skipped += self.pending
            self.pending = True
            return None
        return self._take(index)

    def finished(self, *, complete: bool, resync_index: int) -> int | None:
        """The running round ended; the round to start now, or None.

        `complete`: every ring averaged with all its members. `resync_index`: the index out of phase
        (the latest `RESYNC_S` boundary x `RESYNC_SLOTS`, or by clock the current period's).
        """
        pending, self.pending = self.pending, False
        if not pending:
            return None
        return self._take(self.last + 1 if complete else resync_index)

    def new_epoch(self) -> None:
        """A new plan's rings (new ring ids): indices start over from the step index, which a replica
        new to the rings (it has no counter) also takes."""
        self.last = 0

    def _take(self, index: int) -> int:
        self.last = max(index, self.last + 1)
        return self.last
