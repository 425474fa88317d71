"""Wire messages of the ring all-reduce: a ring stream's hello, the liveness probe and the result fetch.

The probe and the fetch are RPCs; parts travel over the ring's own streams (`frames.py`).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from ravnest_p2p.transport import RpcMethod
from ravnest_p2p.types import WireModel

__all__ = [
    "RESULT_CHUNK_NUMEL",
    "RING_RESULT",
    "RING_STATUS",
    "ResultReply",
    "ResultRequest",
    "StatusReply",
    "StatusRequest",
    "StreamHello",
]


class StreamHello(WireModel):
    """The first frame of a ring stream: which ring, round and attempt every following part belongs to.

    The receiver derives everything else (expected chunks, part bounds) from its own session and refuses
    the stream unless every field matches.
    """

    ring_id: str = Field(max_length=128)
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    attempt: int = Field(ge=0, le=1000)
    members_digest: str = Field(max_length=64)
    chunks_digest: str = Field(default="", max_length=64)  # the attempt's chunk boundaries
    codec: str = Field(default="", max_length=32)  # a Δ wire codec (`deltawire.py`), "" = `compression`


class StatusRequest(WireModel):
    """ "Are you in this round?" — sent by a member whose attempt `failed_attempt` failed."""

    ring_id: str = Field(max_length=128)
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    failed_attempt: int = Field(ge=0, le=1000)


class StatusReply(WireModel):
    alive: bool
    attempt: int = Field(ge=0, le=1000)
    done: bool = False
    # not in the round yet, but a member of this epoch's ring that will reach it (a final round waits)
    behind: bool = False
    # bounded so that a maximal reply fits its envelope (tests/unit/foundation/test_limits.py)
    members: list[Annotated[str, StringConstraints(max_length=128)]] = Field(
        default_factory=list, max_length=1024
    )
    # the attempt whose complete result this member holds (it serves `ring_result`), -1 = none
    holds: int = Field(default=-1, ge=-1, le=1000)


class ResultRequest(WireModel):
    """ "Send me elements [offset, offset + numel) of the mean of `attempt`" (`commit.py`)."""

    ring_id: str = Field(max_length=128)
    epoch: int = Field(ge=0)
    round: int = Field(ge=0)
    attempt: int = Field(ge=0, le=1000)
    offset: int = Field(ge=0)
    numel: int = Field(ge=1, le=1 << 18)


class ResultReply(WireModel):
    """With one fp32 tensor of the requested elements when `available`; none otherwise."""

    available: bool


RESULT_CHUNK_NUMEL = 1 << 18  # elements per fetch (1 MiB of fp32: a unary reply)


RING_STATUS = RpcMethod("ring_status", StatusRequest, StatusReply, max_request_bytes=4096, max_tensors=0)
RING_RESULT = RpcMethod(
    "ring_result",
    ResultRequest,
    ResultReply,
    max_request_bytes=4096,
    max_response_bytes=4 * RESULT_CHUNK_NUMEL + 4096,
    max_tensors=1,
)
