"""When to plan and when to re-plan: view stability, hysteresis, join delay, grace, silent members.

Problem. Volunteers come and go, and DHT reads flicker (a replica misses a record for one read).
Re-planning moves stages between peers, which costs minutes of transfer and warm-up, so a new epoch must
open only for a real membership change, and a plan must be computed only once views have settled.

Rules (DESIGN.md §4 "Gossip agreement", made precise):
- *Forming*: compute the plan when the view digest has been unchanged for ``stable_rounds`` rounds
  *and* ``hysteresis_s`` has passed since it last changed. A change while forming or proposed only
  resets stability (same epoch: nothing was agreed yet, so nothing to re-open).
- *Proposed*: our digest is published; the plan is active once every member it names published the
  same digest. Past ``agreement_timeout_s`` the caller drops members that published nothing and a new
  epoch opens without them.
- *Active*: a new epoch opens when a live non-member has been seen for ``join_delay_s`` (batching
  joins), or a member has been missing for ``grace_s`` (a blip shorter than that is forgotten).
- Epoch numbers only grow; hearing a higher epoch from a peer can move us to it (forming). Two peers
  that saw the same change a round apart thus land on the same epoch, and the plan is a function of
  ``(view, epoch)`` only.
- *Who may move our epoch* (`backed_epoch`). A heard epoch is a claim, adopted only when members'
  signed records back it: (1) the claimant must be a live member — a valid signed `PeerRecord` in our
  own directory, not excluded (strangers' claims are dropped unread); (2) we adopt at most
  ``max(epoch in live members' signed peer records) + 1`` (records carry the epoch of each member's
  active plan), or the claimed ``E`` itself when a live member *other than the claimant* has published
  a signed plan digest for ``E - 1`` (or ``E``); a larger claim is clamped to that bound, never
  refused outright, so an honest peer that moved ahead still pulls the others up one backed step at a
  time. Epochs never exceed ``MAX_EPOCH`` (the records' cap).

Alternatives rejected: re-planning on every view change with a debounce only (a flapping peer then
re-plans forever); adopting any higher epoch heard (one unauthenticated `gossip_view` with epoch
2^62 moved every peer there and the next re-plan overflowed the record's cap, so peers stopped
announcing; one with epoch + 1 forced a swarm-wide re-plan).

Limit: a *member* can still claim one epoch past what the records show and cost one re-plan per
agreed epoch; it cannot climb further alone, since the next step needs another member's digest.

This module is pure: the caller passes ``now`` (monotonic seconds) and the current view facts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["MAX_EPOCH", "Action", "EpochTracker", "Phase", "Timing", "backed_epoch"]

MAX_EPOCH = 2**62  # `PeerRecord.epoch`'s cap: an epoch past it could never be announced


def backed_epoch(claim: int, *, record_epochs: Iterable[int], previous_published_by_other: bool) -> int:
    """The highest epoch members' signed records back for a member's ``claim`` (rule in the docstring).

    Args:
        claim: the epoch a live member claims.
        record_epochs: the epochs in live members' signed peer records.
        previous_published_by_other: a live member other than the claimant signed a plan digest for
            ``claim - 1`` (or ``claim``).
    """
    bound = max(record_epochs, default=0) + 1
    if previous_published_by_other:
        bound = max(bound, claim)
    return min(claim, bound, MAX_EPOCH)


class Phase(StrEnum):
    FORMING = "forming"
    PROPOSED = "proposed"
    ACTIVE = "active"


class Action(StrEnum):
    NONE = "none"
    PROPOSE = "propose"  # compute the plan for the current epoch and publish its digest
    TIMEOUT = "timeout"  # the proposal was not agreed in time: find the silent members
    NEW_EPOCH = "new_epoch"  # membership changed for real: the epoch was incremented


@dataclass(frozen=True)
class Timing:
    stable_rounds: int = 3
    hysteresis_s: float = 3.0
    join_delay_s: float = 10.0
    grace_s: float = 15.0
    agreement_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.stable_rounds < 1 or min(self.hysteresis_s, self.join_delay_s, self.grace_s) < 0:
            raise ValueError("stable_rounds must be >= 1 and durations >= 0")
        if self.agreement_timeout_s <= 0:
            raise ValueError("agreement_timeout_s must be positive")


@dataclass
class EpochTracker:
    timing: Timing = field(default_factory=Timing)
    epoch: int = 0
    phase: Phase = Phase.FORMING
    members: frozenset[str] = frozenset()
    stable_count: int = 0
    _last_digest: str | None = None
    _last_change_at: float = 0.0
    proposed_at: float = 0.0  # when the current proposal was made (the agreement timeout's start)
    _first_seen: dict[str, float] = field(default_factory=dict)
    _missing_since: dict[str, float] = field(default_factory=dict)

    def tick(self, now: float, view_digest: str, live_ids: frozenset[str]) -> Action:
        """One round: update stability, then decide. Call once per gossip period."""
        if view_digest != self._last_digest:
            self._last_digest = view_digest
            self._last_change_at = now
            self.stable_count = 0
            if self.phase == Phase.PROPOSED:
                self.phase = Phase.FORMING
        else:
            self.stable_count += 1
        if self.phase == Phase.FORMING:
            stable = (
                self.stable_count >= self.timing.stable_rounds
                and now - self._last_change_at >= self.timing.hysteresis_s
            )
            return Action.PROPOSE if stable and live_ids else Action.NONE
        if self.phase == Phase.PROPOSED:
            if now - self.proposed_at >= self.timing.agreement_timeout_s:
                return Action.TIMEOUT
            return Action.NONE
        return self._active_tick(now, live_ids)

    def _active_tick(self, now: float, live_ids: frozenset[str]) -> Action:
        for pid in live_ids - self.members:
            self._first_seen.setdefault(pid, now)
        for pid in set(self._first_seen) - live_ids:
            del self._first_seen[pid]
        for pid in self.members - live_ids:
            self._missing_since.setdefault(pid, now)
        for pid in set(self._missing_since) & live_ids:
            del self._missing_since[pid]  # back before the grace ran out: a blip
        joined = any(now - t >= self.timing.join_delay_s for t in self._first_seen.values())
        left = any(now - t >= self.timing.grace_s for t in self._missing_since.values())
        if joined or left:
            self.open_epoch(self.epoch + 1)
            return Action.NEW_EPOCH
        return Action.NONE

    def proposed(self, now: float, members: frozenset[str]) -> None:
        """The caller computed and published the plan naming ``members``."""
        self.phase = Phase.PROPOSED
        self.members = members
        self.proposed_at = now

    def activated(self) -> None:
        """Every member published our digest."""
        self.phase = Phase.ACTIVE
        self._first_seen.clear()
        self._missing_since.clear()

    def open_epoch(self, epoch: int) -> bool:
        """Move to ``epoch`` (forming) if it is newer than ours; True if we moved."""
        if epoch <= self.epoch or epoch > MAX_EPOCH:
            return False
        self.epoch = epoch
        self.phase = Phase.FORMING
        self._first_seen.clear()
        self._missing_since.clear()
        return True

    def retry(self, now: float) -> None:
        """After a timeout with nobody to drop: go back to forming and propose again when stable."""
        self.phase = Phase.FORMING
        self._last_change_at = now
        self.stable_count = 0
