"""Hand-over: a new owner of layers pulls their state, tensor by tensor, from whoever holds it.

Problem. When the plan moves, each new owner of a layer range needs the parameters, buffers and
optimizer state of those layers (`training.stage_state`) from their previous owner(s), a replica or a
checkpoint. A stage may hold a gigabyte; neither side may need two full copies of it in memory, and
the receiver must not trust any size, name or byte the sender announces before checking it.

Protocol (one typed RPC, ``fetch_state``, replies over streams):

1. *Manifest*: the client names the tensors it wants (or a layer range). The server answers with one
   `TensorEntry` per name (dtype, shape, digest), the stage's counters (`StateMeta`) and a *version*
   token of its state. Long lists are paged (`_MAX_NAMES` per call).
2. *Pages*: the client allocates each tensor once (after checking the announced dtype and shape against
   what it expects and the total against its budget) and asks for pages of at most `page_bytes`:
   several small tensors, or an element range of one large one. Each page reply repeats the version;
   a change means the owner's state moved mid-transfer (`StateChanged`), and the transfer is dropped.
3. The client checks every tensor's digest against the manifest and the caller's `expected_digests`
   (e.g. the digests the owner published) and returns a `StageState`. It changes nothing itself:
   `stage_state.restore_state` applies it, all or nothing.

The server copies a page (not the stage) on the compute thread, which is also where the stage's
tensors change, so a page is never torn; the version is read in the same call. Memory: the server holds
its stage plus one page; the client holds what it received plus one page. A requester must be on the
allow-list its owner sets (members of the previous and next plan, or a job's state readers); others get
a ``not_allowed`` error. Tensors travel through the transport codec (never pickle).

Alternatives rejected: one reply with the whole stage (a full extra copy on both sides, and the unary
cap); a snapshot per request (a full copy on the server); raw libp2p streams with a framing of our own
(the typed RPC already checks every frame; a page per call costs one stream open, ~ms).

Limits: a stage that keeps training while it is fetched fails the fetch (`StateChanged`): stop it
first, or fetch from its checkpoint. One server per RPC endpoint (`HandoverServer.of`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import torch
from pydantic import Field
from torch import Tensor

from ravnest_p2p.errors import InvalidMessage, RavnestError, RemoteError, TransportError
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMeta,
    StateMismatch,
    TensorEntry,
    capture_meta,
    layer_of,
    live_tensors,
    tensor_digest,
)
from ravnest_p2p.transport.codec import MAX_TENSOR_NUMEL, all_finite
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint, RpcMethod
from ravnest_p2p.types import WireModel
from ravnest_p2p.utils import run_in_compute_thread

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "FETCH_STATE",
    "ExecutorSource",
    "FetchStateRequest",
    "FetchStateResponse",
    "HandoverError",
    "HandoverRefused",
    "HandoverServer",
    "ReadItem",
    "StateChanged",
    "StateSource",
    "StaticSource",
    "fetch_state",
]

logger = logging.getLogger(__name__)

DEFAULT_PAGE_BYTES = 8 << 20
_MAX_PAGE_BYTES = 64 << 20
_MAX_NAMES = 512  # per manifest call: keeps the reply header under the envelope's 256 KiB
_MAX_ITEMS = 256  # per page
_ALLOWED_DTYPES = {
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
}
_SOURCES_PER_JOB = 2  # the plan that ends and the one that starts
_MAX_JOBS = 2  # a peer serves the state of its two newest jobs (older stages are let go)


class HandoverError(RavnestError):
    """A state transfer failed; the receiver changed nothing."""


class HandoverRefused(HandoverError):
    """The owner refused (e.g. we are not on its allow-list, or it holds no such state)."""


class StateChanged(HandoverError):
    """The owner's state changed during the transfer (it is still training); fetch again once it stops."""


class CorruptState(HandoverError):
    """What arrived is not what was announced or expected (names, sizes, dtypes, digests, values)."""


# ----- wire -------------------------------------------------------------------------------------------
class ReadItem(WireModel):
    """Elements [start, start + count) of a named tensor, flattened."""

    name: str = Field(min_length=1, max_length=256)
    start: int = Field(ge=0, le=MAX_TENSOR_NUMEL)
    count: int = Field(ge=1, le=MAX_TENSOR_NUMEL)


class FetchStateRequest(WireModel):
    """A manifest request (`names` or `layers`, paged by `list_offset`) or a page request (`read`)."""

    schema_version: int = 1
    job_id: str = Field(min_length=1, max_length=64)
    epoch: int | None = Field(default=None, ge=0)
    names: tuple[str, ...] = Field(default=(), max_length=_MAX_NAMES)
    layers: tuple[int, int] | None = None
    list_offset: int = Field(default=0, ge=0, le=10_000_000)
    read: tuple[ReadItem, ...] = Field(default=(), max_length=_MAX_ITEMS)


class FetchStateResponse(WireModel):
    schema_version: int = 1
    job_id: str = Field(max_length=64)
    epoch: int = Field(ge=0)
    version: str = Field(max_length=128)
    entries: tuple[TensorEntry, ...] = Field(default=(), max_length=_MAX_NAMES)
    next_offset: int | None = Field(default=None, ge=0)
    meta: StateMeta | None = None
    read: tuple[ReadItem, ...] = Field(default=(), max_length=_MAX_ITEMS)


FETCH_STATE: RpcMethod[FetchStateRequest, FetchStateResponse] = RpcMethod(
    "fetch_state",
    FetchStateRequest,
    FetchStateResponse,
    max_request_bytes=512 << 10,
    max_response_bytes=_MAX_PAGE_BYTES + (1 << 20),
    max_tensors=_MAX_ITEMS,
    large_response=True,
    handler_timeout_s=120.0,
)


# ----- server -------------------------------------------------------------------------------------------
class StateSource(Protocol):
    """What a server hands out. All three are called on the compute thread."""

    def tensors(self) -> Mapping[str, Tensor]:
        """The state tensors by global name (live ones: no copies)."""
        ...

    def meta(self) -> StateMeta | None: ...

    def version(self) -> str:
        """A token that changes whenever any tensor may have changed."""
        ...


class ExecutorSource:
    """A live stage as a source; `progress` adds the caller's progress fields to its counters."""

    def __init__(
        self,
        executor: StageExecutor,
        progress: Callable[[], Mapping[str, int | float | str]] | None = None,
    ) -> None:
        self.executor = executor
        self._progress = progress

    def tensors(self) -> Mapping[str, Tensor]:
        return live_tensors(self.executor)

    def meta(self) -> StateMeta:
        return capture_meta(self.executor, self._progress() if self._progress else None)

    def version(self) -> str:
        buffers = sum(b._version for b in self.executor.buffers_by_name().values())
        return f"{self.executor.weight_version}.{self.executor.num_steps}.{buffers}"


class StaticSource:
    """A state that does not change (e.g. loaded from a checkpoint) as a source."""

    def __init__(self, state: StageState, version: str = "static") -> None:
        self.state = state
        self._version = version

    def tensors(self) -> Mapping[str, Tensor]:
        return self.state.tensors

    def meta(self) -> StateMeta | None:
        return self.state.meta

    def version(self) -> str:
        return self._version


@dataclasses.dataclass
class _Published:
    source: StateSource
    allowed: frozenset[str]
    digests: tuple[str, dict[str, str]] | None = None  # (version, digests) cache


class _NotAllowed(InvalidMessage):
    code = "not_allowed"


class _NoState(InvalidMessage):
    code = "no_state"


_SERVERS: weakref.WeakKeyDictionary[RpcEndpoint, HandoverServer] = weakref.WeakKeyDictionary()


class HandoverServer:
    """Serves `fetch_state` for the sources published on it, to the peers each source allows.

    Sources are keyed by (job id, plan epoch); a job keeps its newest `_SOURCES_PER_JOB` epochs (the
    plan that ends and the one that starts). Use `HandoverServer.of(rpc)`: one per endpoint.
    """

    def __init__(self, rpc: RpcEndpoint, *, max_page_bytes: int = _MAX_PAGE_BYTES) -> None:
        self.rpc = rpc
        self.max_page_bytes = max_page_bytes
        self._sources: dict[str, dict[int, _Published]] = {}
        self._serving = False
        self._lock = asyncio.Lock()
        self.refused = 0

    @classmethod
    def of(cls, rpc: RpcEndpoint) -> HandoverServer:
        """The server of `rpc` (created on first use; call `start` before expecting requests)."""
        server = _SERVERS.get(rpc)
        if server is None:
            server = _SERVERS[rpc] = cls(rpc)
        return server

    async def start(self) -> None:
        async with self._lock:
            if not self._serving:
                await self.rpc.serve(FETCH_STATE, self._handle)
                self._serving = True

    async def aclose(self) -> None:
        async with self._lock:
            if self._serving:
                await self.rpc.unserve(FETCH_STATE)
                self._serving = False
        self._sources.clear()

    def publish(self, job_id: str, source: StateSource, *, epoch: int, allowed: Iterable[str]) -> None:
        """Serve `source` as the job's state at `epoch` to the peers in `allowed` (replaces that epoch)."""
        by_epoch = self._sources.pop(job_id, {})
        self._sources[job_id] = by_epoch  # newest job last
        by_epoch[epoch] = _Published(source, frozenset(allowed))
        for old_job in list(self._sources)[:-_MAX_JOBS]:
            del self._sources[old_job]
        for old in sorted(by_epoch)[:-_SOURCES_PER_JOB]:
            del by_epoch[old]

    def allow(self, job_id: str, peer_ids: Iterable[str], *, epoch: int | None = None) -> None:
        """Replace the allow-list of the job's source at `epoch` (None: every epoch)."""
        for e, published in self._sources.get(job_id, {}).items():
            if epoch is None or e == epoch:
                published.allowed = frozenset(peer_ids)

    def withdraw(self, job_id: str, *, epoch: int | None = None) -> None:
        """Stop serving the job's state at `epoch` (None: all of it)."""
        if epoch is None:
            self._sources.pop(job_id, None)
        else:
            self._sources.get(job_id, {}).pop(epoch, None)

    def published(self, job_id: str) -> list[int]:
        return sorted(self._sources.get(job_id, {}))

    def _find(self, request: FetchStateRequest, peer_id: str) -> tuple[int, _Published]:
        by_epoch = self._sources.get(request.job_id, {})
        epoch = request.epoch if request.epoch is not None else max(by_epoch, default=None)
        published = by_epoch.get(epoch) if epoch is not None else None
        if published is None or peer_id not in published.allowed:
            # the same answer for "no such state" and "not for you" to a stranger would hide nothing
            # useful from a member; a member gets told which it is
            self.refused += 1
            if published is not None:
                raise _NotAllowed(f"{peer_id} may not fetch the state of job {request.job_id}")
            raise _NoState(f"no state of job {request.job_id} at epoch {request.epoch}")
        assert epoch is not None
        return epoch, published

    async def _handle(
        self, request: FetchStateRequest, _tensors: list[Tensor], context: CallContext
    ) -> FetchStateResponse | tuple[FetchStateResponse, list[Tensor]]:
        epoch, published = self._find(request, context.remote_peer_id)
        if request.read:
            if request.names or request.layers is not None:
                raise InvalidMessage("a page request names only items")
            version, pages = await run_in_compute_thread(self._read, published, request.read)
            response = FetchStateResponse(
                job_id=request.job_id, epoch=epoch, version=version, read=request.read
            )
            return response, pages
        entries, next_offset, meta, version = await run_in_compute_thread(self._manifest, published, request)
        return FetchStateResponse(
            job_id=request.job_id,
            epoch=epoch,
            version=version,
            entries=tuple(entries),
            next_offset=next_offset,
            meta=meta,
        )

    def _manifest(
        self, published: _Published, request: FetchStateRequest
    ) -> tuple[list[TensorEntry], int | None, StateMeta | None, str]:
        source = published.source
        tensors, version = source.tensors(), source.version()
        if request.layers is not None:
            first, end = request.layers
            listed = sorted(n for n in tensors if first <= layer_of(n) < end)
            names = listed[request.list_offset : request.list_offset + _MAX_NAMES]
            more = request.list_offset + _MAX_NAMES < len(listed)
            next_offset = request.list_offset + _MAX_NAMES if more else None
        else:
            names, next_offset = list(request.names), None
        missing = [n for n in names if n not in tensors]
        if missing:
            raise _NoState(f"no tensors {[m[:80] for m in missing[:5]]} here")
        if published.digests is None or published.digests[0] != version:
            published.digests = (version, {})
        cache = published.digests[1]
        entries = []
        for name in names:
            if name not in cache:
                cache[name] = tensor_digest(tensors[name])
            entries.append(
                TensorEntry.of(name, tensors[name], digest=False).model_copy(update={"digest": cache[name]})
            )
        return entries, next_offset, source.meta(), version

    def _read(self, published: _Published, items: Sequence[ReadItem]) -> tuple[str, list[Tensor]]:
        source = published.source
        tensors, version = source.tensors(), source.version()
        total, out = 0, []
        for item in items:
            tensor = tensors.get(item.name)
            if tensor is None:
                raise _NoState(f"no tensor {item.name[:80]!r} here")
            if item.start + item.count > tensor.numel():
                raise InvalidMessage(f"{item.name}: elements past its end ({tensor.numel()})")
            total += item.count * tensor.element_size()
            if total > self.max_page_bytes:
                raise InvalidMessage(f"a page over {self.max_page_bytes} bytes")
            out.append(tensor.detach().reshape(-1)[item.start : item.start + item.count].clone())
        return version, out


# ----- client -------------------------------------------------------------------------------------------
def _plan_pages(entries: Sequence[TensorEntry], page_bytes: int) -> list[list[ReadItem]]:
    pages: list[list[ReadItem]] = []
    page: list[ReadItem] = []
    used = 0
    for entry in entries:
        itemsize = max(1, entry.nbytes // max(entry.numel, 1))
        start = 0
        while start < entry.numel:
            room = (page_bytes - used) // itemsize
            if room <= 0 or len(page) >= _MAX_ITEMS:
                pages.append(page)
                page, used = [], 0
                continue
            count = min(room, entry.numel - start)
            page.append(ReadItem(name=entry.name, start=start, count=count))
            used += count * itemsize
            start += count
    if page:
        pages.append(page)
    return pages


def _check_entry(
    entry: TensorEntry, expected: Mapping[str, TensorEntry] | None, digests: Mapping[str, str] | None
) -> None:
    if entry.dtype not in _ALLOWED_DTYPES:
        raise CorruptState(f"{entry.name}: dtype {entry.dtype!r} is not allowed")
    if any(d < 0 for d in entry.shape) or entry.numel > MAX_TENSOR_NUMEL:
        raise CorruptState(f"{entry.name}: shape {entry.shape} is out of range")
    if expected is not None:
        want = expected.get(entry.name)
        if want is None:
            raise CorruptState(f"{entry.name[:80]!r} is not a tensor we expect")
        if (want.dtype, want.shape) != (entry.dtype, entry.shape):
            raise CorruptState(
                f"{entry.name}: announced {entry.dtype}{entry.shape}, expected {want.dtype}{want.shape}"
            )
    if digests is not None and entry.name in digests and digests[entry.name] != entry.digest:
        raise CorruptState(f"{entry.name}: announced digest differs from the expected one")


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s
        self.timeout_s = timeout_s

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise HandoverError(f"state transfer exceeded {self.timeout_s:.1f}s")
        return left


async def _call(
    rpc: RpcEndpoint, peer_id: str, request: FetchStateRequest, deadline: _Deadline
) -> tuple[FetchStateResponse, list[Tensor]]:
    try:
        reply = await rpc.call(peer_id, FETCH_STATE, request, timeout_s=deadline.left(), foreground=False)
    except RemoteError as exc:
        raise HandoverRefused(f"{peer_id} refused fetch_state: {exc}") from None
    except TransportError as exc:
        raise HandoverError(f"fetch_state from {peer_id} failed: {exc}") from None
    if reply.message.job_id != request.job_id:
        raise CorruptState(f"{peer_id} answered for job {reply.message.job_id!r}")
    return reply.message, reply.tensors


async def fetch_state(
    rpc: RpcEndpoint,
    peer_id: str,
    job_id: str,
    names: Sequence[str] | None = None,
    expected_digests: Mapping[str, str] | None = None,
    *,
    layers: tuple[int, int] | None = None,
    epoch: int | None = None,
    expected: Mapping[str, TensorEntry] | None = None,
    max_total_bytes: int = 16 << 30,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    timeout_s: float = 120.0,
) -> StageState:
    """Fetch named state (or all of layers [first, end)) of `job_id` from `peer_id`, checked.

    Args:
        names: global names to fetch (or None with `layers`).
        expected_digests: digests tensors must have (e.g. what the owner published), checked on the
            manifest and on the received bytes; tensors not named here are checked against the digests
            the owner announces (which proves the transfer intact, not the owner honest).
        layers: fetch every tensor the owner holds for these layers instead of `names`.
        epoch: the owner's published plan epoch to fetch (None: its newest).
        expected: the receiver's own schema (`stage_state.expected_entries`): every announced name,
            dtype and shape must match it before anything is allocated.
        max_total_bytes: refuse a manifest announcing more than this.

    Raises:
        HandoverRefused: the owner refused (not on its allow-list, no such state).
        StateChanged: the owner's state changed mid-transfer.
        CorruptState: anything announced or received is not what was asked for or expected.
        HandoverError: transport failure or deadline.
    """
    if (names is None) == (layers is None):
        raise ValueError("give exactly one of names and layers")
    page_bytes = max(1 << 10, min(page_bytes, _MAX_PAGE_BYTES))
    deadline = _Deadline(timeout_s)
    entries: list[TensorEntry] = []
    meta: StateMeta | None = None
    version: str | None = None
    got_epoch: int | None = epoch
    requests: list[FetchStateRequest] = []
    if names is not None:
        wanted = list(dict.fromkeys(names))
        requests = [
            FetchStateRequest(job_id=job_id, epoch=epoch, names=tuple(wanted[i : i + _MAX_NAMES]))
            for i in range(0, len(wanted), _MAX_NAMES)
        ]
    offset: int | None = 0
    while requests or (layers is not None and offset is not None):
        request = (
            requests.pop(0)
            if requests
            else FetchStateRequest(job_id=job_id, epoch=got_epoch, layers=layers, list_offset=offset or 0)
        )
        response, _ = await _call(rpc, peer_id, request, deadline)
        if version is not None and (response.version != version or response.epoch != got_epoch):
            raise StateChanged(f"the state of {peer_id} changed while we listed it")
        version, got_epoch, meta = response.version, response.epoch, response.meta
        if names is not None:
            if [e.name for e in response.entries] != list(request.names):
                raise CorruptState(f"{peer_id} announced other tensors than we asked for")
        else:
            assert layers is not None
            for entry in response.entries:
                if not layers[0] <= layer_of(entry.name) < layers[1]:
                    raise CorruptState(f"{peer_id} announced {entry.name!r} outside layers {layers}")
            if response.next_offset is not None and response.next_offset <= (offset or 0):
                raise CorruptState(f"{peer_id} pages its listing backwards")
            offset = response.next_offset
        entries.extend(response.entries)
    if len({e.name for e in entries}) != len(entries):
        raise CorruptState(f"{peer_id} announced a tensor twice")
    for entry in entries:
        try:
            _check_entry(entry, expected, expected_digests)
        except StateMismatch as exc:
            raise CorruptState(str(exc)) from None
    total = sum(e.nbytes for e in entries)
    if total > max_total_bytes:
        raise CorruptState(f"{peer_id} announced {total} bytes; at most {max_total_bytes} expected")
    assert version is not None
    assert got_epoch is not None
    return await _receive(rpc, peer_id, job_id, got_epoch, version, entries, meta, page_bytes, deadline)


async def _receive(
    rpc: RpcEndpoint,
    peer_id: str,
    job_id: str,
    epoch: int,
    version: str,
    entries: Sequence[TensorEntry],
    meta: StateMeta | None,
    page_bytes: int,
    deadline: _Deadline,
) -> StageState:
    by_name = {e.name: e for e in entries}
    out = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in entries}
    for page in _plan_pages(entries, page_bytes):
        request = FetchStateRequest(job_id=job_id, epoch=epoch, read=tuple(page))
        response, tensors = await _call(rpc, peer_id, request, deadline)
        if response.version != version or response.epoch != epoch:
            raise StateChanged(f"the state of {peer_id} changed during the transfer")
        if response.read != request.read or len(tensors) != len(page):
            raise CorruptState(f"{peer_id} answered another page than we asked for")
        for item, tensor in zip(page, tensors, strict=True):
            entry = by_name[item.name]
            if (
                tensor.dim() != 1
                or tensor.numel() != item.count
                or str(tensor.dtype).removeprefix("torch.") != entry.dtype
            ):
                raise CorruptState(
                    f"{item.name}: page of {tensor.dtype}{tuple(tensor.shape)} is not what was asked"
                )
            out[item.name].view(-1)[item.start : item.start + item.count].copy_(tensor)
    digests = {}
    for name, tensor in out.items():
        digest = tensor_digest(tensor)
        if digest != by_name[name].digest:
            raise CorruptState(f"{name}: received bytes do not match the announced digest")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise CorruptState(f"{name} has non-finite values")
        digests[name] = digest
    logger.debug(
        "fetched %d tensors (%d bytes) of job %s from %s",
        len(out),
        sum(e.nbytes for e in entries),
        job_id,
        peer_id,
    )
    return StageState(tensors=out, digests=digests, meta=meta)
