"""The domain error tree.

Callers catch these, never hivemind's or p2pd's exceptions: the transport boundary translates them.
`ValueError` stays the answer to bad *user* input (flags, config); these are for things that go wrong
between peers.
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "ConfigError",
    "DeadlineExceeded",
    "DiscoveryError",
    "IdentityError",
    "InvalidMessage",
    "InvalidRecord",
    "NeighbourLost",
    "PayloadTooLarge",
    "PeerUnreachable",
    "RateLimited",
    "RavnestError",
    "RemoteError",
    "StaleEpoch",
    "TransportError",
]


class RavnestError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(RavnestError, ValueError):
    """A user-supplied configuration is invalid (bad flag, bad config file)."""


class IdentityError(RavnestError):
    """The peer identity file cannot be read or created."""


class TransportError(RavnestError):
    """Anything that went wrong moving bytes between peers."""


class PeerUnreachable(TransportError):
    """The remote peer could not be dialled or went away mid-call."""


class DeadlineExceeded(TransportError, TimeoutError):
    """A remote call did not finish before its deadline."""


class RemoteError(TransportError):
    """The remote handler answered with an error reply.

    Attributes:
        code: a short machine-readable reason from the remote side (e.g. ``invalid_message``).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidMessage(RavnestError):
    """A message is malformed or does not match what the receiver expects; no state was touched."""

    code = "invalid_message"


class PayloadTooLarge(InvalidMessage):
    """A message is larger than the receiver accepts."""

    code = "payload_too_large"

    def __init__(self, message: str, *, size_bytes: int = 0) -> None:
        super().__init__(message)
        self.size_bytes = size_bytes


class StaleEpoch(InvalidMessage):
    """A message carries a plan epoch the receiver is no longer (or not yet) in."""

    code = "stale_epoch"


class CodecError(InvalidMessage):
    """Bytes could not be decoded into the tensor they claim to be."""

    code = "codec_error"


class DiscoveryError(RavnestError):
    """The DHT could not be joined or queried."""


class InvalidRecord(DiscoveryError, ValueError):
    """A DHT record failed validation (range, NaN, schema version, signature binding)."""


class RateLimited(InvalidMessage):
    """A sender sent more messages than the receiver accepts from it per unit of time; refused cheaply."""

    code = "rate_limited"


class NeighbourLost(RavnestError):
    """A pipeline neighbour stopped answering (or was excluded for misbehaving); the stage gave up.

    Attributes:
        peer_id: the suspect; callers pass it to `MembershipService.report_suspect`.
        reason: why it is suspected (e.g. ``"no answer for 6.0s"``, ``"excluded: 20 refused messages"``).
    """

    def __init__(self, peer_id: str, reason: str) -> None:
        super().__init__(f"pipeline neighbour {peer_id} lost: {reason}")
        self.peer_id = peer_id
        self.reason = reason
