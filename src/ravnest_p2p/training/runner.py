"""Runs this peer's part of a job: finds its stage, builds it, trains (first stage drives), publishes metrics.

The job comes from the run's `job` key (published by a researcher); the placement comes from the job's
explicit `assignment` or, once the self-organising planner is active, from its plan. A peer named in
no cluster just waits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

from ravnest_p2p.discovery import OWNERS_KEY, RunDHT, authorized_signers, dht_time
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.runtime.service import PipelineConfig, StageService, default_window
from ravnest_p2p.training.data import ArrayDataset
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.replicas import ReplicaAverager, shard_map_for, tensor_digests
from ravnest_p2p.training.stage_hook import attach_stage_state
from ravnest_p2p.training.stages import build_stage, load_dataset, steps_per_cluster, train_batches
from ravnest_p2p.transport.rpc import RpcEndpoint
from ravnest_p2p.utils import TaskOwner

__all__ = ["JOB_KEY", "Placement", "StageRunner", "find_placement", "pick_job", "read_job"]

logger = logging.getLogger(__name__)

JOB_KEY = "job"
_FINAL_METRICS_S = 30.0


@dataclass(frozen=True)
class Placement:
    epoch: int
    cluster_index: int
    num_clusters: int
    stage_index: int
    stages: tuple[StagePlacement, ...]

    @property
    def peers(self) -> list[str]:
        return [s.peer_id for s in self.stages]


def find_placement(job: JobSpec, peer_id: str, *, epoch: int = 0) -> Placement | None:
    """Where `peer_id` sits in the job's explicit assignment, if anywhere."""
    clusters = job.assignment or ()
    for cluster_index, stages in enumerate(clusters):
        for stage_index, stage in enumerate(stages):
            if stage.peer_id == peer_id:
                return Placement(epoch, cluster_index, len(clusters), stage_index, stages)
    return None


def pick_job(
    found: dict[str, tuple[object, float]],
    *,
    run_owner: str | None = None,
    owners: dict[str, tuple[object, float]] | None = None,
) -> JobSpec | None:
    """The run's job among signed `job` values ({signer: (value, expiry)}); None if none is valid.

    Open run (`run_owner` None): any signer's job; the one that expires last wins. Owned run: only jobs
    signed by the owner or by a key its ``owners`` record lists; a delegate's job counts only while that
    record lives, and its expiry is capped at the record's (the owner's say-so bounds it). The job with
    the latest (capped) expiry wins; on a tie the owner's. The ``job`` key's maximum TTL (one day, see
    `discovery.keys`) caps every expiry, the owner's too.
    """
    allowed = authorized_signers(run_owner, owners or {}) if run_owner is not None else None
    newest: tuple[float, bool, JobSpec] | None = None
    for signer, (value, expiration) in found.items():
        if allowed is not None:
            if signer not in allowed or allowed[signer] < dht_time():
                logger.debug("ignoring a job from %s: not an owner of this run", signer)
                continue
            expiration = min(expiration, allowed[signer])
        try:
            job = JobSpec.model_validate(value)
        except Exception as exc:
            logger.debug("ignoring malformed job from %s: %s", signer, exc)
            continue
        rank = (expiration, signer == run_owner)
        if newest is None or rank > newest[:2]:
            newest = (expiration, signer == run_owner, job)
    return newest[2] if newest else None


async def read_job(dht: RunDHT, *, run_owner: str | None = None) -> JobSpec | None:
    """The run's current job (see `pick_job`); `run_owner` defaults to the DHT's."""
    run_owner = run_owner if run_owner is not None else dht.run_owner
    found = await dht.get_signed(JOB_KEY)
    owners = await dht.get_signed(OWNERS_KEY) if run_owner is not None and found else {}
    return pick_job(found, run_owner=run_owner, owners=owners)


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class StageRunner:
    """Trains one stage of one job to completion and publishes `StageMetrics` while it does."""

    def __init__(
        self,
        rpc: RpcEndpoint,
        dht: RunDHT | None,
        job: JobSpec,
        placement: Placement,
        *,
        metrics_period_s: float = 2.0,
        on_metrics: Callable[[StageMetrics], None] | None = None,
    ) -> None:
        self.rpc = rpc
        self.dht = dht
        self.job = job
        self.placement = placement
        self.metrics_period_s = metrics_period_s
        self.on_metrics = on_metrics
        self.eval_loss: float | None = None
        self.eval_accuracy: float | None = None
        self.service: StageService | None = None
        self.replicas: ReplicaAverager | None = None
        self._done = False
        self._failure: str | None = None
        self._datasets: tuple[ArrayDataset, ArrayDataset] | None = None
        self._tasks = TaskOwner("stage-runner")

    def _data(self) -> tuple[ArrayDataset, ArrayDataset]:
        """The job's (train, held-out) data, loaded once (the replica setup and the driver both need it)."""
        if self._datasets is None:
            self._datasets = load_dataset(self.job)
        return self._datasets

    def metrics(self) -> StageMetrics:
        service = self.service
        assert service is not None
        stats, depths = service.stats, service.queue_depths()
        step = stats.completed if service.is_first else max(stats.forwards, stats.backwards)
        rounds = self.replicas.rounds if self.replicas else []
        return StageMetrics(
            epoch=self.placement.epoch,
            job_id=self.job.job_id,
            peer_id=self.rpc.peer_id,
            cluster=self.placement.cluster_index,
            stage=self.placement.stage_index,
            num_stages=len(self.placement.stages),
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
                    logger.warning("final metrics of stage %d not stored", self.placement.stage_index)
                return
            await asyncio.sleep(delay_s)  # retry backoff
            delay_s = min(2 * delay_s, 5.0)

    async def _metrics_loop(self) -> None:
        while True:
            await self.publish_metrics()
            await asyncio.sleep(self.metrics_period_s)

    async def run(self) -> StageMetrics:
        """Train this stage until the job is done (or fails); return the final metrics."""
        job, placement = self.job, self.placement
        stage = placement.stages[placement.stage_index]
        window = job.max_in_flight or default_window(len(placement.stages))
        adaptive = job.adaptive_window and job.schedule == "async_1f1b"
        executor = build_stage(job, stage.first_layer, stage.end_layer, max_in_flight=window)
        self.service = service = StageService(
            self.rpc,
            executor,
            epoch=placement.epoch,
            cluster_peers=placement.peers,
            stage_index=placement.stage_index,
            config=PipelineConfig(
                max_in_flight=window, adaptive_window=adaptive, compression=job.compression
            ),
        )
        smap = shard_map_for(job, epoch=placement.epoch)
        if smap is not None:
            train_len = len(self._data()[0])
            final_step = steps_per_cluster(job, train_len, placement.num_clusters) // job.update_every
            self.replicas = ReplicaAverager(
                self.rpc,
                executor,
                smap,
                period_steps=job.averaging_period_steps,
                period_s=job.averaging_period_s,
                final_step=final_step,
            )
            await self.replicas.start()
            service.on_step = self.replicas.on_step
        self.state_hook = await attach_stage_state(self, service)  # serves its state; checkpoints
        await service.start()
        self._tasks.spawn(self._metrics_loop(), name="metrics")
        started = time.monotonic()
        cancelled = False
        try:
            if service.is_first:
                await self._drive(service)
            else:
                await service.finished.wait()
            if service.failure is not None:
                raise RavnestError(f"stage failed: {service.failure}")
            self._done = True
        except asyncio.CancelledError:
            cancelled = True  # e.g. restarted on a new plan: neither done nor failed
            raise
        except Exception as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await self._tasks.aclose()
            if not cancelled:
                await self.publish_metrics(final=True)
            await service.aclose()
            if self.replicas is not None:
                await self.replicas.aclose()
        logger.info(
            "stage %d of cluster %d done in %.1fs",
            placement.stage_index,
            placement.cluster_index,
            time.monotonic() - started,
        )
        return self.metrics()

    async def _drive(self, service: StageService) -> None:
        job, placement = self.job, self.placement
        await service.wait_ready(timeout_s=120)
        train, held_out = self._data()
        batches = train_batches(
            job, train, cluster_index=placement.cluster_index, num_clusters=placement.num_clusters
        )
        eval_batches = [
            (held_out.inputs[i : i + job.eval_batch_size], held_out.labels[i : i + job.eval_batch_size])
            for i in range(0, len(held_out), job.eval_batch_size)
        ]
        chunk = job.eval_every_steps or None
        while True:
            part = list(itertools.islice(batches, chunk)) if chunk else list(batches)
            if part and job.schedule == "gpipe":
                # fill-drain: admit a window of micro-batches, wait until all are back, repeat
                for start in range(0, len(part), service.window_size):
                    await service.train(part[start : start + service.window_size])
            elif part:
                await service.train(part)
            if not chunk or not part or len(part) < chunk:
                break
            self.eval_loss, self.eval_accuracy = await service.evaluate(eval_batches)
            await self.publish_metrics()
        self.eval_loss, self.eval_accuracy = await service.evaluate(eval_batches)
        logger.info("held-out loss %.4f accuracy %.4f", self.eval_loss, self.eval_accuracy)
        await service.finish()
