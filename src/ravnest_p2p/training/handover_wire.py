"""The wire of `fetch_state` (see `training.handover`): messages, limits and the errors a caller sees."""

from __future__ import annotations

from pydantic import Field

from ravnest_p2p.errors import RavnestError
from ravnest_p2p.training.stage_state import StateMeta, TensorEntry
from ravnest_p2p.transport.codec import MAX_TENSOR_NUMEL
from ravnest_p2p.transport.rpc import RpcMethod
from ravnest_p2p.types import WireModel

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "FETCH_STATE",
    "MAX_ITEMS",
    "MAX_NAMES",
    "MAX_PAGE_BYTES",
    "CheckpointRef",
    "CorruptState",
    "FetchStateRequest",
    "FetchStateResponse",
    "HandoverError",
    "HandoverRefused",
    "ReadItem",
    "StateChanged",
]

DEFAULT_PAGE_BYTES = 8 << 20
MAX_PAGE_BYTES = 64 << 20
MAX_NAMES = 512  # per manifest call: keeps the reply header under the envelope's 256 KiB
MAX_ITEMS = 256  # per page


class HandoverError(RavnestError):
    """A state transfer failed; the receiver changed nothing."""


class HandoverRefused(HandoverError):
    """The owner refused (e.g. we are not on its allow-list, or it holds no such state).

    Attributes:
        code: the owner's reason (``not_allowed``, ``no_state``, ...; empty when unknown).
    """

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class StateChanged(HandoverError):
    """The owner's state changed during the transfer (it is still training); fetch again once it stops."""


class CorruptState(HandoverError):
    """What arrived is not what was announced or expected (names, sizes, dtypes, digests, values)."""


class ReadItem(WireModel):
    """Elements [start, start + count) of a named tensor, flattened."""

    name: str = Field(min_length=1, max_length=256)
    start: int = Field(ge=0, le=MAX_TENSOR_NUMEL)
    count: int = Field(ge=1, le=MAX_TENSOR_NUMEL)


class CheckpointRef(WireModel):
    """A stage checkpoint on the owner's disk (see `training.checkpoint`), instead of its live state."""

    step: int = Field(ge=0)
    first_layer: int = Field(ge=0, le=1_000_000)
    end_layer: int = Field(ge=1, le=1_000_000)


class FetchStateRequest(WireModel):
    """A manifest request (`names` or `layers`, paged by `list_offset`) or a page request (`read`).

    With `checkpoint`, the request is about that checkpoint of the job (the owner's disk), not about
    the live state published for `epoch`.
    """

    schema_version: int = 1
    job_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    epoch: int | None = Field(default=None, ge=0)
    names: tuple[str, ...] = Field(default=(), max_length=MAX_NAMES)
    layers: tuple[int, int] | None = None
    list_offset: int = Field(default=0, ge=0, le=10_000_000)
    read: tuple[ReadItem, ...] = Field(default=(), max_length=MAX_ITEMS)
    checkpoint: CheckpointRef | None = None


class FetchStateResponse(WireModel):
    schema_version: int = 1
    job_id: str = Field(max_length=64)
    epoch: int = Field(ge=0)
    version: str = Field(max_length=128)
    entries: tuple[TensorEntry, ...] = Field(default=(), max_length=MAX_NAMES)
    next_offset: int | None = Field(default=None, ge=0)
    meta: StateMeta | None = None
    read: tuple[ReadItem, ...] = Field(default=(), max_length=MAX_ITEMS)


FETCH_STATE: RpcMethod[FetchStateRequest, FetchStateResponse] = RpcMethod(
    "fetch_state",
    FetchStateRequest,
    FetchStateResponse,
    max_request_bytes=512 << 10,
    max_response_bytes=MAX_PAGE_BYTES + (1 << 20),
    max_tensors=MAX_ITEMS,
    large_response=True,
    handler_timeout_s=120.0,
)
