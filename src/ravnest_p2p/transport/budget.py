"""What this peer holds for other peers' requests: slots and bytes, per remote peer and in total.

Why. Memory for a request is spent on behalf of whoever sent it; without a bound per sender one peer
(or anyone who knows an address) can take all of it, and the honest previous stage's activations are
then the ones that fail. Each inbound stream or unary call takes a slot (`admit`); a stream frame then
reserves its announced length (`Lease.reserve`) before one byte of its body is read, a unary call its
size. Over either budget the request is refused at once: the sender learns ``busy``, nothing is read.

Alternatives rejected: a global semaphore (one flooder starves everyone, including the pipeline);
counting bytes as they arrive (the refusal would come after the memory was spent, and a slow sender
holds its announced promise anyway). Small requests (`WireLimits.small_request_bytes`: pings,
control messages) take a slot but no bytes, so identities that fill the byte budget with large
announcements cannot stop them. Limit: a peer id is cheap to make, so the totals (`WireLimits`) are
what bounds many identities together; they bound memory, not fairness between identities: several
identities trickling large frames can keep an honest large frame (an activation) waiting for room.
"""

from __future__ import annotations

from dataclasses import dataclass

from ravnest_p2p.transport.limits import WireLimits

__all__ = ["InboundBudget", "Lease"]


@dataclass(slots=True)
class _Usage:
    slots: int = 0
    bytes: int = 0


class Lease:
    """One admitted inbound request: its slot, and the bytes it reserved. Release exactly once."""

    __slots__ = ("_budget", "_released", "peer_id", "reserved_bytes")

    def __init__(self, budget: InboundBudget, peer_id: str) -> None:
        self._budget = budget
        self.peer_id = peer_id
        self.reserved_bytes = 0
        self._released = False

    def reserve(self, size_bytes: int) -> bool:
        """Reserve `size_bytes` more for this request; False (nothing reserved) if over a budget."""
        return self._budget._reserve(self, size_bytes)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._budget._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class InboundBudget:
    """Slots and bytes held for inbound requests, per remote peer and in total (see `WireLimits`)."""

    def __init__(self, limits: WireLimits) -> None:
        self.limits = limits
        self._peers: dict[str, _Usage] = {}
        self._total = _Usage()
        self.refused = 0  # requests and reservations refused
        self.reservations = 0  # reservations granted

    def admit(self, peer_id: str, size_bytes: int = 0) -> Lease | None:
        """A slot for a new request of `peer_id` (and `size_bytes` reserved), or None if over budget."""
        usage = self._peers.get(peer_id)
        if usage is None:  # one record per peer with something in progress, made on its first request
            usage = _Usage()
        if (
            usage.slots >= self.limits.max_inbound_per_peer
            or self._total.slots >= self.limits.max_inbound_total
        ):
            self.refused += 1
            return None
        if usage.slots == 0:
            self._peers[peer_id] = usage
        usage.slots += 1
        self._total.slots += 1
        lease = Lease(self, peer_id)
        if size_bytes and not lease.reserve(size_bytes):
            lease.release()
            return None
        return lease

    def _reserve(self, lease: Lease, size_bytes: int) -> bool:
        if size_bytes <= self.limits.small_request_bytes:
            return True  # bounded by the slots: a ping passes even when big announcements fill the bytes
        usage = self._peers[lease.peer_id]
        if (
            usage.bytes + size_bytes > self.limits.max_bytes_per_peer
            or self._total.bytes + size_bytes > self.limits.max_bytes_total
        ):
            self.refused += 1
            return False
        usage.bytes += size_bytes
        self._total.bytes += size_bytes
        lease.reserved_bytes += size_bytes
        self.reservations += 1
        return True

    def _release(self, lease: Lease) -> None:
        usage = self._peers[lease.peer_id]
        usage.slots -= 1
        usage.bytes -= lease.reserved_bytes
        self._total.slots -= 1
        self._total.bytes -= lease.reserved_bytes
        if usage.slots == 0:
            del self._peers[lease.peer_id]

    def held(self, peer_id: str | None = None) -> tuple[int, int]:
        """(slots, bytes) held for `peer_id`, or for everyone."""
        usage = self._total if peer_id is None else self._peers.get(peer_id, _Usage())
        return usage.slots, usage.bytes
