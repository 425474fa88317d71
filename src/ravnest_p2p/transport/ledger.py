"""What a peer holds against the peers that send it messages: refusals counted, rates limited.

Problem. A message a peer refuses (bad epoch, a replayed micro-batch, out-of-range labels, activations
past the magnitude bound, a gossip flood) must cost its *sender*, never the receiver's stage or the
swarm. Refusing one message is cheap; a sender that keeps doing it must stop being served, and the
membership layer must plan around it (SWARM parallelism, Ryabinin et al. 2023, and petals both ban
servers that misbehave, for a while, on the client's own evidence).

Two tools, both pure (the caller passes ``now``):

* `PeerLedger` counts refusals per sender and plan epoch. At ``threshold`` refusals in one epoch the
  sender is *excluded* for that epoch: its further messages are refused before any parsing beyond the
  envelope, and ``on_exclude(peer_id, reason)`` fires once (the stage service wires it to membership,
  which re-plans around the peer). A new epoch forgives: the counts restart, since a re-plan is what
  the exclusion asks for and the peer may have been restarted or fixed.
* `RateLimiter` is a per-sender token bucket (rate, burst). It bounds what a stranger can make us do
  per second (e.g. gossip requests); an empty bucket is a cheap refusal. Buckets of senders idle past
  a refill are forgotten, so a flood of fresh identities costs at most ``max_senders`` entries.

Alternatives rejected: a global rate limit (one flooder would starve every honest peer); a decaying
score instead of a per-epoch count (harder to state and to test; the epoch is already the unit of
"who serves whom").

Limits: counts are local evidence; another peer learns of an exclusion only through membership's
signed suspect reports, which it checks itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["PeerLedger", "RateLimiter"]

logger = logging.getLogger(__name__)


class PeerLedger:
    """Per-sender refusal counts for the current epoch; excludes a sender at ``threshold``.

    Args:
        threshold: refusals in one epoch that exclude a sender (>= 1).
        on_exclude: called once per (sender, epoch) when it is excluded, with a reason.
    """

    def __init__(self, *, threshold: int, on_exclude: Callable[[str, str], None] | None = None) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        self.threshold = threshold
        self.on_exclude = on_exclude
        self.epoch = 0
        self.refused: Counter[str] = Counter()
        self.reasons: dict[str, str] = {}
        self.excluded: set[str] = set()
        self.total_refused = 0

    def new_epoch(self, epoch: int) -> None:
        """Forget counts and exclusions of older epochs (no-op for the same or an older epoch)."""
        if epoch <= self.epoch:
            return
        self.epoch = epoch
        self.refused.clear()
        self.reasons.clear()
        self.excluded.clear()

    def is_excluded(self, peer_id: str) -> bool:
        return peer_id in self.excluded

    def count(self, peer_id: str, reason: str) -> bool:
        """Count one refused message of ``peer_id``; True if this made it excluded."""
        self.total_refused += 1
        self.refused[peer_id] += 1
        self.reasons[peer_id] = reason
        if peer_id in self.excluded or self.refused[peer_id] < self.threshold:
            return False
        self.excluded.add(peer_id)
        why = f"{self.refused[peer_id]} refused messages in epoch {self.epoch}, last: {reason}"
        logger.warning("excluding %s for epoch %d: %s", peer_id, self.epoch, why)
        if self.on_exclude is not None:
            self.on_exclude(peer_id, why)
        return True


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Per-sender token buckets: ``rate_per_s`` refill, ``burst`` capacity, at most ``max_senders`` kept."""

    def __init__(self, *, rate_per_s: float, burst: float, max_senders: int = 4096) -> None:
        if rate_per_s <= 0 or burst < 1 or max_senders < 1:
            raise ValueError("need rate_per_s > 0, burst >= 1, max_senders >= 1")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_senders = max_senders
        self._buckets: dict[str, _Bucket] = {}
        self.num_refused = 0

    def allow(self, peer_id: str, now: float) -> bool:
        """Take one token from ``peer_id``'s bucket; False (and nothing else) if it is empty."""
        bucket = self._buckets.get(peer_id)
        if bucket is None:
            if len(self._buckets) >= self.max_senders:
                self._forget_full(now)
            bucket = self._buckets[peer_id] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate_per_s)
            bucket.at = now
        if bucket.tokens < 1.0:
            self.num_refused += 1
            return False
        bucket.tokens -= 1.0
        return True

    def _forget_full(self, now: float) -> None:
        # buckets that would be full again carry no memory worth keeping
        refill_s = self.burst / self.rate_per_s
        for pid in [p for p, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[pid]
        if len(self._buckets) >= self.max_senders:  # a flood of fresh ids: drop the oldest half
            for pid in sorted(self._buckets, key=lambda p: self._buckets[p].at)[: self.max_senders // 2]:
                del self._buckets[pid]
