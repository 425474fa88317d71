"""One peer's pipeline stage on the network: asynchronous 1F1B without flushes (PipeDream-style).

The first stage admits micro-batches through a window of `max_in_flight` (default: `default_window`;
optionally adapted to the measured rate and round trip below that, `runtime.window.InflightWindow`);
each stage runs forward, hands activations (with the labels, which travel to the last stage) to the
next peer, and runs backward when the gradient comes back; optimizer steps happen inside the
`StageExecutor` (with weight stashing) every `update_every` backwards. Nothing ever waits for the whole
pipeline to drain: as soon as the first stage gets a micro-batch's backward, the window admits the next.

Scheduling inside a stage: work arrives in two bounded queues; the single worker always prefers a
pending backward over a pending forward. That is the 1F1B rule (it keeps the number of stashed versions
and activations bounded) without a fixed global schedule, so a slow neighbour only delays what depends
on it. Sends run as owned background tasks (`runtime.sender`) so the compute thread never waits on the
network.

Misbehaviour costs the sender (docs/pipeline-faults.md). Receives are validated in the RPC handler —
sender, epoch, micro-batch id (no replay, inside the window: `runtime.admission`), shape, dtype, label
range, magnitude within `PipelineConfig.max_abs_value` — and a bad message is refused in the reply
before anything is queued, and counted against its sender (`transport.ledger.PeerLedger`); a sender
past the threshold is excluded for the epoch (a neighbour: the stage fails with `NeighbourLost` naming
it, so the next plan goes around it). A refusal *received* is never fatal: the refused micro-batch is
dropped (its stash released) and a `stage_drop` notice walks back to the first stage, which re-issues
it once under a new id, then skips it. A non-finite loss or gradient computed from a neighbour's input
drops the micro-batch the same way, before any gradient is accumulated.

Back-pressure: the window bounds what is in flight, so queues never exceed it; a queue that is full
anyway (a misbehaving sender) makes the handler wait up to its deadline, which slows the sender down
instead of growing memory.

Known limits: a dead neighbour is detected by heartbeats (`runtime.liveness`) within
``neighbour_timeout_s`` (+ one ping) and the stage fails with `NeighbourLost`; the cluster is then
re-planned (membership), not repaired in place, and micro-batches in flight are dropped. Middle stages
check label ranges only when given a ``label_spec``; otherwise the last stage does and the middle drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pydantic import BaseModel
from torch import Tensor

from ravnest_p2p.errors import (
    InvalidMessage,
    NeighbourLost,
    RavnestError,
    RemoteError,
)
from ravnest_p2p.models.spec import TensorSpec, make_loss
from ravnest_p2p.runtime.admission import MicroBatchIds
from ravnest_p2p.runtime.config import NonFiniteResult
from ravnest_p2p.runtime.driving import FirstStageDriver, _Issued
from ravnest_p2p.runtime.epochs import EpochSwitch
from ravnest_p2p.runtime.liveness import NeighbourWatch
from ravnest_p2p.runtime.messages import (
    BACKWARD,
    DROP,
    EVAL_RESULT,
    FINISH,
    FORWARD,
    PING,
    READY,
    BackwardRequest,
    DropNotice,
    EvalResult,
    ForwardRequest,
    Mode,
)
from ravnest_p2p.runtime.pipeline import PipelineConfig, StageStats, Work, default_window
from ravnest_p2p.runtime.receiving import StageHandlers
from ravnest_p2p.runtime.sender import Sender
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.runtime.window import InflightWindow
from ravnest_p2p.transport.ledger import PeerLedger
from ravnest_p2p.transport.rpc import RpcEndpoint, RpcMethod
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["PipelineConfig", "StageService", "StageStats", "default_window"]

logger = logging.getLogger(__name__)


class StageService(StageHandlers, FirstStageDriver):
    """Serves one stage of one cluster for one plan epoch. The first stage also drives training.

    Args:
        rpc: our endpoint.
        executor: the stage's compute.
        epoch: the plan epoch this service serves; messages of other epochs are refused.
        cluster_peers: the cluster's peers in stage order.
        stage_index: our position in ``cluster_peers``.
        config: pipeline knobs.
        label_spec: what labels must look like (the model's classes); lets a middle stage refuse
            out-of-range labels itself. Defaults to the executor's (set on the last stage only).
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        executor: StageExecutor,
        *,
        epoch: int,
        cluster_peers: Sequence[str],
        stage_index: int,
        config: PipelineConfig | None = None,
        label_spec: TensorSpec | None = None,
    ) -> None:
        if not 0 <= stage_index < len(cluster_peers):
            raise ValueError(f"stage {stage_index} outside a cluster of {len(cluster_peers)}")
        if cluster_peers[stage_index] != rpc.peer_id:
            raise ValueError("cluster_peers[stage_index] must be this peer")
        self.rpc = rpc
        self.executor = executor
        self.epochs = EpochSwitch(epoch, transition_s=(config or PipelineConfig()).epoch_transition_s)
        self.peers = list(cluster_peers)
        self.index = stage_index
        self.config = config = config or PipelineConfig()
        self.label_spec = label_spec if label_spec is not None else executor.label_spec
        num_stages = len(cluster_peers)
        # the in-flight limit; with `adaptive_window`, the first stage adapts it between S and this cap
        self.window_cap = config.max_in_flight or default_window(num_stages)
        self.window: InflightWindow | None = None
        if config.adaptive_window and stage_index == 0:
            self.window = InflightWindow(floor=min(num_stages, self.window_cap), cap=self.window_cap)
        self.prev_peer = cluster_peers[stage_index - 1] if stage_index > 0 else None
        self.next_peer = cluster_peers[stage_index + 1] if stage_index < len(cluster_peers) - 1 else None
        self.stats = StageStats()
        self._loss_fn = make_loss(executor.config.loss)
        self._forward_q: deque[Work] = deque()
        self._backward_q: deque[Work] = deque()
        self._queue_limit = 2 * self.window_cap + 4
        self._space = asyncio.Condition()
        self._work = asyncio.Event()
        self._pending_forward: set[int] = set()
        self._pending_backward: set[int] = set()
        self._dropping: set[int] = set()
        self._window_open = asyncio.Event()
        self._window_open.set()
        self._outstanding: dict[int, _Issued] = {}  # first stage: micro-batches admitted, not home yet
        self._all_done = asyncio.Event()
        self._eval_waiters: dict[int, asyncio.Future[EvalResult | None]] = {}
        self._next_id = 0
        self.ids = MicroBatchIds(span=max(8 * self.window_cap, 1024))
        self.ledger = PeerLedger(threshold=config.misbehaviour_threshold, on_exclude=self._on_exclude)
        self.ledger.new_epoch(epoch)
        self.finished = asyncio.Event()
        # set when training is over (finish sent or received, or failed): heartbeats stop, since
        # neighbours then close their services on their own schedule
        self.quiet = asyncio.Event()
        self.failure: BaseException | None = None
        self._tasks = TaskOwner(f"stage{stage_index}")
        self._methods: list[RpcMethod[Any, Any]] = []
        self.sender = Sender(
            rpc,
            config,
            self.stats,
            self._tasks,
            on_refused=self._on_refused,
            on_lost=self._lost,
            on_delivered=self._heard,
        )
        neighbours = [p for p in (self.prev_peer, self.next_peer) if p is not None]
        self.watch = NeighbourWatch(
            rpc,
            epoch,
            neighbours,
            period_s=config.heartbeat_period_s,
            timeout_s=config.neighbour_timeout_s,
            on_lost=self._lost,
            epochs=self.epochs,
        )
        # called by the worker after every optimizer step with the step count; awaited, so a hook that
        # must see quiet weights (e.g. the final averaging round) holds this stage's work meanwhile
        self.on_step: Callable[[int], Awaitable[None]] | None = None
        # called with (peer id, reason) when the ledger excludes a sender for this epoch (e.g. wired to
        # `MembershipService.report_misbehaviour`)
        self.on_exclude: Callable[[str, str], None] | None = None

    @property
    def epoch(self) -> int:
        """The plan epoch this stage serves now (`move_to_epoch` changes it in place)."""
        return self.epochs.current

    def move_to_epoch(self, epoch: int) -> None:
        """Serve plan `epoch` from now on without stopping: the cluster (same peers, same layers) kept its
        place in the new plan. The previous epoch stays accepted from the cluster's peers for
        `PipelineConfig.epoch_transition_s`, and each peer is sent the new epoch once it takes it
        (`runtime.epochs`); the sender ledger starts the new epoch clean."""
        self.epochs.move_to(epoch)
        self.ledger.new_epoch(epoch)
        logger.info("stage %d moves to epoch %d in place", self.index, epoch)

    # ----- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._serve(PING, self._on_ping)
        if not self.is_first:
            await self._serve(FORWARD, self._on_forward)
            await self._serve(FINISH, self._on_finish)
            await self._serve(READY, self._on_ready)
        else:
            await self._serve(EVAL_RESULT, self._on_eval_result)
        if not self.is_last:
            await self._serve(BACKWARD, self._on_backward)
            await self._serve(DROP, self._on_drop)
        self._tasks.spawn(self._worker(), name="worker")
        if self.watch.neighbours:
            self._tasks.spawn(self.watch.run(stop=self.quiet), name="heartbeat")

    async def aclose(self) -> None:
        await self._tasks.aclose()
        for method in self._methods:
            await self.rpc.unserve(method)
        for waiter in self._eval_waiters.values():
            waiter.cancel()

    def queue_depths(self) -> dict[str, int]:
        return {
            "forward": len(self._forward_q),
            "backward": len(self._backward_q),
            "in_flight": len(self._outstanding),
        }

    # ----- faults ----------------------------------------------------------------------------------
    def _heard(self, peer: str) -> None:
        self.watch.heard(peer)

    def _lost(self, peer: str, reason: str) -> None:
        self._fail(NeighbourLost(peer, reason))

    def _on_exclude(self, peer: str, reason: str) -> None:
        if self.on_exclude is not None:
            self.on_exclude(peer, reason)
        if peer in self.peers:  # we refuse its messages from now on: this pipeline cannot go on
            self._fail(NeighbourLost(peer, f"excluded: {reason}"))

    def _on_refused(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, exc: RemoteError
    ) -> None:
        if not isinstance(request, ForwardRequest):
            return  # a refused backward was dropped by its receiver; a refused notice changes nothing
        mb = request.micro_batch_id
        reason = f"forward refused by {peer}: {exc.code}"
        if request.mode == Mode.TRAIN:
            self._drop(mb, reason)
        elif self.is_first:
            waiter = self._eval_waiters.get(mb)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        else:
            notice = DropNotice(epoch=self.epoch, micro_batch_id=mb, reason=reason[:200])
            self._send(self.peers[0], DROP, notice, [])

    def _drop(self, mb: int, reason: str) -> None:
        """Drop micro-batch ``mb`` (on the worker, which owns the executor): release, tell upstream."""
        if mb in self._dropping:
            return
        self._dropping.add(mb)
        self._backward_q.appendleft(Work("drop", mb, None, reason=reason))
        self._work.set()

    async def _process_drop(self, mb: int, reason: str) -> None:
        try:
            await self._compute(self.executor.release, mb)
            self.ids.done(mb)
            self.stats.dropped += 1
            logger.info("stage %d dropped micro-batch %d: %s", self.index, mb, reason)
            if self.is_first:
                self._reissue(mb)
            else:
                notice = DropNotice(epoch=self.epoch, micro_batch_id=mb, reason=reason[:200])
                self._send(self.peers[self.index - 1], DROP, notice, [])
        finally:
            self._dropping.discard(mb)

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            logger.error("stage %d of epoch %d failed: %s", self.index, self.epoch, exc)
        self._all_done.set()
        self._window_open.set()
        self._work.set()
        self.quiet.set()
        self.finished.set()
        for waiter in self._eval_waiters.values():
            if not waiter.done():
                waiter.set_exception(RavnestError(f"pipeline failed: {exc}"))

    # ----- computing -------------------------------------------------------------------------------
    async def _next_work(self) -> Work | None:
        while self.failure is None:
            if self._backward_q:  # 1F1B: a pending backward (or a drop) always goes first
                work = self._backward_q.popleft()
            elif self._forward_q:
                work = self._forward_q.popleft()
            else:
                self._work.clear()
                await self._work.wait()
                continue
            async with self._space:
                self._space.notify_all()
            return work
        return None

    async def _worker(self) -> None:
        while (work := await self._next_work()) is not None:
            try:
                await self._process(work)
            except NonFiniteResult as exc:  # poison from a neighbour's input: drop, hold it against them
                culprit = self.next_peer if work.kind == "backward" else self.prev_peer
                if culprit is not None:
                    self.ledger.count(culprit, str(exc))
                await self._process_drop(work.micro_batch_id, str(exc))
            except InvalidMessage as exc:  # raced past the handler's check (e.g. a duplicate): drop it
                logger.warning(
                    "stage %d dropped %s of micro-batch %d: %s",
                    self.index,
                    work.kind,
                    work.micro_batch_id,
                    exc,
                )
                if work.kind in ("forward", "backward"):  # release it; the first stage re-issues it
                    await self._process_drop(work.micro_batch_id, str(exc))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.error(
                    "stage %d failed on %s of micro-batch %d",
                    self.index,
                    work.kind,
                    work.micro_batch_id,
                    exc_info=True,
                )
                self._fail(exc)
            finally:
                pending = self._pending_backward if work.kind == "backward" else self._pending_forward
                pending.discard(work.micro_batch_id)
        # failed: free every stashed version and activation at once, wake whoever waits for queue space
        self._forward_q.clear()
        self._backward_q.clear()
        async with self._space:
            self._space.notify_all()
        released = await run_in_compute_thread(self.executor.release_all)
        self._outstanding.clear()
        logger.info("stage %d released %d in-flight micro-batches after its failure", self.index, released)

    async def _process(self, work: Work) -> None:
        steps_before = self.executor.num_steps
        await self._process_work(work)
        if self.on_step is not None and self.executor.num_steps != steps_before:
            await self.on_step(self.executor.num_steps)

    async def _process_work(self, work: Work) -> None:
        ex = self.executor
        mb = work.micro_batch_id
        if work.kind == "drop":
            await self._process_drop(mb, work.reason)
            return
        assert work.tensor is not None
        if work.kind == "eval":
            output = await self._compute(ex.predict, work.tensor)
            self.ids.done(mb)
            if self.is_last:
                await self._report_eval(mb, output, work.labels)
            else:
                self._send_forward(mb, output, work.labels, Mode.EVAL)
        elif work.kind == "forward":
            if self.is_last:
                result = await self._compute(ex.forward_loss, mb, work.tensor, work.labels)
                self.ids.done(mb)
                self.stats.last_loss = result.loss
                self._count(work.tensor.shape[0], forward=True, backward=True)
                if self.is_first:
                    self._complete(mb)
                else:
                    assert result.grad_input is not None
                    request = BackwardRequest(epoch=self.epoch, micro_batch_id=mb, loss=result.loss)
                    self._send(self.prev_peer, BACKWARD, request, [result.grad_input])
            else:
                version = ex.weight_version
                output = await self._compute(ex.forward, mb, work.tensor)
                self._count(work.tensor.shape[0], forward=True)
                self._send_forward(mb, output, work.labels, Mode.TRAIN, version)
        else:
            grad_input = await self._compute(ex.backward, mb, work.tensor)
            self._count(0, backward=True)
            if work.loss is not None:
                self.stats.last_loss = work.loss
            if self.is_first:
                self._complete(mb)
            else:
                self.ids.done(mb)
                assert grad_input is not None
                request = BackwardRequest(epoch=self.epoch, micro_batch_id=mb, loss=work.loss)
                self._send(self.prev_peer, BACKWARD, request, [grad_input])

    async def _compute(self, fn: Any, *args: Any) -> Any:
        # timed on the compute thread, around the work only: a call waiting for the thread (the next
        # micro-batch's forward, an averaging round's copy) is not compute, and overlapping waits would
        # count twice (a single stage with window 2 measured compute / wall = 1.4)
        def timed() -> Any:
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.stats.compute_s += time.perf_counter() - start  # only the compute thread writes

        return await run_in_compute_thread(timed)

    def _count(self, samples: int, *, forward: bool = False, backward: bool = False) -> None:
        self.stats.forwards += forward
        self.stats.backwards += backward
        self.stats.samples += samples
        if samples:
            self.stats.recent.append((time.monotonic(), self.stats.samples))

    async def _report_eval(self, mb: int, output: Tensor, labels: Tensor | None) -> None:
        assert labels is not None
        loss = float(self._loss_fn(output, labels)) * labels.shape[0]
        correct = 0
        if output.is_floating_point() and not labels.is_floating_point():
            correct = int((output.argmax(dim=-1) == labels).sum())
        if not (loss >= 0.0 and loss < float("inf")):  # NaN/inf from a neighbour's input: drop it
            self.ledger.count(self.prev_peer or self.rpc.peer_id, f"evaluation loss of {mb} is {loss}")
            loss_ok = False
        else:
            loss_ok = True
        result = EvalResult(
            epoch=self.epoch,
            micro_batch_id=mb,
            loss_sum=loss if loss_ok else 0.0,
            num_correct=correct,
            num_samples=int(labels.shape[0]),
            num_targets=int(labels.numel()),
        )
        if self.is_first:
            waiter = self._eval_waiters.get(mb)
            if waiter is not None and not waiter.done():
                waiter.set_result(result if loss_ok else None)
        elif loss_ok:
            self._send(self.peers[0], EVAL_RESULT, result, [])
        else:
            notice = DropNotice(epoch=self.epoch, micro_batch_id=mb, reason="evaluation loss is not finite")
            self._send(self.peers[0], DROP, notice, [])

    # ----- sending (`runtime.sender`) ---------------------------------------------------------------
    def _send_forward(
        self, mb: int, output: Tensor, labels: Tensor | None, mode: Mode, version: int = 0
    ) -> None:
        assert labels is not None
        request = ForwardRequest(epoch=self.epoch, micro_batch_id=mb, mode=mode, weight_version=version)
        self._send(self.next_peer, FORWARD, request, [output, labels])

    def _send(
        self, peer: str | None, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        assert peer is not None
        epoch = self.epochs.for_peer(peer)
        if getattr(request, "epoch", epoch) != epoch:  # during an in-place switch: what the peer takes
            request = request.model_copy(update={"epoch": epoch})
        self.sender.send(peer, method, request, tensors)
