"""Wire records of synchronous SGD with backup workers (`training.sync_runner`), and their tensor checks.

One method carries a step: a worker sends one `SyncPush` per owner, with a part (`PushPart`) for every
shard that owner holds: its gradient of the shard, tagged with the step t it was computed at, tensors of
all parts in order (each part's in the order of its `names`). The owner answers once every part's shard
has moved past t (or at once for parts already past it, or when `wait_s` runs out) with `SyncReply`: a
`ReplyPart` per shard, with the shard's parameters at the part's step. A part without gradients is a
fetch ("the shard once it reaches step t"), used to catch up. One message per owner rather than per
shard: each message costs the N-th worker and the owners CPU on the step's critical path (Python, the
codec, the daemon), and after a failover a survivor owns several shards. `sync_ping` answers whether a
peer is alive and still in the job.

Everything from the network is checked before use: the body by pydantic (strict numbers, bounded
lists), the sender against the job's workers, every part's tensors (count, names, shapes, dtypes,
finiteness) against its shard (`split_parts`, `check_tensors`); tensors are decoded by the codec, never
unpickled.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import torch
from pydantic import Field

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.transport.limits import MIB
from ravnest_p2p.transport.rpc import RpcMethod
from ravnest_p2p.types import WireModel

__all__ = [
    "SYNC_PING",
    "SYNC_PUSH",
    "PushPart",
    "ReplyKind",
    "ReplyPart",
    "SyncPing",
    "SyncPong",
    "SyncPush",
    "SyncReply",
    "check_tensors",
    "split_parts",
]

_MAX_NAMES = 4096
_PEER_ID = Field(min_length=1, max_length=128)


class ReplyKind(enum.StrEnum):
    APPLIED = "applied"  # the step completed (this gradient counted, or a fetch): parameters at step + 1
    LATE = "late"  # the shard was already past the step: dropped; parameters at the newer step
    PENDING = "pending"  # `wait_s` ran out before the step completed: parameters not attached


class PushPart(WireModel):
    """A worker's gradient of one shard at `step` (or, with `has_grads` false, a fetch of the shard).

    Attributes:
        shard: the shard index in the job's `SyncLayout`.
        step: the step the gradient was computed at (a fetch: the step the worker waits for).
        has_grads: whether tensors (the gradient) are attached.
        names: the parameter names of the part's tensors, in order.
    """

    shard: int = Field(ge=0, le=4096)
    step: int = Field(ge=0, le=2**40)
    has_grads: bool = True
    names: tuple[str, ...] = Field(default=(), max_length=_MAX_NAMES)


class SyncPush(WireModel):
    """A worker's parts for one owner: the shards it holds (see the module docstring).

    Attributes:
        job_id: the job (the owner refuses another job's push).
        parts: one per shard, distinct shards.
        dead: workers the sender found dead (the owner checks them before it takes over their shards).
        wait_s: how long the owner may hold the reply waiting for the parts' steps to complete.
    """

    schema_version: int = 2
    job_id: str = Field(min_length=1, max_length=64)
    parts: tuple[PushPart, ...] = Field(min_length=1, max_length=_MAX_NAMES)
    dead: tuple[str, ...] = Field(default=(), max_length=1024)
    wait_s: float = Field(default=30.0, ge=0, le=600)


class ReplyPart(WireModel):
    """The owner's answer for one shard: its parameters at `step` (tensors in the order of `names`)."""

    shard: int = Field(ge=0, le=4096)
    kind: ReplyKind
    step: int = Field(ge=0, le=2**40)
    names: tuple[str, ...] = Field(default=(), max_length=_MAX_NAMES)
    pending: int = Field(default=0, ge=0, le=100_000, description="gradients counted for the open step")
    final: bool = Field(default=False, description="the shard reached the job's last step")


class SyncReply(WireModel):
    """The owner's answer to a push: one part per pushed part, tensors of all parts in order."""

    schema_version: int = 2
    parts: tuple[ReplyPart, ...] = Field(default=(), max_length=_MAX_NAMES)


class SyncPing(WireModel):
    schema_version: int = 1
    job_id: str = Field(min_length=1, max_length=64)


class SyncPong(WireModel):
    schema_version: int = 1
    in_job: bool
    peer_id: str = _PEER_ID
    dead: tuple[str, ...] = Field(default=(), max_length=1024, description="workers this peer found dead")


# a push (all parts) is at most the whole model: wide_mlp at width 4096 is ~70 MiB in fp32
SYNC_PUSH = RpcMethod(
    "sync_push",
    SyncPush,
    SyncReply,
    max_request_bytes=512 * MIB,
    max_response_bytes=512 * MIB,
    max_tensors=_MAX_NAMES,
    large_response=True,
    handler_timeout_s=620.0,  # bounded by the request's wait_s
)
SYNC_PING = RpcMethod("sync_ping", SyncPing, SyncPong, handler_timeout_s=10.0)


def check_tensors(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    *,
    what: str,
) -> dict[str, torch.Tensor]:
    """name -> tensor of a message, if it carries exactly the `expected` tensors, well-formed and finite.

    Raises:
        InvalidMessage: wrong count, names, shape, dtype, or a non-finite value.
    """
    if len(names) != len(tensors):
        raise InvalidMessage(f"{what}: {len(names)} names for {len(tensors)} tensors")
    if list(names) != list(expected):
        raise InvalidMessage(
            f"{what}: tensors {list(names)[:4]}... are not the shard's {list(expected)[:4]}..."
        )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in zip(names, tensors, strict=True):
        shape, dtype = expected[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise InvalidMessage(
                f"{what}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InvalidMessage(f"{what}: {name} has non-finite values")
        out[name] = tensor
    return out


def split_parts(
    counts: Sequence[int], tensors: Sequence[torch.Tensor], *, what: str
) -> list[list[torch.Tensor]]:
    """The tensors of a multi-part message cut into each part's (`counts`: names per part).

    Raises:
        InvalidMessage: the message carries more or fewer tensors than its parts name.
    """
    if sum(counts) != len(tensors):
        raise InvalidMessage(f"{what}: {sum(counts)} names for {len(tensors)} tensors")
    out, start = [], 0
    for count in counts:
        out.append(list(tensors[start : start + count]))
        start += count
    return out
