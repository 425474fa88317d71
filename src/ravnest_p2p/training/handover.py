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

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ravnest_p2p.errors import RemoteError, TransportError
from ravnest_p2p.training.handover_server import ExecutorSource, HandoverServer, StateSource, StaticSource
from ravnest_p2p.training.handover_wire import (
    DEFAULT_PAGE_BYTES,
    FETCH_STATE,
    MAX_ITEMS,
    MAX_NAMES,
    MAX_PAGE_BYTES,
    CheckpointRef,
    CorruptState,
    FetchStateRequest,
    FetchStateResponse,
    HandoverError,
    HandoverRefused,
    ReadItem,
    StateChanged,
)
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMeta,
    StateMismatch,
    TensorEntry,
    layer_of,
    tensor_digest,
)
from ravnest_p2p.transport.codec import MAX_TENSOR_NUMEL, all_finite
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = [
    "DEFAULT_PAGE_BYTES",
    "FETCH_STATE",
    "CheckpointRef",
    "CorruptState",
    "ExecutorSource",
    "FetchStateRequest",
    "FetchStateResponse",
    "HandoverError",
    "HandoverRefused",
    "HandoverServer",
    "ReadItem",
    "StateChanged",
    "StateListing",
    "StateSource",
    "StaticSource",
    "fetch_state",
    "list_state",
]

logger = logging.getLogger(__name__)

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


def _plan_pages(entries: Sequence[TensorEntry], page_bytes: int) -> list[list[ReadItem]]:
    pages: list[list[ReadItem]] = []
    page: list[ReadItem] = []
    used = 0
    for entry in entries:
        itemsize = max(1, entry.nbytes // max(entry.numel, 1))
        start = 0
        while start < entry.numel:
            room = (page_bytes - used) // itemsize
            if room <= 0 or len(page) >= MAX_ITEMS:
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
        raise HandoverRefused(f"{peer_id} refused fetch_state: {exc}", code=exc.code) from None
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
    checkpoint: CheckpointRef | None = None,
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
        checkpoint: fetch from that checkpoint on the owner's disk instead (its version is its
            manifest's digest; see `training.checkpoint_fetch`).
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
    page_bytes = max(1 << 10, min(page_bytes, MAX_PAGE_BYTES))
    deadline = _Deadline(timeout_s)
    listing = await _list(rpc, peer_id, job_id, names, layers, epoch, deadline, checkpoint)
    entries = list(listing.entries)
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
    return await _receive(rpc, peer_id, job_id, listing, entries, page_bytes, deadline, checkpoint)


@dataclasses.dataclass(frozen=True)
class StateListing:
    """What an owner announced it holds: (plan epoch, state version, entries with digests, counters)."""

    epoch: int
    version: str
    entries: tuple[TensorEntry, ...]
    meta: StateMeta | None


async def list_state(
    rpc: RpcEndpoint,
    peer_id: str,
    job_id: str,
    names: Sequence[str] | None = None,
    *,
    layers: tuple[int, int] | None = None,
    epoch: int | None = None,
    checkpoint: CheckpointRef | None = None,
    timeout_s: float = 60.0,
) -> StateListing:
    """The manifest alone: what `peer_id` holds of `names` (or of `layers`), nothing transferred.

    Raises:
        HandoverRefused, StateChanged, CorruptState, HandoverError: as `fetch_state`.
    """
    if (names is None) == (layers is None):
        raise ValueError("give exactly one of names and layers")
    listing = await _list(rpc, peer_id, job_id, names, layers, epoch, _Deadline(timeout_s), checkpoint)
    if len({e.name for e in listing.entries}) != len(listing.entries):
        raise CorruptState(f"{peer_id} announced a tensor twice")
    return listing


async def _list(
    rpc: RpcEndpoint,
    peer_id: str,
    job_id: str,
    names: Sequence[str] | None,
    layers: tuple[int, int] | None,
    epoch: int | None,
    deadline: _Deadline,
    checkpoint: CheckpointRef | None = None,
) -> StateListing:
    entries: list[TensorEntry] = []
    meta: StateMeta | None = None
    version: str | None = None
    got_epoch: int | None = epoch
    requests: list[FetchStateRequest] = []
    if names is not None:
        wanted = list(dict.fromkeys(names))
        requests = [
            FetchStateRequest(
                job_id=job_id, epoch=epoch, names=tuple(wanted[i : i + MAX_NAMES]), checkpoint=checkpoint
            )
            for i in range(0, len(wanted), MAX_NAMES)
        ]
    offset: int | None = 0
    while requests or (layers is not None and offset is not None):
        request = (
            requests.pop(0)
            if requests
            else FetchStateRequest(
                job_id=job_id, epoch=got_epoch, layers=layers, list_offset=offset or 0, checkpoint=checkpoint
            )
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
                try:
                    inside = layers[0] <= layer_of(entry.name) < layers[1]
                except StateMismatch:
                    inside = False
                if not inside:
                    raise CorruptState(f"{peer_id} announced {entry.name[:80]!r} outside layers {layers}")
            if response.next_offset is not None and response.next_offset <= (offset or 0):
                raise CorruptState(f"{peer_id} pages its listing backwards")
            offset = response.next_offset
        entries.extend(response.entries)
    if version is None or got_epoch is None:
        raise CorruptState(f"{peer_id} listed nothing")
    return StateListing(epoch=got_epoch, version=version, entries=tuple(entries), meta=meta)


async def _receive(
    rpc: RpcEndpoint,
    peer_id: str,
    job_id: str,
    listing: StateListing,
    entries: Sequence[TensorEntry],
    page_bytes: int,
    deadline: _Deadline,
    checkpoint: CheckpointRef | None,
) -> StageState:
    epoch, version, meta = listing.epoch, listing.version, listing.meta
    by_name = {e.name: e for e in entries}
    out = {e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in entries}
    for page in _plan_pages(entries, page_bytes):
        request = FetchStateRequest(job_id=job_id, epoch=epoch, read=tuple(page), checkpoint=checkpoint)
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
