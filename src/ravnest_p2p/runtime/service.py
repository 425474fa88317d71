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
on it. Sends run as owned background tasks so the compute thread never waits on the network; receives
are validated in the RPC handler — epoch, sender, micro-batch, shape, dtype, finite values — and a bad
message is refused in the reply before anything is queued.

Back-pressure: the window bounds what is in flight, so queues never exceed it; a queue that is full
anyway (a misbehaving sender) makes the handler wait up to its deadline, which slows the sender down
instead of growing memory.

Known limits: a neighbour that dies leaves its micro-batches unanswered; the stage reports `failed`
after `micro_batch_timeout_s` and the cluster is re-planned (membership), not repaired in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from pydantic import BaseModel
from torch import Tensor

from ravnest_p2p.errors import InvalidMessage, RavnestError, RemoteError, StaleEpoch, TransportError
from ravnest_p2p.models.spec import make_loss
from ravnest_p2p.runtime.messages import (
    BACKWARD,
    EVAL_RESULT,
    FINISH,
    FORWARD,
    READY,
    Ack,
    BackwardRequest,
    EvalResult,
    FinishRequest,
    ForwardRequest,
    Mode,
    ReadyReply,
    ReadyRequest,
)
from ravnest_p2p.runtime.pipeline import PipelineConfig, StageStats, Work, default_window, tensor_bytes
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.runtime.validation import check_tensor
from ravnest_p2p.runtime.window import InflightWindow
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint, RpcMethod
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["PipelineConfig", "StageService", "StageStats", "default_window"]

logger = logging.getLogger(__name__)


class StageService:
    """Serves one stage of one cluster for one plan epoch. The first stage also drives training."""

    def __init__(
        self,
        rpc: RpcEndpoint,
        executor: StageExecutor,
        *,
        epoch: int,
        cluster_peers: Sequence[str],
        stage_index: int,
        config: PipelineConfig | None = None,
    ) -> None:
        if not 0 <= stage_index < len(cluster_peers):
            raise ValueError(f"stage {stage_index} outside a cluster of {len(cluster_peers)}")
        if cluster_peers[stage_index] != rpc.peer_id:
            raise ValueError("cluster_peers[stage_index] must be this peer")
        self.rpc = rpc
        self.executor = executor
        self.epoch = epoch
        self.peers = list(cluster_peers)
        self.index = stage_index
        self.config = config or PipelineConfig()
        num_stages = len(cluster_peers)
        # the in-flight limit; with `adaptive_window`, the first stage adapts it between S and this cap
        self.window_cap = self.config.max_in_flight or default_window(num_stages)
        self.window: InflightWindow | None = None
        if self.config.adaptive_window and stage_index == 0:
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
        self._window_open = asyncio.Event()
        self._window_open.set()
        self._outstanding: dict[int, float] = {}  # first stage: micro-batch id -> admitted at
        self._all_done = asyncio.Event()
        self._eval_waiters: dict[int, asyncio.Future[EvalResult]] = {}
        self._next_id = 0
        self.finished = asyncio.Event()
        self.failure: BaseException | None = None
        self._tasks = TaskOwner(f"stage{stage_index}")
        self._methods: list[RpcMethod[Any, Any]] = []
        # called by the worker after every optimizer step with the step count; awaited, so a hook that
        # must see quiet weights (e.g. the final averaging round) holds this stage's work meanwhile
        self.on_step: Callable[[int], Awaitable[None]] | None = None

    @property
    def window_size(self) -> int:
        """Micro-batches the first stage admits before one comes home (now)."""
        return self.window.size if self.window is not None else self.window_cap

    # ----- lifecycle -------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.prev_peer is None

    @property
    def is_last(self) -> bool:
        return self.next_peer is None

    async def start(self) -> None:
        if not self.is_first:
            await self._serve(FORWARD, self._on_forward)
            await self._serve(FINISH, self._on_finish)
            await self._serve(READY, self._on_ready)
        else:
            await self._serve(EVAL_RESULT, self._on_eval_result)
        if not self.is_last:
            await self._serve(BACKWARD, self._on_backward)
        self._tasks.spawn(self._worker(), name="worker")

    async def _serve(self, method: RpcMethod[Any, Any], handler: Any) -> None:
        await self.rpc.serve(method, handler)
        self._methods.append(method)

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

    # ----- receiving -------------------------------------------------------------------------------
    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpoch(f"message for epoch {epoch}, this stage is in epoch {self.epoch}")

    async def _enqueue(self, queue: deque[Work], work: Work) -> int:
        async with self._space:
            await self._space.wait_for(lambda: len(queue) < self._queue_limit)
            queue.append(work)
        self._work.set()
        return len(queue)

    async def _on_forward(self, req: ForwardRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.prev_peer:
            raise InvalidMessage("forward from a peer that is not the previous stage")
        self._check_epoch(req.epoch)
        if len(tensors) != 2:
            raise InvalidMessage("forward carries exactly [activations, labels]")
        x, labels = tensors
        if req.mode == Mode.EVAL:
            check_tensor(x, self.executor.input_spec, "eval input")
            if self.is_last and self.executor.label_spec is not None:
                check_tensor(labels, self.executor.label_spec, "eval labels", batch_size=x.shape[0])
            return Ack(
                queued=await self._enqueue(self._forward_q, Work("eval", req.micro_batch_id, x, labels))
            )
        if req.micro_batch_id in self._pending_forward:
            raise InvalidMessage(f"micro-batch {req.micro_batch_id} is already queued")
        self.executor.validate_forward(req.micro_batch_id, x, labels)
        self._pending_forward.add(req.micro_batch_id)
        queued = await self._enqueue(self._forward_q, Work("forward", req.micro_batch_id, x, labels))
        return Ack(queued=queued)

    async def _on_backward(self, req: BackwardRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.next_peer:
            raise InvalidMessage("backward from a peer that is not the next stage")
        self._check_epoch(req.epoch)
        if len(tensors) != 1:
            raise InvalidMessage("backward carries exactly one gradient")
        if req.micro_batch_id in self._pending_backward:
            raise InvalidMessage(f"micro-batch {req.micro_batch_id} is already queued for backward")
        self.executor.validate_backward(req.micro_batch_id, tensors[0])
        self._pending_backward.add(req.micro_batch_id)
        work = Work("backward", req.micro_batch_id, tensors[0], loss=req.loss)
        return Ack(queued=await self._enqueue(self._backward_q, work))

    async def _on_eval_result(self, req: EvalResult, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.peers[-1]:
            raise InvalidMessage("eval result from a peer that is not the last stage")
        self._check_epoch(req.epoch)
        waiter = self._eval_waiters.get(req.micro_batch_id)
        if waiter is None or waiter.done():
            raise InvalidMessage(f"no evaluation pending for micro-batch {req.micro_batch_id}")
        waiter.set_result(req)
        return Ack()

    async def _on_ready(self, req: ReadyRequest, tensors: list[Tensor], ctx: CallContext) -> ReadyReply:
        self._check_epoch(req.epoch)
        return ReadyReply(stage=self.index)

    async def wait_ready(self, timeout_s: float) -> None:
        """First stage: wait (with a deadline) until every other stage of the cluster serves this epoch."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(self.peers[1:])
        delay_s = 0.1
        while pending:
            peer = pending[0]
            try:
                await self.rpc.call(peer, READY, ReadyRequest(epoch=self.epoch), timeout_s=5.0)
                pending.pop(0)
                continue
            except TransportError as exc:
                if loop.time() + delay_s > deadline:
                    raise RavnestError(f"stage peer {peer} not ready after {timeout_s:.0f}s: {exc}") from None
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)

    async def _on_finish(self, req: FinishRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.peers[0]:
            raise InvalidMessage("finish from a peer that is not the first stage")
        self._check_epoch(req.epoch)
        self.finished.set()
        return Ack()

    # ----- computing -------------------------------------------------------------------------------
    async def _next_work(self) -> Work:
        while True:
            if self._backward_q:  # 1F1B: a pending backward always goes first
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

    async def _worker(self) -> None:
        while True:
            work = await self._next_work()
            try:
                await self._process(work)
            except InvalidMessage as exc:  # raced past the handler's check (e.g. a duplicate): drop it
                logger.warning(
                    "stage %d dropped %s of micro-batch %d: %s",
                    self.index,
                    work.kind,
                    work.micro_batch_id,
                    exc,
                )
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
                return
            finally:
                pending = self._pending_forward if work.kind == "forward" else self._pending_backward
                pending.discard(work.micro_batch_id)

    async def _process(self, work: Work) -> None:
        steps_before = self.executor.num_steps
        await self._process_work(work)
        if self.on_step is not None and self.executor.num_steps != steps_before:
            await self.on_step(self.executor.num_steps)

    async def _process_work(self, work: Work) -> None:
        ex = self.executor
        mb = work.micro_batch_id
        if work.kind == "eval":
            output = await self._compute(ex.predict, work.tensor)
            if self.is_last:
                await self._report_eval(mb, output, work.labels)
            else:
                self._send_forward(mb, output, work.labels, Mode.EVAL)
        elif work.kind == "forward":
            if self.is_last:
                result = await self._compute(ex.forward_loss, mb, work.tensor, work.labels)
                self.stats.last_loss = result.loss
                self._count(work.tensor.shape[0], forward=True, backward=True)
                if self.is_first:
                    self._complete(mb)
                else:
                    assert result.grad_input is not None
                    self._send(
                        self.prev_peer,
                        BACKWARD,
                        BackwardRequest(epoch=self.epoch, micro_batch_id=mb, loss=result.loss),
                        [result.grad_input],
                    )
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
                assert grad_input is not None
                self._send(
                    self.prev_peer,
                    BACKWARD,
                    BackwardRequest(epoch=self.epoch, micro_batch_id=mb, loss=work.loss),
                    [grad_input],
                )

    async def _compute(self, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return await run_in_compute_thread(fn, *args)
        finally:
            self.stats.compute_s += time.perf_counter() - start

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
        result = EvalResult(
            epoch=self.epoch,
            micro_batch_id=mb,
            loss_sum=max(loss, 0.0),
            num_correct=correct,
            num_samples=int(labels.shape[0]),
            num_targets=int(labels.numel()),
        )
        if self.is_first:
            waiter = self._eval_waiters.get(mb)
            if waiter is not None and not waiter.done():
                waiter.set_result(result)
        else:
            self._send(self.peers[0], EVAL_RESULT, result, [])

    # ----- sending ---------------------------------------------------------------------------------
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
        self._tasks.spawn(self._send_with_retries(peer, method, request, tensors), name=f"send-{method.name}")

    async def _send_with_retries(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        self.stats.send_started()
        try:
            await self._send_attempts(peer, method, request, tensors)
        finally:
            self.stats.send_ended()

    async def _send_attempts(
        self, peer: str, method: RpcMethod[Any, Any], request: BaseModel, tensors: Sequence[Tensor]
    ) -> None:
        for attempt in range(1, self.config.send_attempts + 1):
            try:
                await self.rpc.call(
                    peer,
                    method,
                    request,
                    tensors=tensors,
                    timeout_s=self.config.send_timeout_s,
                    compression=self.config.compression,
                )
                self.stats.bytes_sent += tensor_bytes(tensors)
                return
            except RemoteError as exc:
                # the receiver refused it: resending the same message cannot help
                self._fail(RavnestError(f"{method.name} refused by {peer}: {exc}"))
                return
            except TransportError as exc:
                logger.info("%s to %s failed (attempt %d): %s", method.name, peer, attempt, exc)
                if attempt < self.config.send_attempts:
                    await asyncio.sleep(0.2 * 2**attempt)  # a restarting daemon or a brief partition
        self._fail(RavnestError(f"{method.name} to {peer} failed {self.config.send_attempts} times"))

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            logger.error("stage %d of epoch %d failed: %s", self.index, self.epoch, exc)
        self._all_done.set()
        self._window_open.set()
        self.finished.set()
        for waiter in self._eval_waiters.values():
            if not waiter.done():
                waiter.set_exception(RavnestError(f"pipeline failed: {exc}"))

    # ----- driving (first stage) -------------------------------------------------------------------
    def _complete(self, mb: int) -> None:
        admitted_at = self._outstanding.pop(mb, None)
        if admitted_at is not None:
            self.stats.completed += 1
            if self.window is not None:
                self.window.on_complete(admitted_at, time.monotonic())
            if len(self._outstanding) < self.window_size:
                self._window_open.set()
            if not self._outstanding:
                self._all_done.set()

    async def train(self, batches: Iterable[tuple[Tensor, Tensor]]) -> StageStats:
        """First stage: push every batch through the pipeline (at most the window in flight); wait for all."""
        if not self.is_first:
            raise RuntimeError("only the first stage drives training")
        started = time.perf_counter()
        try:
            await self._train(batches)
        finally:
            self.stats.train_wall_s += time.perf_counter() - started
        return self.stats

    async def _train(self, batches: Iterable[tuple[Tensor, Tensor]]) -> None:
        for inputs, labels in batches:
            await self._acquire_window()
            mb = self._next_id
            self._next_id += 1
            self._outstanding[mb] = time.monotonic()
            self._all_done.clear()
            self._pending_forward.add(mb)
            await self._enqueue(self._forward_q, Work("forward", mb, inputs, labels))
        await self._wait_all_done()

    async def _acquire_window(self) -> None:
        while True:
            self._raise_if_failed()
            if len(self._outstanding) < self.window_size:
                return
            self._window_open.clear()
            try:
                async with asyncio.timeout(self.config.micro_batch_timeout_s):
                    await self._window_open.wait()
            except TimeoutError:
                self._fail(RavnestError(f"no micro-batch came back in {self.config.micro_batch_timeout_s}s"))

    async def _wait_all_done(self) -> None:
        if self._outstanding:
            try:
                async with asyncio.timeout(self.config.micro_batch_timeout_s):
                    await self._all_done.wait()
            except TimeoutError:
                self._fail(RavnestError(f"{len(self._outstanding)} micro-batches never came back"))
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RavnestError(f"pipeline failed: {self.failure}") from self.failure

    async def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[float, float]:
        """First stage: mean loss and accuracy of the whole pipeline (live weights) on `batches`."""
        if not self.is_first:
            raise RuntimeError("only the first stage drives evaluation")
        loop = asyncio.get_running_loop()
        waiters = []
        for inputs, labels in batches:
            mb = self._next_id
            self._next_id += 1
            waiter: asyncio.Future[EvalResult] = loop.create_future()
            self._eval_waiters[mb] = waiter
            waiters.append(waiter)
            await self._enqueue(self._forward_q, Work("eval", mb, inputs, labels))
        try:
            async with asyncio.timeout(self.config.micro_batch_timeout_s):
                results = await asyncio.gather(*waiters)
        finally:
            for mb in [k for k, w in self._eval_waiters.items() if w in waiters]:
                del self._eval_waiters[mb]
        loss = sum(r.loss_sum for r in results) / max(sum(r.num_samples for r in results), 1)
        accuracy = sum(r.num_correct for r in results) / max(sum(r.num_targets for r in results), 1)
        return loss, accuracy

    async def finish(self) -> None:
        """First stage: tell the other stages training is over (best effort, with deadlines)."""
        for peer in self.peers[1:]:
            try:
                await self.rpc.call(peer, FINISH, FinishRequest(epoch=self.epoch), timeout_s=10)
            except TransportError as exc:
                logger.info("finish to %s failed: %s", peer, exc)
        self.finished.set()
