"""`SyncBackupRunner`: this peer's part of a sync_backup job — a worker that also owns shards.

The worker loop, step t: compute the gradient of the whole model on its batch of step t
(`SyncBatches`), send each owner one message with the slices of every shard it owns (`sync_push`,
tagged t; shards owned here go straight to the local `OwnerService`; `training.sync_exchange`), and
wait for the replies: each brings the shard at step t + 1 (the owner averaged the first N
gradients), or, when this worker was one of the b too late, the shard at a newer step (its gradient
was dropped). A worker whose shards came back at different steps fetches
the lagging ones at the newest step, so every step's gradient is computed on one θ_t. The job ends when
every shard reached the job's last step; every worker then evaluates the model on the held-out split and
publishes done metrics (mode ``sync_backup``, cluster = worker index, stage 0).

Nothing hangs: an unreachable owner is pinged and, once silent for `owner_ping_timeout_s`, declared dead
(its shards move, `training.sync_owners`); a step that does not complete within `step_timeout_s` fails
the job with the owner's count of gradients (e.g. fewer than N workers alive).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from torch import Tensor, nn

from ravnest_p2p.discovery import RunDHT, dht_time
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.models import build_model, get_model_spec, make_loss, parse_config
from ravnest_p2p.strategies.sync_layout import SyncLayout
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.progress import JobProgress, ProgressStore, publish_progress
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_compute import piece_views, step_push
from ravnest_p2p.training.sync_exchange import SyncExchange
from ravnest_p2p.training.sync_owners import OwnerService
from ravnest_p2p.training.sync_report import evaluate, store_metrics, timing_record
from ravnest_p2p.training.sync_shard import SyncBatches, sync_final_step
from ravnest_p2p.training.sync_wire import ReplyKind
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = ["SyncBackupRunner"]

logger = logging.getLogger(__name__)

_LINGER_S = 30.0  # an owner serves its final shard until every live worker has it, at most this long
_LINGER_CHECK_S = 3.0  # while lingering, the workers still missing a final shard are pinged this often
_FINAL_METRICS_S = 30.0


class SyncBackupRunner(SyncExchange):
    """Runs one peer's worker + owner part of a sync_backup job (see module docstring).

    Args:
        rpc: the peer's endpoint.
        dht: where metrics and the final progress go (None: nowhere).
        job: the job (its `sync_backup` section).
        role: this peer's role: its workers are the assignment's (one-stage) clusters, in order.
        metrics_period_s: how often metrics are published.
        on_metrics: called with every metrics record.
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: RunDHT | ProgressStore | None,
        job: JobSpec,
        role: StageRole,
        *,
        metrics_period_s: float = 2.0,
        on_metrics: Callable[[StageMetrics], None] | None = None,
    ) -> None:
        self.rpc, self.dht, self.job, self.role = rpc, dht, job, role
        self.metrics_period_s = metrics_period_s
        self.on_metrics = on_metrics
        self.stop_requested = asyncio.Event()
        self.held_state: HeldState | None = None  # no hand-over of a sync_backup job's state (yet)
        self.workers = tuple(dict.fromkeys(s.peer_id for cluster in role.assignment for s in cluster))
        self.index = self.workers.index(rpc.peer_id)
        layers = build_model(job.model, job.model_params, seed=job.seed)
        if (role.first_layer, role.end_layer, role.num_stages) != (0, len(layers), 1):
            raise ValueError(
                f"sync_backup: a worker holds the whole model (layers 0-{len(layers)}), in one stage"
            )
        self.model = nn.Sequential(*layers)
        self.params = dict(self.model.named_parameters())
        num_shards = job.sync_backup.num_shards or len(job.sync_backup.owners or self.workers)
        self.pieces = piece_views(self.params, num_shards)  # shard entries: tensors or row ranges
        sizes = {name: p.numel() * p.element_size() for name, p in self.pieces.items()}
        self.layout = SyncLayout.build(job.job_id, self.workers, sizes, num_shards, job.sync_backup.owners)
        self.train, self.held_out = load_dataset(job)
        self.batches = SyncBatches(
            self.train, batch_size=job.batch_size, seed=job.seed, num_workers=len(self.workers)
        )
        self.num_data_steps = sync_final_step(
            len(self.train),
            batch_size=job.batch_size,
            num_workers=len(self.workers),
            num_epochs=job.num_epochs,
            max_steps=job.max_steps,
        )
        self.local_steps = job.sync_backup.local_steps
        self.final_step = -(-self.num_data_steps // self.local_steps)  # syncs (K data steps each)
        self.loss_fn = make_loss(get_model_spec(job.model).loss(parse_config(job.model, job.model_params)))
        self.versions = [0] * len(self.layout.shards)
        self.is_async = job.sync_backup.aggregation == "async"
        # async applies one gradient per version: as many gradients as sync's N per step in all
        self.final_version = self.final_step * (job.sync_backup.num_required if self.is_async else 1)
        self.owners = OwnerService(
            rpc, job, self.layout, final_step=self.final_version, local_copy=self._copy
        )
        self.iterations = 0  # gradients this worker computed (its data position in async)
        self.step = 0
        self.loss: float | None = None
        self.late = 0  # this worker's gradients dropped as late
        self.step_times_s: list[float] = []
        self.gradient_times_s: list[float] = []  # compute thread time of each gradient (no waiting)
        self.compute_s = 0.0
        self.train_s = 0.0  # wall time of the training loop (start barrier, evaluation, linger excluded)
        self.eval_loss: float | None = None
        self.eval_accuracy: float | None = None
        self._done = False
        self._failure: str | None = None
        self._started = time.monotonic()
        self._tasks = TaskOwner(f"sync-{rpc.peer_id[-6:]}")

    # ----- the run ----------------------------------------------------------------------------------
    async def run(self) -> StageMetrics:
        """Train until every shard reached the last step (or fail); return the final metrics."""
        cancelled = False
        await self.owners.serve()
        self._tasks.spawn(self._metrics_loop(), name="metrics")
        try:
            await self._start_barrier()
            await self._until_evicted(self._train())
            self.eval_loss, self.eval_accuracy = await run_in_compute_thread(self._evaluate)
            logger.info(
                "job %s: worker %d done at step %d: held-out loss %.4f accuracy %.4f",
                self.job.job_id,
                self.index,
                self.step,
                self.eval_loss,
                self.eval_accuracy,
            )
            logger.info("sync timing %s", json.dumps(timing_record(self)))
            self._done = True
            await self._linger()
        except asyncio.CancelledError:
            cancelled = True
            raise
        except Exception as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await self._tasks.aclose()
            await self.owners.aclose()
            if not cancelled:
                await self.publish_metrics(final=True)
        return self.metrics()

    async def _until_evicted(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` unless this peer is declared dead first (its shards moved: it must stop)."""
        task = self._tasks.spawn(coro, name="train")
        evicted = self._tasks.spawn(self.owners.evicted_event.wait(), name="evicted")
        try:
            await asyncio.wait({task, evicted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            evicted.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise RavnestError(f"worker {self.index} left the job: {self.owners.evicted}")
        task.result()

    async def _start_barrier(self) -> None:
        """Wait (at most `step_timeout_s`) until every worker serves the job; the silent ones are dead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.job.sync_backup.step_timeout_s
        missing = [w for w in self.workers if w != self.rpc.peer_id]
        while missing and loop.time() < deadline:
            pongs = await asyncio.gather(*(self.owners.ping(w) for w in missing))
            missing = [w for w, pong in zip(missing, pongs, strict=True) if pong is None or not pong.in_job]
            if missing:
                await asyncio.sleep(0.3)  # polling the other workers, bounded by the deadline
        if missing:
            logger.warning("job %s: workers %s never served the job: dead", self.job.job_id, missing)
            self.owners.dead.update(missing)
        if len(self.layout.live(self.owners.dead)) < self.owners.num_required:
            raise RavnestError(
                f"only {len(self.layout.live(self.owners.dead))} workers serve the job, "
                f"{self.owners.num_required} are required per step"
            )

    async def _train(self) -> None:
        self._started = time.monotonic()
        try:
            await self._steps()
        finally:
            self.train_s = time.monotonic() - self._started

    async def _steps(self) -> None:
        while self.step < self.final_version and not self.stop_requested.is_set():
            began = time.monotonic()
            step = self.step
            data_step = self.iterations if self.is_async else step
            loss, grads = await run_in_compute_thread(self._gradient, data_step)
            self.iterations += 1
            self.gradient_times_s.append(time.monotonic() - began)
            self.compute_s += self.gradient_times_s[-1]
            self.loss = loss
            replies = await self._exchange(list(range(len(self.layout.shards))), step, grads)
            self.late += sum(1 for reply in replies if reply.kind == ReplyKind.LATE)
            while len(set(self.versions)) > 1:  # a late worker's shards came back at different steps
                newest = max(self.versions)
                lagging = [shard for shard, version in enumerate(self.versions) if version < newest]
                await self._exchange(lagging, newest, None)
            self.step = self.versions[0]
            self.step_times_s.append(time.monotonic() - began)

    def _copy(self, shard: int) -> tuple[int, dict[str, Tensor]]:
        return self.versions[shard], {name: self.pieces[name].clone() for name in self.layout.shards[shard]}

    async def _linger(self) -> None:
        """Serve our final shards until every live worker has them (bounded by `_LINGER_S`).

        A worker killed mid-run that owned nothing was never declared dead (nobody had to reach it):
        every few seconds the workers still missing a final shard are pinged, and the silent ones join
        the dead set, so the job ends without waiting the whole linger for them.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _LINGER_S
        while not self.stop_requested.is_set() and not self.owners.all_final_sent():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.owners.all_final.wait(), min(_LINGER_CHECK_S, remaining))
            missing = self.owners.missing_final()
            if missing:
                await asyncio.gather(*(self.owners.confirm_dead(p) for p in missing))

    # ----- compute (the compute thread) -------------------------------------------------------------
    def _gradient(self, step: int) -> tuple[float, dict[str, Tensor]]:
        return step_push(
            self.model,
            self.params,
            self.pieces,
            batches=self.batches,
            loss_fn=self.loss_fn,
            worker=self.index,
            step=step,
            local_steps=self.local_steps,
            num_data_steps=self.num_data_steps,
            optimizer=self.job.optimizer,
        )

    # ----- reporting (`training.sync_report`) -------------------------------------------------------
    def _evaluate(self) -> tuple[float, float]:
        return evaluate(self.model, self.held_out, self.loss_fn, self.job.eval_batch_size)

    def metrics(self) -> StageMetrics:
        wall_s = time.monotonic() - self._started
        return StageMetrics(
            mode="sync_backup",
            epoch=self.role.epoch,
            job_id=self.job.job_id,
            peer_id=self.rpc.peer_id,
            cluster=self.index,
            stage=0,
            num_stages=1,
            step=self.step,
            optimizer_steps=self.step,
            loss=self.loss if self.loss is not None and self.loss < 1e9 else None,
            samples_per_s=min(1e12, len(self.step_times_s) * self.job.batch_size / max(wall_s, 1e-9)),
            compute_s=min(self.compute_s, 1e9),
            train_wall_s=min(wall_s, 1e9),
            eval_loss=self.eval_loss,
            eval_accuracy=self.eval_accuracy,
            done=self._done,
            failed=self._failure[:500] if self._failure else None,
            updated_at=dht_time(),
        )

    async def publish_metrics(self, *, final: bool = False) -> None:
        metrics = self.metrics()
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        if self.dht is None:
            return
        if final:
            record = JobProgress(
                job_id=self.job.job_id,
                peer_id=self.rpc.peer_id,
                epoch=self.role.epoch,
                cluster=self.index,
                num_clusters=len(self.workers),
                micro_batches=self.step,
                optimizer_steps=self.step,
                samples=self.step * self.job.batch_size,
                seed=self.job.seed,
                train_wall_s=metrics.train_wall_s,
                done=self._done,
                ended=self._done,
                reason="done" if self._done else self._failure,
            )
            await publish_progress(self.dht, record, final=True)
        await store_metrics(self.dht, metrics, final=final, retry_for_s=_FINAL_METRICS_S)

    async def _metrics_loop(self) -> None:
        while True:
            await self.publish_metrics()
            await asyncio.sleep(self.metrics_period_s)
