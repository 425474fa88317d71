"""The receiving half of a stage service: every handler refuses a bad message before it is queued.

A refusal is an `InvalidMessage` in the reply, and (unless it is a normal race or a stale epoch) it is
counted against the sender in the stage's `PeerLedger`; an excluded sender is refused before its
handler runs. What each handler checks, in order: the sender's place in the cluster, the epoch, the
micro-batch id (no replay, inside the window), then the tensors (shape, dtype, label range, magnitude).
See docs/pipeline-faults.md.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from torch import Tensor

from ravnest_p2p.errors import InvalidMessage, NeighbourLost, StaleEpoch
from ravnest_p2p.models.spec import TensorSpec
from ravnest_p2p.runtime.admission import MicroBatchIds
from ravnest_p2p.runtime.epochs import EpochSwitch
from ravnest_p2p.runtime.liveness import NeighbourWatch
from ravnest_p2p.runtime.messages import (
    Ack,
    BackwardRequest,
    DropNotice,
    EvalResult,
    FinishRequest,
    ForwardRequest,
    Mode,
    PingReply,
    PingRequest,
    ReadyReply,
    ReadyRequest,
)
from ravnest_p2p.runtime.pipeline import PipelineConfig, StageStats, Work
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.runtime.validation import check_tensor
from ravnest_p2p.transport.ledger import PeerLedger
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint, RpcMethod

__all__ = ["StageHandlers"]


class _Excluded(InvalidMessage):
    code = "excluded"


class _Benign(InvalidMessage):
    """A refusal that is a normal race (e.g. a drop notice for a micro-batch already gone): not counted."""


class StageHandlers:
    """RPC handlers of `StageService` (a mixin: the service owns the state declared here)."""

    rpc: RpcEndpoint
    executor: StageExecutor
    epochs: EpochSwitch
    peers: list[str]
    index: int
    config: PipelineConfig
    label_spec: TensorSpec | None
    prev_peer: str | None
    next_peer: str | None
    stats: StageStats
    ids: MicroBatchIds
    ledger: PeerLedger
    watch: NeighbourWatch
    failure: BaseException | None
    finished: asyncio.Event
    quiet: asyncio.Event
    _methods: list[RpcMethod[Any, Any]]
    _forward_q: deque[Work]
    _backward_q: deque[Work]
    _queue_limit: int
    _space: asyncio.Condition
    _work: asyncio.Event
    _pending_forward: set[int]
    _pending_backward: set[int]
    _dropping: set[int]
    _eval_waiters: dict[int, asyncio.Future[EvalResult | None]]

    @property
    def is_first(self) -> bool:
        return self.prev_peer is None

    @property
    def is_last(self) -> bool:
        return self.next_peer is None

    def _drop(self, mb: int, reason: str) -> None:
        raise NotImplementedError

    async def _serve(self, method: RpcMethod[Any, Any], handler: Callable[..., Awaitable[Any]]) -> None:
        async def guarded(request: Any, tensors: list[Tensor], ctx: CallContext) -> Any:
            sender = ctx.remote_peer_id
            if self.ledger.is_excluded(sender):
                raise _Excluded(f"{sender} is excluded for epoch {self.epochs.current}")
            try:
                return await handler(request, tensors, ctx)
            except (StaleEpoch, _Benign):
                raise  # normal around a re-plan or a race: refused, not held against the sender
            except InvalidMessage as exc:
                self.stats.refused += 1
                self.ledger.count(sender, f"{method.name}: {exc}"[:200])
                raise

        await self.rpc.serve(method, guarded)
        self._methods.append(method)

    # ----- receiving -------------------------------------------------------------------------------
    def _check_epoch(self, epoch: int, ctx: CallContext) -> None:
        """Refuse another epoch (in an in-place switch, the previous one is still taken: `EpochSwitch`)."""
        if not self.epochs.accepts(epoch):
            raise StaleEpoch(f"message for epoch {epoch}, this stage is in epoch {self.epochs.current}")
        if ctx.remote_peer_id in self.peers:
            self.epochs.heard(ctx.remote_peer_id, epoch)

    def _check_from(self, ctx: CallContext, expected: str | None, refusal: str) -> None:
        if ctx.remote_peer_id != expected:
            raise InvalidMessage(refusal)
        self.watch.heard(ctx.remote_peer_id)

    async def _enqueue(self, queue: deque[Work], work: Work) -> int:
        async with self._space:
            await self._space.wait_for(lambda: len(queue) < self._queue_limit or self.failure is not None)
            if self.failure is not None:  # the worker is gone: nothing will take it
                raise _Benign("this stage has failed")
            queue.append(work)
        self._work.set()
        return len(queue)

    def _check_labels(self, mb: int, x: Tensor, labels: Tensor) -> None:
        if self.label_spec is not None:
            what = f"labels of micro-batch {mb}"
            check_tensor(
                labels, self.label_spec, what, batch_size=x.shape[0], max_abs=self.config.max_abs_value
            )
        elif labels.dim() == 0 or labels.shape[0] != x.shape[0]:
            raise InvalidMessage(f"labels of micro-batch {mb} do not match its batch of {x.shape[0]}")

    async def _on_forward(self, req: ForwardRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        self._check_from(ctx, self.prev_peer, "forward from a peer that is not the previous stage")
        self._check_epoch(req.epoch, ctx)
        if len(tensors) != 2:
            raise InvalidMessage("forward carries exactly [activations, labels]")
        x, labels = tensors
        mb = req.micro_batch_id
        self.ids.check(mb)
        if mb in self._pending_forward:
            raise InvalidMessage(f"micro-batch {mb} is already queued")
        if req.mode == Mode.EVAL:
            check_tensor(x, self.executor.input_spec, "eval input", max_abs=self.config.max_abs_value)
            self._check_labels(mb, x, labels)
            kind = "eval"
        else:
            self.executor.validate_forward(mb, x, labels, max_abs=self.config.max_abs_value)
            if not self.is_last:
                self._check_labels(mb, x, labels)
            kind = "forward"
        self.ids.accept(mb)
        self._pending_forward.add(mb)
        return Ack(queued=await self._enqueue(self._forward_q, Work(kind, mb, x, labels)))

    async def _on_backward(self, req: BackwardRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        self._check_from(ctx, self.next_peer, "backward from a peer that is not the next stage")
        self._check_epoch(req.epoch, ctx)
        if len(tensors) != 1:
            raise InvalidMessage("backward carries exactly one gradient")
        mb = req.micro_batch_id
        if mb in self._pending_backward or mb in self._dropping:
            raise InvalidMessage(f"micro-batch {mb} is already queued for backward")
        try:
            self.executor.validate_backward(mb, tensors[0], max_abs=self.config.max_abs_value)
        except InvalidMessage as exc:
            if mb in self.executor.in_flight:  # our neighbour sent garbage for a real micro-batch
                self._drop(mb, f"bad gradient: {exc}")
            raise
        self._pending_backward.add(mb)
        work = Work("backward", mb, tensors[0], loss=req.loss)
        return Ack(queued=await self._enqueue(self._backward_q, work))

    async def _on_drop(self, req: DropNotice, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id not in self.peers[self.index + 1 :]:
            raise InvalidMessage("drop notice from a peer that is not downstream")
        self._check_epoch(req.epoch, ctx)
        self.watch.heard(ctx.remote_peer_id)
        mb = req.micro_batch_id
        waiter = self._eval_waiters.get(mb) if self.is_first else None
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
            return Ack()
        if ctx.remote_peer_id != self.next_peer:
            raise InvalidMessage("a training drop notice comes from the next stage")
        if mb in self._pending_backward or mb not in self.executor.in_flight:
            raise _Benign(f"micro-batch {mb} is not waiting for its backward here")
        self._drop(mb, f"dropped downstream: {req.reason}")
        return Ack()

    async def _on_eval_result(self, req: EvalResult, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.peers[-1]:
            raise InvalidMessage("eval result from a peer that is not the last stage")
        self._check_epoch(req.epoch, ctx)
        self.watch.heard(ctx.remote_peer_id)
        waiter = self._eval_waiters.get(req.micro_batch_id)
        if waiter is None or waiter.done():  # never issued, or late after a timeout: not held against it
            raise _Benign(f"no evaluation pending for micro-batch {req.micro_batch_id}")
        waiter.set_result(req)
        return Ack()

    async def _on_ping(self, req: PingRequest, tensors: list[Tensor], ctx: CallContext) -> PingReply:
        if ctx.remote_peer_id not in self.peers:
            raise InvalidMessage("ping from a peer outside this cluster")
        self._check_epoch(req.epoch, ctx)
        self.watch.heard(ctx.remote_peer_id)
        lost = None
        if self.failure is not None:
            lost = self.failure.peer_id if isinstance(self.failure, NeighbourLost) else self.rpc.peer_id
        return PingReply(stage=self.index, lost_peer_id=lost)

    async def _on_ready(self, req: ReadyRequest, tensors: list[Tensor], ctx: CallContext) -> ReadyReply:
        self._check_epoch(req.epoch, ctx)
        return ReadyReply(stage=self.index, next_micro_batch_id=min(self.ids.horizon + 1, 2**61))

    async def _on_finish(self, req: FinishRequest, tensors: list[Tensor], ctx: CallContext) -> Ack:
        if ctx.remote_peer_id != self.peers[0]:
            raise InvalidMessage("finish from a peer that is not the first stage")
        self._check_epoch(req.epoch, ctx)
        self.quiet.set()
        self.finished.set()
        return Ack()
