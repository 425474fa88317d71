"""Every bound a peer puts on what others send it, in one place (docs/wire-limits.md explains them).

Problem. Anyone who knows a bootstrap address can open streams to every peer. A frame announces its
length before its body; reserving that length at once let four 8-byte streams make a training stage
reserve 1 GiB, and a stream that sent half a frame and stopped was never closed. Limits that disagree
(a gossip model accepting 20,000 items in an envelope whose header holds ~2,600) turn valid messages
into refusals.

So every cap below is defined here and the others are derived from it: the envelope's header cap, the
gossip model's item and bucket caps, the ring hello's cap. `tests/unit/foundation/test_limits.py`
builds the largest message each bounded model accepts and checks that it fits its envelope.

Sizes (constants):

==============================  ==========  ======================================================
name                            value       bounds
==============================  ==========  ======================================================
MAX_HEADER_BYTES                256 KiB     an envelope's msgpack header (every RPC message body)
GOSSIP_MAX_BUCKETS              4096        bucket digests / bucket lists of one gossip message
GOSSIP_ITEM_MAX_BYTES           180         one gossip item at its field caps, packed
GOSSIP_MAX_ITEMS                derived     items that fit the header with every bucket list full
GOSSIP_MAX_MESSAGE_BYTES        derived     a gossip_view request or reply (the header + prefix)
MAX_PROBE_BYTES                 16 MiB      a bandwidth probe's payload, either direction
MAX_RING_HELLO_BYTES            4 KiB       a ring stream's hello
==============================  ==========  ======================================================

Budgets and deadlines (`WireLimits`, per transport; defaults):

==============================  ==========  ======================================================
field                           default     what happens past it
==============================  ==========  ======================================================
max_inbound_per_peer            32          a further stream/unary call of that peer: ``busy``
max_bytes_per_peer              512 MiB     a frame announcing more than is left: ``busy``
max_bytes_total                 1 GiB       the same, over all peers together
max_inbound_total               1024        a further inbound stream/call from anyone: ``busy``
small_request_bytes             64 KiB      up to it a request takes a slot but no bytes
idle_timeout_s                  30 s        no byte on a stream that owes us one: closed
frame_floor_s / min_rate        30 s, 256   a frame must arrive within floor + size / rate
                                KiB/s
==============================  ==========  ======================================================

A refused stream gets an error frame and is closed without its body being read; a refused unary call
gets an error reply. Memory for a frame grows with the bytes that arrived (at most 4x them, never the
announced length up front), so what a stranger announces costs nothing until it sends it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "GOSSIP_ITEM_MAX_BYTES",
    "GOSSIP_MAX_BUCKETS",
    "GOSSIP_MAX_ITEMS",
    "GOSSIP_MAX_MESSAGE_BYTES",
    "GOSSIP_PEER_ID_MAX_CHARS",
    "KIB",
    "MAX_HEADER_BYTES",
    "MAX_PROBE_BYTES",
    "MAX_RING_HELLO_BYTES",
    "MIB",
    "WireLimits",
]

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

MAX_HEADER_BYTES = 256 * KIB
"""An envelope's msgpack header. Parsed in full into Python objects (up to ~60 bytes per header byte
for a hostile header of empty containers), so it stays small; tensors travel as blobs, not in it."""

# What the envelope adds around a message body: magic, header length, {"kind", "body", "blobs"} keys and
# the outer maps/arrays. Generous: the fit test measures the real figure.
ENVELOPE_OVERHEAD_BYTES = 256

GOSSIP_MAX_BUCKETS = 4096
GOSSIP_PEER_ID_MAX_CHARS = 128
_BUCKET_DIGEST_BYTES = 17  # a 16-hex-char string: fixstr header + 16
_BUCKET_INDEX_BYTES = 3  # an index < 65536: uint16 header + 2
GOSSIP_ITEM_MAX_BYTES = (
    1  # fixmap of 3
    + 8  # "peer_id"
    + 2
    + GOSSIP_PEER_ID_MAX_CHARS  # str8 header + the id
    + 8  # "version"
    + 9  # float64
    + 7  # "digest"
    + 17  # 16 hex chars
)
GOSSIP_MAX_ITEMS = (
    MAX_HEADER_BYTES
    - ENVELOPE_OVERHEAD_BYTES
    - 2 * 64  # the view digest field, its key and slack for the epoch
    - GOSSIP_MAX_BUCKETS * (_BUCKET_DIGEST_BYTES + _BUCKET_INDEX_BYTES)
) // GOSSIP_ITEM_MAX_BYTES
"""Items one gossip message may carry: what fits the header once every bucket list is at its cap
(999). A view diff larger than that (a swarm of thousands meeting for the first time) takes more
than one exchange."""

GOSSIP_MAX_MESSAGE_BYTES = MAX_HEADER_BYTES + 64
"""A gossip message is all header (no tensors): its envelope is the header plus the envelope prefix."""

MAX_PROBE_BYTES = 16 * MIB
MAX_RING_HELLO_BYTES = 4 * KIB


class WireLimits(BaseModel):
    """Per-peer and global budgets for inbound requests, and the deadlines of a frame on a stream.

    Budgets count what this peer holds for others' requests: concurrent inbound streams and unary calls
    (each holds a slot until it is answered), and bytes (a stream frame reserves its announced length
    before its body is read; a unary call its size). Over a budget the request is refused at once.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_inbound_per_peer: int = Field(default=32, ge=1)
    max_inbound_total: int = Field(default=1024, ge=1)
    max_bytes_per_peer: int = Field(default=512 * MIB, ge=1)
    max_bytes_total: int = Field(default=1 * GIB, ge=1)
    # requests (and replies) up to this size take a slot but no bytes: at most slots x this in all
    small_request_bytes: int = Field(default=64 * KIB, ge=0)
    # a stream that owes us bytes (a request not yet complete, a reply) and sends none for this long
    idle_timeout_s: float = Field(default=30.0, gt=0)
    # a frame of n bytes must be complete within frame_floor_s + n / min_rate_bytes_per_s of its start
    frame_floor_s: float = Field(default=30.0, gt=0)
    min_rate_bytes_per_s: float = Field(default=256 * KIB, gt=0)

    def frame_timeout_s(self, size_bytes: int) -> float:
        """How long a frame of `size_bytes` may take to arrive."""
        return self.frame_floor_s + size_bytes / self.min_rate_bytes_per_s
