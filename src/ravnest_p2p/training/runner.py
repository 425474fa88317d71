"""Runs this peer's part of a job for one plan: builds its stage from a `StageRole`, resumes the state it
is given, trains (the first stage drives the data from the job's position), publishes metrics and (first
stages) the job's progress.

The job comes from the run's `job` key (published by a researcher); the role (`training.role.role_for`)
from the job's explicit `assignment` or the swarm's agreed plan. The `training.supervisor.JobSupervisor`
owns the job's life across plans; a runner lives for one plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from torch import Tensor

from ravnest_p2p.discovery import RunDHT, dht_time
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.measurement.memory import memory_snapshot, release_free_memory
from ravnest_p2p.models import count_layers
from ravnest_p2p.planning.memory import stage_memory
from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.jobs import JOB_KEY, pick_job, pick_job_signed, read_job, read_job_signed
from ravnest_p2p.training.memory_fit import check_stage_fits, describe
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.placement import job_params, stage_profiles
from ravnest_p2p.training.progress import JobProgress, ProgressStore, publish_progress
from ravnest_p2p.training.replicas import ReplicaAverager, tensor_digests
from ravnest_p2p.training.resume import HeldState, apply_state, cluster_batches
from ravnest_p2p.training.role import StageRole, role_for
from ravnest_p2p.training.runner_moves import InPlaceMoves
from ravnest_p2p.training.stage_hook import StageStateHook, attach_stage_state
from ravnest_p2p.training.stage_state import StageState, capture_state
from ravnest_p2p.training.stages import build_stage, label_spec, load_dataset
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner, load_stretch
from ravnest_p2p.utils.aio import run_in_compute_thread

__all__ = [
    "JOB_KEY",
    "HeldState",
    "Placement",
    "StageRunner",
    "apply_state",
    "cluster_batches",
    "find_placement",
    "pick_job",
    "pick_job_signed",
    "read_job",
    "read_job_signed",
]

logger = logging.getLogger(__name__)

_FINAL_METRICS_S = 30.0
_HANDOVER_PROGRESS_S = 3.0
# a first stage's progress also goes to the initial peers this often (and at the end or a hand-over): the
# copy a full restart reads when every peer that held the record restarted (`publish_progress`)
_PIN_PROGRESS_S = 30.0
_START_TIMEOUT_S = 60.0  # from the stage's build to serving (stretched on a busy host)

Placement = StageRole  # the old name of a stage's place in a job


def find_placement(job: JobSpec, peer_id: str) -> StageRole | None:
    """Where `peer_id` sits in the job's explicit assignment, if anywhere (`role_for` on it)."""
    return role_for(job, None, peer_id)


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StageRunner(InPlaceMoves):
    """Trains one stage of one job on one plan and publishes `StageMetrics` (and progress) while it does.

    Args:
        rpc: the peer's RPC endpoint.
        dht: where metrics and progress go (None: nowhere, e.g. tests).
        job: the job.
        role: this peer's role (`role_for`); its data position and final step decide what is trained.
        initial_state: a held stage state to resume from (`apply_state`); None: the initial weights.
        metrics_period_s: how often metrics (and progress) are published.
        on_metrics: called with every metrics record (tests, the status line).
    """

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: RunDHT | ProgressStore | None,
        job: JobSpec,
        role: StageRole,
        *,
        initial_state: StageState | None = None,
        metrics_period_s: float = 2.0,
        on_metrics: Callable[[StageMetrics], None] | None = None,
        on_exclude: Callable[[str, str], None] | None = None,
    ) -> None:
        self.rpc = rpc
        # (peer id, reason) of a sender the stage's ledger excluded: the node reports it to membership
        self.on_exclude = on_exclude
        self.checkpoint_dir: Path | None = None  # where to keep checkpoints (set by the node), see stage_hook
        # memory this peer has for a stage (its cap minus its own overhead; set by the node): a role that
        # does not fit is refused before its layers are built (`training.memory_fit`)
        self.memory_available_bytes: int | None = None
        self.dht = dht
        self.job = job
        self.role = role
        self.initial_state = initial_state
        self.metrics_period_s = metrics_period_s
        self.on_metrics = on_metrics
        self.eval_loss: float | None = None
        self.eval_accuracy: float | None = None
        self.service: StageService | None = None
        self.replicas: ReplicaAverager | None = None
        self.restored = "none"
        self.stop_requested = asyncio.Event()  # the owner stopped the job: finish as done, soon
        self.stop_reason: str | None = None
        self.held_state: HeldState | None = None  # the stage's state when the run ended or was cancelled
        self._done = False
        self._failure: str | None = None
        self._progress_pinned_at = -1e18  # monotonic time of the last progress copy at the initial peers
        self._datasets: tuple[ArrayDataset, ArrayDataset] | None = None
        self._tasks = TaskOwner("stage-runner")
        self._started = time.monotonic()
        # where this run's counts start: they carry over when the run moves to a new plan in place
        self._data_base = role.data_start  # the cluster's data position when this run began
        self._wall_base = role.train_wall_s_start
        self._epoch_start = role.data_start  # the data position when the current epoch began here
        self._batches: Iterator[tuple[Tensor, Tensor]] = iter(())  # first stage: the data still to feed
        self._taken = 0  # micro-batches taken from the data so far
        self._exhausted: Iterator[tuple[Tensor, Tensor]] | None = None  # the data `_feed` last ran out of
        self._finishing = False  # first stage: the data ran out, the run is closing (no move in place now)
        self.state_hook: StageStateHook | None = None
        # first stage: how long the other stages may take to serve the plan (the supervisor shortens it
        # for a retry on the same plan: a neighbour that is not back by then is not coming)
        self.ready_timeout_s = 120.0

    @property
    def placement(self) -> StageRole:
        return self.role

    def _data(self) -> tuple[ArrayDataset, ArrayDataset]:
        """The job's (train, held-out) data, loaded once (the replica setup and the driver both need it)."""
        if self._datasets is None:
            self._datasets = load_dataset(self.job)
        return self._datasets

    def _fed(self) -> int:
        """Micro-batches of the job this cluster fed so far (first stage), over every plan."""
        service = self.service
        return self._data_base + (service.stats.completed if service is not None else 0)

    def _train_wall_s(self) -> float:
        return self._wall_base + (time.monotonic() - self._started)

    def metrics(self) -> StageMetrics:
        service = self.service
        assert service is not None
        stats, depths = service.stats, service.queue_depths()
        step = self._fed() if service.is_first else max(stats.forwards, stats.backwards)
        rounds = self.replicas.rounds if self.replicas else []
        return StageMetrics(
            epoch=self.role.epoch,
            job_id=self.job.job_id,
            peer_id=self.rpc.peer_id,
            cluster=self.role.cluster_index,
            stage=self.role.stage_index,
            num_stages=self.role.num_stages,
            step=step,
            optimizer_steps=service.executor.num_steps,
            loss=stats.last_loss,
            samples_per_s=stats.samples_per_s(),
            queue_forward=depths["forward"],
            queue_backward=depths["backward"],
            in_flight=len(service.executor.in_flight),
            window=service.window_size if service.is_first else 0,
            bytes_sent=stats.bytes_sent,
            compute_s=stats.compute_s,
            send_busy_s=stats.send_busy_s,
            averaging_rounds=len(self.replicas.rounds) if self.replicas else 0,
            averaging_bytes_sent=self.replicas.bytes_sent if self.replicas else 0,
            last_round_s=rounds[-1].time_s if rounds else None,
            last_round=rounds[-1].round if rounds else None,
            last_round_participants=self.replicas.last_round_participants if self.replicas else None,
            param_digests=self._param_digests() if self._done else None,
            train_wall_s=stats.train_wall_s,
            eval_loss=self.eval_loss,
            eval_accuracy=self.eval_accuracy,
            peak_memory_bytes=_peak_rss_bytes(),
            done=self._done,
            failed=(self._failure or (str(service.failure) if service.failure else None) or "")[:500] or None,
            updated_at=dht_time(),
        )

    def progress(self, *, ended: bool = False, reason: str | None = None) -> JobProgress:
        """This cluster's account of the job (first stage: data position; any stage: an end)."""
        service = self.service
        role = self.role
        fed = self._fed() if role.is_first else role.data_start
        return JobProgress(
            job_id=self.job.job_id,
            peer_id=self.rpc.peer_id,
            epoch=role.epoch,
            cluster=role.cluster_index,
            num_clusters=role.num_clusters,
            epoch_start=self._epoch_start,
            micro_batches=fed,
            optimizer_steps=service.executor.num_steps if service is not None else role.optimizer_steps_start,
            samples=fed * self.job.batch_size,
            seed=self.job.seed,
            train_wall_s=min(self._train_wall_s(), 1e9),
            done=self._done,
            stopped=False,
            ended=ended or self._done,
            reason=(reason or self.stop_reason or ("done" if self._done else None)),
            updated_at=dht_time(),
        )

    def _param_digests(self) -> dict[str, str]:
        executor = self.service.executor if self.service else None
        if executor is None:
            return {}
        return tensor_digests({**executor.parameters_by_name(), **executor.buffers_by_name()})

    async def publish_metrics(self, *, final: bool = False) -> None:
        """Store this stage's metrics under ``metrics`` (best effort while training).

        The `final` publication (done or failed) is what `RunClient.wait_for_job` waits for, and nothing
        republishes it: it also goes to the initial peers (which every client reaches) and is retried
        until some replica took it, for at most `_FINAL_METRICS_S`. A lab run lost it once: training
        and the closing round had finished, the client saw the stale not-done record for 420 s.
        """
        metrics = self.metrics()
        if self.on_metrics is not None:
            self.on_metrics(metrics)
        if self.dht is None:
            return
        if self.role.is_first:
            pin = final or time.monotonic() - self._progress_pinned_at >= _PIN_PROGRESS_S
            if await publish_progress(self.dht, self.progress(), final=final, pin=pin) and pin:
                self._progress_pinned_at = time.monotonic()
        deadline = time.monotonic() + (_FINAL_METRICS_S if final else 0.0)
        delay_s = 0.2
        while True:
            try:
                stored = await self.dht.store_own(
                    METRICS_KEY,
                    metrics.model_dump(mode="json"),
                    ttl_s=600,
                    pin_to_initial_peers=final,
                )
            except Exception as exc:
                stored = False
                logger.debug("metrics publication failed: %r", exc)
            if stored or time.monotonic() + delay_s > deadline:
                if final and not stored:
                    logger.warning("final metrics of stage %d not stored", self.role.stage_index)
                return
            await asyncio.sleep(delay_s)  # retry backoff
            delay_s = min(2 * delay_s, 5.0)

    async def _metrics_loop(self) -> None:
        last_hwm = 0
        while True:
            snap = memory_snapshot()
            if snap.hwm + snap.children_hwm > last_hwm + 4 * 2**20:
                last_hwm = snap.hwm + snap.children_hwm
                steps = self.service.executor.num_steps if self.service else -1
                logger.debug("memory at step %d: %s", steps, snap.describe())
            await self.publish_metrics()
            await asyncio.sleep(self.metrics_period_s)

    def _capture(self) -> None:
        service = self.service
        if service is None:
            return
        state = capture_state(service.executor, copy=False)
        self.held_state = HeldState(self.role.first_layer, self.role.end_layer, state)

    async def _hold_state(self) -> None:
        """Keep the stage's state for the next plan, whether the run finished, failed or was cancelled.

        It takes the live tensors over instead of copying them (`planning.memory` budgets no second
        copy: a clone of parameters and Adam state OOM-killed 7 of 8 capped stages of bench_big_model).
        That is safe only once nothing can change them: this runs after the service stopped serving
        (no late forward or backward message), the averager closed (no late round), and on the compute
        thread, behind any compute submitted before a cancellation (it still runs there).
        """
        logger.debug("memory at the end of training: %s", memory_snapshot().describe())
        # cancelled again while this waits, the capture still runs on the compute thread and sets it
        await run_in_compute_thread(self._capture)
        logger.debug("memory after capture: %s", memory_snapshot().describe())

    async def _check_memory(self) -> None:
        """Raise `StageDoesNotFit` if this role's stage, for its window, exceeds this peer's memory."""
        job, role = self.job, self.role
        assert self.memory_available_bytes is not None
        profiles = await run_in_compute_thread(stage_profiles, job, role.first_layer, role.end_layer)
        logger.debug("memory after the stage check: %s", memory_snapshot().describe())
        release_free_memory()
        params = job_params(job, num_layers=count_layers(job.model, job.model_params))
        params = params.model_copy(update={"max_in_flight": role.window})
        need = check_stage_fits(
            profiles,
            params,
            available_bytes=self.memory_available_bytes,
            what=f"stage {role.stage_index} (layers [{role.first_layer}, {role.end_layer}))",
        )
        raw = stage_memory(profiles, params)
        logger.info(
            "stage %d (layers [%d, %d)) needs %.3f GiB (%s GiB; %.3f GiB with headroom) of the %.3f GiB "
            "this peer has",
            role.stage_index,
            role.first_layer,
            role.end_layer,
            raw.total_bytes / 2**30,
            describe(raw),
            need / 2**30,
            self.memory_available_bytes / 2**30,
        )

    async def run(self) -> StageMetrics:
        """Train this stage until the job is done (or fails, or is stopped); return the final metrics."""
        job, role = self.job, self.role
        adaptive = job.adaptive_window and job.schedule == "async_1f1b"
        if self.memory_available_bytes is not None:
            await self._check_memory()
        logger.debug("memory before build: %s", memory_snapshot().describe())
        executor = build_stage(job, role.first_layer, role.end_layer, max_in_flight=role.window)
        logger.info("memory after build: %s", memory_snapshot().describe())
        if self.initial_state is not None:
            self.restored = apply_state(executor, self.initial_state)
        self.service = service = StageService(
            self.rpc,
            executor,
            epoch=role.epoch,
            cluster_peers=role.peers,
            stage_index=role.stage_index,
            config=PipelineConfig(
                max_in_flight=role.window, adaptive_window=adaptive, compression=job.compression
            ),
            label_spec=label_spec(job),  # a middle stage refuses out-of-range labels it would relay
        )
        service.on_exclude = self.on_exclude
        if role.shard_map is not None:
            self.replicas = await self._start_replicas(role.shard_map, self._final_optimizer_step(role))
        service.on_step = self._replica_step
        try:
            # registering handlers with the p2p daemon has no deadline of its own: two ring-fault runs
            # under load sat silent here for minutes after a re-plan, so bound it and say where
            async with asyncio.timeout(_START_TIMEOUT_S * load_stretch()):
                self.state_hook = await attach_stage_state(self, service)  # serves its state; checkpoints
                await service.start()
        except TimeoutError:
            raise RavnestError(
                f"stage {role.stage_index} did not start serving within {_START_TIMEOUT_S:.0f}s "
                "(handler registration with the p2p daemon)"
            ) from None
        logger.info("stage %d serves epoch %d", role.stage_index, role.epoch)
        self._started = time.monotonic()
        self._tasks.spawn(self._metrics_loop(), name="metrics")
        cancelled = False
        try:
            if service.is_first:
                await self._drive(service)
            else:
                await service.finished.wait()
            if service.failure is not None:
                raise RavnestError(f"stage failed: {service.failure}") from service.failure
            self._done = True
        except asyncio.CancelledError:
            cancelled = True  # e.g. restarted on a new plan: neither done nor failed
            raise
        except Exception as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            try:
                await self._tasks.aclose()
                if not cancelled:
                    await self.publish_metrics(final=True)
                elif role.is_first and self.dht is not None:
                    # handed over: the next plan resumes the data where this run stopped feeding it
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(_HANDOVER_PROGRESS_S):
                            await publish_progress(self.dht, self.progress(), pin=True)
                await service.aclose()
                if self.replicas is not None:
                    await self.replicas.aclose()
            finally:
                await self._hold_state()
        logger.info(
            "stage %d of cluster %d done in %.1fs",
            role.stage_index,
            role.cluster_index,
            time.monotonic() - self._started,
        )
        return self.metrics()

    def _should_stop(self) -> bool:
        max_wall_s = self.job.max_wall_s
        if max_wall_s is not None and self._train_wall_s() >= max_wall_s:
            self.stop_reason = self.stop_reason or f"wall time {max_wall_s:.0f}s reached"
            return True
        return self.stop_requested.is_set()

    def _until_stopped(self, batches: Iterator[tuple[Tensor, Tensor]]) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in batches:
            if self._should_stop():
                return
            yield batch

    async def _drive(self, service: StageService) -> None:
        job = self.job
        await service.wait_ready(timeout_s=self.ready_timeout_s)
        logger.info("stage 0: the cluster's %d stages serve epoch %d", self.role.num_stages, self.role.epoch)
        role = self.role  # a move to a new plan in place may have come meanwhile
        train, held_out = self._data()
        self._batches = cluster_batches(
            job,
            train,
            cluster_index=role.cluster_index,
            num_clusters=role.num_clusters,
            start=self._data_base,
            stop=role.final_step,
        )
        eval_batches = [
            (held_out.inputs[i : i + job.eval_batch_size], held_out.labels[i : i + job.eval_batch_size])
            for i in range(0, len(held_out), job.eval_batch_size)
        ]
        if self.restored != "none" and job.eval_every_steps:
            # where the job resumes on this plan (e.g. to compare with where it was before a re-plan)
            self.eval_loss, self.eval_accuracy = await service.evaluate(eval_batches)
            logger.info(
                "resumed at micro-batch %d: held-out loss %.4f accuracy %.4f",
                role.data_start,
                self.eval_loss,
                self.eval_accuracy,
            )
            await self.publish_metrics()
        while True:
            await self._train_all(service, eval_batches)
            # a move in place to a plan with more data for this cluster may have come as the data ran out
            if self._batches is self._exhausted or self._should_stop():
                break
        self._finishing = True
        self.eval_loss, self.eval_accuracy = await service.evaluate(eval_batches)
        logger.info("held-out loss %.4f accuracy %.4f", self.eval_loss, self.eval_accuracy)
        await service.finish()

    async def _train_all(self, service: StageService, eval_batches: list[tuple[Tensor, Tensor]]) -> None:
        """Feed the data until it runs out or the job stops, evaluating every `eval_every_steps`."""
        job = self.job
        gated = self._until_stopped(self._feed())  # lazy: the pipeline never flushes to look at a stop
        chunk = job.eval_every_steps or None
        while True:
            part = list(itertools.islice(gated, chunk)) if chunk else None
            source = iter(part) if part is not None else gated
            if job.schedule == "gpipe":
                # fill-drain: admit a window of micro-batches, wait until all are back, repeat
                while window := list(itertools.islice(source, service.window_size)):
                    await service.train(window)
            else:
                await service.train(source)
            if part is None or chunk is None or len(part) < chunk:
                break
            self.eval_loss, self.eval_accuracy = await service.evaluate(eval_batches)
            logger.info(
                "micro-batch %d: held-out loss %.4f accuracy %.4f",
                self._fed(),
                self.eval_loss,
                self.eval_accuracy,
            )
            await self.publish_metrics()
