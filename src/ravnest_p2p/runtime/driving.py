"""The first stage's half of a stage service: admitting micro-batches, re-issuing dropped ones, evaluating.

The first stage issues micro-batch ids in increasing order and keeps at most ``window_size`` of them
outstanding (admitted, backward not home yet). A micro-batch dropped downstream (a `stage_drop` notice,
or its forward refused) is re-issued under a fresh id ``reissue_attempts`` times, then skipped, so a
hostile or confused neighbour costs samples, never the run. Evaluation micro-batches share the id
space; a dropped one is left out of the means.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable

from torch import Tensor

from ravnest_p2p.errors import InvalidMessage, NeighbourLost, RavnestError, TransportError
from ravnest_p2p.runtime.epochs import EpochSwitch
from ravnest_p2p.runtime.liveness import NeighbourWatch
from ravnest_p2p.runtime.messages import FINISH, READY, EvalResult, FinishRequest, ReadyRequest
from ravnest_p2p.runtime.pipeline import PipelineConfig, StageStats, Work
from ravnest_p2p.runtime.window import InflightWindow
from ravnest_p2p.transport.rpc import RpcEndpoint

__all__ = ["FirstStageDriver"]

logger = logging.getLogger(__name__)


class _Issued:
    __slots__ = ("admitted_at", "attempts", "inputs", "labels")

    def __init__(self, admitted_at: float, inputs: Tensor, labels: Tensor, attempts: int = 0) -> None:
        self.admitted_at = admitted_at
        self.inputs = inputs
        self.labels = labels
        self.attempts = attempts


class FirstStageDriver:
    """Training and evaluation driven by the first stage (a mixin of `StageService`)."""

    rpc: RpcEndpoint
    epochs: EpochSwitch
    peers: list[str]
    config: PipelineConfig
    stats: StageStats
    window: InflightWindow | None
    window_cap: int
    watch: NeighbourWatch
    failure: BaseException | None
    finished: asyncio.Event
    quiet: asyncio.Event
    _forward_q: deque[Work]
    _work: asyncio.Event
    _pending_forward: set[int]
    _window_open: asyncio.Event
    _all_done: asyncio.Event
    _outstanding: dict[int, _Issued]
    _eval_waiters: dict[int, asyncio.Future[EvalResult | None]]
    _next_id: int

    @property
    def is_first(self) -> bool:
        raise NotImplementedError

    @property
    def window_size(self) -> int:
        """Micro-batches the first stage admits before one comes home (now)."""
        return self.window.size if self.window is not None else self.window_cap

    def _fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    async def _enqueue(self, queue: deque[Work], work: Work) -> int:
        raise NotImplementedError

    async def wait_ready(self, timeout_s: float) -> None:
        """First stage: wait (with a deadline) until every other stage of the cluster serves this epoch."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(self.peers[1:])
        delay_s = 0.1
        while pending:
            peer = pending[0]
            try:
                reply = await self.rpc.call(
                    peer, READY, ReadyRequest(epoch=self.epochs.for_peer(peer)), timeout_s=5.0
                )
                self.watch.heard(peer)
                # ids the others took from an earlier run of this stage would be refused as replays
                self._next_id = max(self._next_id, reply.message.next_micro_batch_id)
                pending.pop(0)
                continue
            except TransportError as exc:
                if loop.time() + delay_s > deadline:
                    # named as the suspect: the membership pings it and re-plans around it if it is gone
                    raise NeighbourLost(peer, f"not ready after {timeout_s:.0f}s: {exc}") from None
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 2.0)

    def _complete(self, mb: int) -> None:
        issued = self._outstanding.pop(mb, None)
        if issued is not None:
            self.stats.completed += 1
            if self.window is not None:
                self.window.on_complete(issued.admitted_at, time.monotonic())
            self._outstanding_changed()

    def _outstanding_changed(self) -> None:
        if len(self._outstanding) < self.window_size:
            self._window_open.set()
        if not self._outstanding:
            self._all_done.set()

    def _reissue(self, mb: int) -> None:
        """A dropped micro-batch: admit it again under a fresh id (``reissue_attempts`` times), else skip."""
        issued = self._outstanding.pop(mb, None)
        if issued is None:
            return
        if issued.attempts < self.config.reissue_attempts:
            new_mb = self._next_id
            self._next_id += 1
            self._outstanding[new_mb] = _Issued(
                time.monotonic(), issued.inputs, issued.labels, issued.attempts + 1
            )
            self._pending_forward.add(new_mb)
            self._forward_q.append(
                Work("forward", new_mb, issued.inputs, issued.labels)
            )  # replaces mb's slot
            self._work.set()
            self.stats.reissued += 1
        else:
            self.stats.skipped += 1
            logger.warning("first stage skips micro-batch %d after %d drops", mb, issued.attempts + 1)
            self._outstanding_changed()

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
            self._outstanding[mb] = _Issued(time.monotonic(), inputs, labels)
            self._all_done.clear()
            self._pending_forward.add(mb)
            try:
                await self._enqueue(self._forward_q, Work("forward", mb, inputs, labels))
            except InvalidMessage:  # the stage failed while we waited for queue space
                self._raise_if_failed()
                raise
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
        failure = self.failure
        if isinstance(failure, NeighbourLost):
            raise NeighbourLost(failure.peer_id, failure.reason) from failure
        if failure is not None:
            raise RavnestError(f"pipeline failed: {failure}") from failure

    async def evaluate(self, batches: Iterable[tuple[Tensor, Tensor]]) -> tuple[float, float]:
        """First stage: mean loss and accuracy of the whole pipeline (live weights) on `batches`.

        Micro-batches dropped on the way (refused or poisoned downstream) are left out of the means.
        """
        if not self.is_first:
            raise RuntimeError("only the first stage drives evaluation")
        self._raise_if_failed()
        loop = asyncio.get_running_loop()
        waiters = []
        for inputs, labels in batches:
            mb = self._next_id
            self._next_id += 1
            waiter: asyncio.Future[EvalResult | None] = loop.create_future()
            self._eval_waiters[mb] = waiter
            waiters.append(waiter)
            try:
                await self._enqueue(self._forward_q, Work("eval", mb, inputs, labels))
            except InvalidMessage:
                self._raise_if_failed()
                raise
        try:
            async with asyncio.timeout(self.config.micro_batch_timeout_s):
                outcomes = await asyncio.gather(*waiters)
        except RavnestError:
            self._raise_if_failed()  # typed (e.g. `NeighbourLost`) when the pipeline failed meanwhile
            raise
        finally:
            for mb in [k for k, w in self._eval_waiters.items() if w in waiters]:
                del self._eval_waiters[mb]
        results = [r for r in outcomes if r is not None]
        if waiters and not results:
            raise RavnestError(f"all {len(waiters)} evaluation micro-batches were dropped")
        loss = sum(r.loss_sum for r in results) / max(sum(r.num_samples for r in results), 1)
        accuracy = sum(r.num_correct for r in results) / max(sum(r.num_targets for r in results), 1)
        return loss, accuracy

    async def finish(self) -> None:
        """First stage: tell the other stages training is over (best effort, with deadlines)."""
        self.quiet.set()
        for peer in self.peers[1:]:
            try:
                await self.rpc.call(
                    peer, FINISH, FinishRequest(epoch=self.epochs.for_peer(peer)), timeout_s=10
                )
            except TransportError as exc:
                logger.info("finish to %s failed: %s", peer, exc)
        self.finished.set()
