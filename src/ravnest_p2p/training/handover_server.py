"""The owner's side of `fetch_state` (see `training.handover`): what it serves, to whom, page by page."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from torch import Tensor

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.checkpoint import CheckpointError, CheckpointFileSource, checkpoint_manifest_path
from ravnest_p2p.training.handover_wire import (
    FETCH_STATE,
    MAX_NAMES,
    MAX_PAGE_BYTES,
    FetchStateRequest,
    FetchStateResponse,
    ReadItem,
)
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMeta,
    TensorEntry,
    capture_meta,
    layer_of,
    live_tensors,
    tensor_digest,
)
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint
from ravnest_p2p.utils import run_in_compute_thread

__all__ = ["ExecutorSource", "HandoverServer", "StateSource", "StaticSource"]

_SOURCES_PER_JOB = 2  # the plan that ends and the one that starts
_MAX_JOBS = 2  # a peer serves the state of its two newest jobs (older stages are let go)
_OPEN_FILES = 4  # checkpoint files with their manifests held open


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
        # autograd's in-place counters catch what the weight version may not (e.g. BatchNorm statistics
        # updated by a forward, a parameter written in place under no_grad)
        tensors = [*self.executor.parameters_by_name().values(), *self.executor.buffers_by_name().values()]
        counters = sum(t._version for t in tensors)
        return f"{self.executor.weight_version}.{self.executor.num_steps}.{counters}"


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


_ATTRIBUTE = "_ravnest_handover_server"  # the server rides on its endpoint: they live and die together


class HandoverServer:
    """Serves `fetch_state` for the sources published on it, to the peers each source allows.

    Sources are keyed by (job id, plan epoch); a job keeps its newest `_SOURCES_PER_JOB` epochs (the
    plan that ends and the one that starts). Use `HandoverServer.of(rpc)`: one per endpoint.
    """

    def __init__(self, rpc: RpcEndpoint, *, max_page_bytes: int = MAX_PAGE_BYTES) -> None:
        self.rpc = rpc
        self.max_page_bytes = max_page_bytes
        self._sources: dict[str, dict[int, _Published]] = {}
        self._checkpoints: dict[str, tuple[Path, frozenset[str]]] = {}  # job id -> (root, allowed)
        self._open_files: dict[Path, _Published] = {}
        self._serving = False
        self._lock = asyncio.Lock()
        self.refused = 0

    @classmethod
    def of(cls, rpc: RpcEndpoint) -> HandoverServer:
        """The server of `rpc` (created on first use; call `start` before expecting requests)."""
        server: HandoverServer | None = getattr(rpc, _ATTRIBUTE, None)
        if server is None:
            server = cls(rpc)
            setattr(rpc, _ATTRIBUTE, server)
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

    def serve_checkpoints(self, job_id: str, root: Path, *, allowed: Iterable[str]) -> None:
        """Serve the job's checkpoints under `root` (a `CheckpointConfig.dir`) to the peers in `allowed`."""
        self._checkpoints[job_id] = (Path(root), frozenset(allowed))

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

    def _find_checkpoint(self, request: FetchStateRequest, peer_id: str) -> tuple[int, _Published]:
        ref = request.checkpoint
        assert ref is not None
        served = self._checkpoints.get(request.job_id)
        if served is None or peer_id not in served[1]:
            self.refused += 1
            if served is not None:
                raise _NotAllowed(f"{peer_id} may not fetch checkpoints of job {request.job_id}")
            raise _NoState(f"no checkpoints of job {request.job_id} here")
        path = checkpoint_manifest_path(
            served[0], request.job_id, step=ref.step, first_layer=ref.first_layer, end_layer=ref.end_layer
        )
        published = self._open_files.get(path)
        if published is None:
            try:
                source = CheckpointFileSource(path)
            except CheckpointError:
                raise _NoState(
                    f"no checkpoint {ref.step} of layers [{ref.first_layer}, {ref.end_layer})"
                ) from None
            published = self._open_files[path] = _Published(source, served[1])
            for old in list(self._open_files)[:-_OPEN_FILES]:
                del self._open_files[old]
        return 0, published

    def _find(self, request: FetchStateRequest, peer_id: str) -> tuple[int, _Published]:
        if request.checkpoint is not None:
            return self._find_checkpoint(request, peer_id)
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

    @staticmethod
    def _newest_with(candidates: Sequence[tuple[int, _Published]], first: int, end: int) -> int | None:
        """The first (newest) epoch whose source holds some of layers [first, end) (compute thread)."""
        for epoch, published in candidates:
            if any(first <= layer_of(n) < end for n in published.source.tensors()):
                return epoch
        return None

    async def _handle(
        self, request: FetchStateRequest, _tensors: list[Tensor], context: CallContext
    ) -> FetchStateResponse | tuple[FetchStateResponse, list[Tensor]]:
        if request.epoch is None and request.layers is not None and request.checkpoint is None:
            # "your newest state of these layers": a split vote can leave a plan some holders never ran
            by_epoch = self._sources.get(request.job_id, {})
            mine = [
                (e, p)
                for e, p in sorted(by_epoch.items(), reverse=True)
                if context.remote_peer_id in p.allowed
            ]
            newest = await run_in_compute_thread(self._newest_with, mine, *request.layers)
            if newest is not None:
                request = request.model_copy(update={"epoch": newest})
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
            names = listed[request.list_offset : request.list_offset + MAX_NAMES]
            more = request.list_offset + MAX_NAMES < len(listed)
            next_offset = request.list_offset + MAX_NAMES if more else None
        else:
            names, next_offset = list(request.names), None
        missing = [n for n in names if n not in tensors]
        if missing:
            raise _NoState(f"no tensors {[m[:80] for m in missing[:5]]} here")
        if published.digests is None or published.digests[0] != version:
            published.digests = (version, {})
        cache = published.digests[1]
        written: Mapping[str, TensorEntry] | None = getattr(source, "entries", lambda: None)()
        if written is not None:  # e.g. a checkpoint file: its written digests, no reading
            return [written[n] for n in names], next_offset, source.meta(), version
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
        ranged: Callable[[str, int, int], Tensor] | None = getattr(source, "read_range", None)
        if ranged is not None:  # e.g. a checkpoint file: the page from disk, never the whole tensor
            return self._read_ranges(source, ranged, items)
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

    def _read_ranges(
        self, source: StateSource, ranged: Callable[[str, int, int], Tensor], items: Sequence[ReadItem]
    ) -> tuple[str, list[Tensor]]:
        entries: Mapping[str, TensorEntry] = getattr(source, "entries", dict)()
        total, out = 0, []
        for item in items:
            entry = entries.get(item.name)
            if entry is None:
                raise _NoState(f"no tensor {item.name[:80]!r} here")
            if item.start + item.count > entry.numel:
                raise InvalidMessage(f"{item.name}: elements past its end ({entry.numel})")
            total += item.count * (entry.nbytes // max(entry.numel, 1))
            if total > self.max_page_bytes:
                raise InvalidMessage(f"a page over {self.max_page_bytes} bytes")
            out.append(ranged(item.name, item.start, item.count))
        return source.version(), out
