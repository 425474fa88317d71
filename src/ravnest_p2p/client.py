"""The researcher's handle on a run: list peers, publish a job, watch its metrics, wait for the result.

Used by notebooks (top-level ``await``) and `make demo`. It joins the DHT as a client: it serves
nothing and is never planned as a stage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Generator, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ravnest_p2p.client_watch import Display, JobHistory, ProgressSnapshot, make_renderer, summarize
from ravnest_p2p.discovery import OWNERS_KEY, OwnersRecord, PeerDirectory, PeerRecord, RunDHT, dht_time
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.membership import DhtPlanBoard
from ravnest_p2p.training.checkpoint import load_checkpoint
from ravnest_p2p.training.datasets import check_job
from ravnest_p2p.training.handover import HandoverServer, StaticSource
from ravnest_p2p.training.job import InitCheckpoint, JobSpec
from ravnest_p2p.training.jobs import JOB_KEY, read_job, read_job_signed
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics, member_metrics, plan_members
from ravnest_p2p.training.mode_placement import place_mode_job
from ravnest_p2p.training.model_checkpoint import assemble_checkpoint
from ravnest_p2p.training.modes import TrainingMode
from ravnest_p2p.training.placement import plan_assignment
from ravnest_p2p.training.progress import JobProgress, ProgressView, publish_progress, read_progress
from ravnest_p2p.training.run_keys import run_keys
from ravnest_p2p.training.stage_state import entries_digest
from ravnest_p2p.transport import RpcEndpoint
from ravnest_p2p.utils import run_in_compute_thread

__all__ = ["RunClient", "current_plan_done", "newest_epoch"]

logger = logging.getLogger(__name__)

_POLL_TIMEOUT_S = 30.0  # one read of the job's metrics (a few DHT gets), at most


def newest_epoch(metrics: Sequence[StageMetrics]) -> list[StageMetrics]:
    """The metrics of the newest plan epoch among `metrics` (of one job).

    A job restarted on a new plan leaves its old epoch's metrics behind: a dead peer's never say done,
    a survivor's may say failed. Only the epoch the job runs on now tells whether it finished.
    """
    if not metrics:
        return []
    epoch = max(m.epoch for m in metrics)
    return [m for m in metrics if m.epoch == epoch]


def _job_done(metrics: Sequence[StageMetrics], num_clusters: int | None) -> bool:
    """Whether every first stage of the job reports done; raises if a stage reports a failure."""
    failed = next((m for m in metrics if m.failed), None)
    if failed is not None:
        raise RavnestError(f"stage {failed.stage} of cluster {failed.cluster} failed: {failed.failed}")
    firsts = [m for m in metrics if m.stage == 0 and m.done]
    # on an agreed plan the client does not know the cluster count: every cluster that reports must be
    # done (and at least one)
    expected = num_clusters or len({m.cluster for m in metrics})
    return bool(firsts) and len(firsts) >= expected


def current_plan_done(metrics: Sequence[StageMetrics], records: Sequence[PeerRecord]) -> bool:
    """Whether every first stage of the swarm's CURRENT plan reports the job done (agreed-plan jobs).

    The current plan is the newest epoch the live peers' records name; its first stages are the live
    peers at stage 0 of it. A dead peer has no live record, so it is never waited on; metrics of older
    epochs do not count. False while no live peer names a first stage.
    """
    placed = [r for r in records if r.stage is not None and r.cluster is not None]
    if not placed:
        return False
    epoch = max(r.epoch for r in placed)
    firsts = {r.peer_id for r in _first_stages(placed, epoch)}
    done = {m.peer_id for m in metrics if m.epoch == epoch and m.stage == 0 and m.done}
    return bool(firsts) and firsts <= done


def live_clusters_done(progress: ProgressView, records: Sequence[PeerRecord]) -> bool:
    """Whether every cluster of the job's newest plan epoch that still has a live first stage has ended
    (reported the job done; agreed-plan jobs, once some cluster has).

    One cluster finishing does not end the others: each trains to its own end. A cluster whose first
    stage is gone (no live record names it) is not waited on; nor is a plan the swarm agreed after the
    job ended (its peers never start it: their records name a newer epoch).
    """
    live = {r.cluster for r in _first_stages(records, progress.epoch)}
    return live <= {cluster for epoch, cluster in progress.ended_clusters if epoch == progress.epoch}


def _first_stages(records: Sequence[PeerRecord], epoch: int) -> list[PeerRecord]:
    """The live records of plan ``epoch``'s first stages (one per cluster)."""
    return [r for r in records if r.epoch == epoch and r.stage == 0 and r.cluster is not None]


class RunClient:
    """Connect with `await RunClient.connect(initial_peers, run_id)`; close with `await client.aclose()`."""

    def __init__(self, dht: RunDHT) -> None:
        self.dht = dht
        self._directory = PeerDirectory(dht, dht.transport, dial_new_peers=True)
        self._closed = False
        self._placed: dict[str, JobSpec] = {}  # job id -> the job as published with its mode layout

    @classmethod
    def connect(
        cls,
        initial_peers: Sequence[str],
        run_id: str = "default",
        *,
        identity_path: str | Path | None = None,
        run_owner: str | None = None,
    ) -> _Connecting:
        """Join the run as a DHT client: ``client = await RunClient.connect(...)``, or
        ``async with RunClient.connect(...) as client:``, which closes it however the block ends.

        Args:
            identity_path: the researcher's key file (created if missing): the same file makes the same
                `peer_id`, i.e. the same run owner, across sessions. None: a fresh identity.
            run_owner: the run's owner, if it is not this client (only its ``owners`` record is kept).
        """
        return _Connecting(
            cls._connect(initial_peers, run_id, identity_path=identity_path, run_owner=run_owner)
        )

    @classmethod
    async def _connect(
        cls,
        initial_peers: Sequence[str],
        run_id: str,
        *,
        identity_path: str | Path | None,
        run_owner: str | None,
    ) -> RunClient:
        dht = await RunDHT.join_as_client(
            initial_peers, run_id=run_id, identity_path=identity_path, keys=run_keys(), run_owner=run_owner
        )
        client = cls(dht)
        try:
            await client.peers()  # dials the peers our initial peers know of: the whole DHT becomes reachable
        except BaseException:
            await client.aclose()
            raise
        return client

    async def peers(self) -> list[PeerRecord]:
        """Live, valid peer records of the run, sorted by peer id."""
        return sorted((await self._directory.refresh()).values(), key=lambda r: r.peer_id)

    async def wait_for_peers(
        self, count: int, *, timeout_s: float = 120.0, measured: bool = True
    ) -> list[PeerRecord]:
        """Wait until `count` ready peers (with measured compute and links, if asked) are visible."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            records = [r for r in await self.peers() if r.state == "ready"]
            if measured:
                records = [r for r in records if r.flops > 0 and r.upload_mbps > 0 and r.download_mbps > 0]
            if len(records) >= count:
                return records
            if loop.time() > deadline:
                raise TimeoutError(f"only {len(records)} of {count} peers ready after {timeout_s:.0f}s")
            await asyncio.sleep(1.0)

    def plan(
        self,
        records: Sequence[PeerRecord],
        job: JobSpec,
        *,
        min_stages: int | None = None,
        use_links: bool = True,
    ) -> JobSpec:
        """The job with an explicit assignment computed by the planner over `records`, with the link
        matrix their records report (`use_links=False`: each peer's own up/down figures only).

        ``sync_backup`` and ``ist`` jobs get their workers from `training.mode_placement` instead (one
        peer per worker, fastest first; `min_stages` and `use_links` do not apply).

        Raises:
            planning.InfeasiblePlan: the job cannot be laid out on these peers (for the two modes,
                `planning.mode_layout.WorkerDoesNotFit` when no peer holds one worker).
        """
        if job.mode != TrainingMode.PIPELINE:
            return place_mode_job(records, job)
        assignment = plan_assignment(records, job, min_stages=min_stages, use_links=use_links)
        return job.model_copy(update={"assignment": assignment})

    @property
    def peer_id(self) -> str:
        """This client's peer id: the owner id to give peers (``--run-owner``) for runs it owns, and the
        id to list in `JobSpec.state_readers` to fetch checkpoints."""
        peer_id = self.dht.peer_id
        assert peer_id is not None  # a client always has its own transport
        return peer_id

    async def publish_job(self, job: JobSpec, *, ttl_s: float = 3600.0) -> JobSpec:
        """Publish `job`. With an assignment it runs there; without, on the peers' agreed plan; a
        ``sync_backup`` or ``ist`` job without one first gets its layout over the live peers (`plan`).
        Returns the job as published (`wait_for_job` finds the layout given either form).

        Peers of an owned run train it only if this client is the owner or a key the owner lists. The
        job's model and data set must be known here too (a plugin: install it on this machine as well);
        pin a local data set's digest first (`training.datasets.pin_digest`) so peers refuse other data.

        Raises:
            ValueError: unknown model or data set, or a config that does not validate.
            planning.InfeasiblePlan: a mode job that the live peers cannot hold (see `plan`).
        `ttl_s` may not exceed the ``job`` key's maximum (one day): republish to run longer.
        """
        check_job(job)  # its model and data set exist (built-in or installed plugin), configs validate
        max_ttl_s = self.dht.max_ttl_s(JOB_KEY)
        if max_ttl_s is not None and ttl_s > max_ttl_s:
            raise ValueError(f"a job's ttl_s is at most {max_ttl_s:.0f} s (got {ttl_s:.0f})")
        if job.mode != TrainingMode.PIPELINE and job.assignment is None:
            records = await self.peers()
            job = await run_in_compute_thread(place_mode_job, records, job)  # builds and profiles the model
            self._placed[job.job_id] = job
            logger.info(
                "job %s: %s workers %s",
                job.job_id,
                job.mode.value,
                [cluster[0].peer_id for cluster in job.assignment or ()],
            )
        # pinned at the initial peers too: the job must outlive a restart of every peer that held it
        if not await self.dht.store_own(JOB_KEY, job.to_wire(), ttl_s=ttl_s, pin_to_initial_peers=True):
            raise RavnestError("no DHT peer accepted the job")
        return job

    async def publish_owners(self, keys: Sequence[str], *, ttl_s: float = 86400.0) -> None:
        """As the run's owner, let the peer ids `keys` publish jobs too, for `ttl_s` (at most 7 days).

        A delegate's jobs count only while this record lives and never expire after it.
        """
        max_ttl_s = self.dht.max_ttl_s(OWNERS_KEY)
        if max_ttl_s is not None and ttl_s > max_ttl_s:
            raise ValueError(f"the owners record's ttl_s is at most {max_ttl_s:.0f} s (got {ttl_s:.0f})")
        record = OwnersRecord(owner=self.peer_id, keys=tuple(keys), updated_at=dht_time())
        if not await self.dht.store_own(
            OWNERS_KEY, record.model_dump(mode="json"), ttl_s=ttl_s, pin_to_initial_peers=True
        ):
            raise RavnestError("no DHT peer accepted the owners record")

    async def metrics(self, *, epoch: int | None = None, job_id: str | None = None) -> list[StageMetrics]:
        """The newest stage metrics of each (job, peer), optionally of one plan `epoch` and one job."""
        await self.peers()  # dials peers that joined since: the replicas they are become reachable
        latest: dict[tuple[str, str], StageMetrics] = {}  # (job, peer) -> newest metrics
        # final metrics are pinned at the initial peers: read them there too
        found = await self.dht.get_signed(METRICS_KEY, from_initial_peers=True)
        for signer, (value, _) in found.items():
            try:
                m = StageMetrics.model_validate(value)
            except Exception:
                continue
            if m.peer_id != signer or (job_id is not None and m.job_id != job_id):
                continue
            if epoch is not None and m.epoch != epoch:
                continue
            key = (m.job_id, m.peer_id)
            if key not in latest or m.updated_at > latest[key].updated_at:
                latest[key] = m
        return sorted(latest.values(), key=lambda m: (m.cluster, m.stage))

    async def member_metrics(self, job: JobSpec, metrics: Sequence[StageMetrics]) -> list[StageMetrics]:
        """`metrics` of `job` from the peers that hold the positions they report (see
        `training.metrics.member_metrics`): the job's assignment, or the plan in peers' signed records."""
        if job.assignment is not None:
            return member_metrics(metrics, assignment=job.assignment)
        records = {r.peer_id: r for r in await self.peers()}
        plans = await DhtPlanBoard(self.dht).read_all()
        return member_metrics(metrics, members=plan_members(records, plans))

    async def progress(self, job_id: str) -> ProgressView | None:
        """The job's merged progress record (`training.progress`): data position, steps, done/ended."""
        found = await read_job_signed(self.dht)
        owner = found[0] if found is not None and found[1].job_id == job_id else None
        return await read_progress(self.dht, job_id, owner_peer_id=owner)

    async def stop_job(self, job_id: str, *, ttl_s: float = 3600.0) -> None:
        """Ask the peers to stop `job_id`: each cluster finishes (evaluates, reports done) soon after.

        Only a stop signed by the key that published the job counts, i.e. this client's connection
        (a new `RunClient` has a new key).
        """
        assert self.dht.transport is not None
        record = JobProgress(
            job_id=job_id,
            peer_id=self.dht.transport.peer_id,
            stopped=True,
            ended=True,
            reason="stopped by its owner",
            updated_at=dht_time(),
        )
        if not await publish_progress(self.dht, record, final=True):
            raise RavnestError("no DHT peer accepted the stop request")
        logger.info("asked the peers to stop job %s", job_id)

    async def _poll_job(self, job: JobSpec) -> tuple[list[StageMetrics], bool]:
        """(metrics to show, done) of one poll of `job` (raises `RavnestError` if the job failed)."""
        if job.mode != TrainingMode.PIPELINE and job.assignment is None:
            job = await self._as_published(job)
        if job.assignment is not None:
            # an explicit assignment: a fixed set of clusters on epoch 0
            current = newest_epoch(await self.member_metrics(job, await self.metrics(job_id=job.job_id)))
            # sync_backup: the job is done once N workers are (a dead backup never reports); ist: once
            # one is (every live worker ends with the same final gather; a dead one never reports)
            expected = len(job.assignment)
            if job.mode == "sync_backup":
                expected = job.sync_backup.num_required
            elif job.mode == "ist":
                expected = 1
            return current, _job_done(current, expected)
        progress = await self.progress(job.job_id)
        signed = await self.metrics(job_id=job.job_id)
        metrics = await self.member_metrics(job, signed)
        records = await self.peers()
        if progress is not None and progress.done and live_clusters_done(progress, records):
            # the swarm may have moved to a plan that no longer names the peers that finished the job:
            # their (signed) metrics are still what the job ended with
            return newest_epoch(metrics or signed), True
        if progress is not None and progress.ended and not progress.done and not progress.stopped:
            raise RavnestError(f"job {job.job_id} ended: {progress.reason}")
        # a stopped job is done once its clusters have finished (they publish done within seconds)
        return newest_epoch(metrics), current_plan_done(metrics, records)

    async def _as_published(self, job: JobSpec) -> JobSpec:
        """A mode job as published with its layout (`publish_job` filled it), or `job` if not found."""
        placed = self._placed.get(job.job_id)
        if placed is None:
            published = await read_job(self.dht)
            if published is not None and published.job_id == job.job_id and published.assignment is not None:
                placed = self._placed[job.job_id] = published
        return placed or job

    async def wait_for_job(
        self,
        job: JobSpec,
        *,
        timeout_s: float = 600.0,
        poll_s: float = 2.0,
        on_progress: Callable[[ProgressSnapshot], None] | None = None,
    ) -> ProgressSnapshot:
        """Poll until the job is done; return its newest metrics.

        `on_progress` gets each poll's metrics as a `ProgressSnapshot`: a list of `StageMetrics` whose
        printed form is a one-line summary (so ``on_progress=print`` prints one line per poll).

        Done: the job's progress record says done, or every first stage of the CURRENT plan reports
        done (a job without assignment follows the job across re-plans and never waits on a dead peer);
        with an explicit assignment, every first stage of it reports done. Only metrics of peers that are
        members of the job's assignment or plan count (`member_metrics`).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                # one poll may not hang the wait: a lab run's client idled for 420 s after every stage had
                # stored done (a fresh client read it at once); a poll past its share is abandoned
                async with asyncio.timeout(_POLL_TIMEOUT_S):
                    metrics, done = await self._poll_job(job)
            except TimeoutError:
                logger.warning("reading the metrics of job %s took too long; polling again", job.job_id)
                metrics, done = None, False
            snapshot = None if metrics is None else ProgressSnapshot(metrics, job.job_id)
            if snapshot is not None and on_progress is not None:
                on_progress(snapshot)
            if done and snapshot is not None:
                return snapshot
            if loop.time() > deadline:
                raise TimeoutError(f"job {job.job_id} not done after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)

    async def watch(
        self,
        job: JobSpec,
        *,
        display: Display = "auto",
        timeout_s: float = 600.0,
        poll_s: float = 2.0,
    ) -> JobHistory:
        """Wait for `job` like `wait_for_job`, rendering its progress as it goes; return its history.

        `display`: ``auto`` draws a live plot (loss and samples/s per cluster) in a Jupyter notebook
        when matplotlib is installed, and prints a compact line per change elsewhere; ``lines``,
        ``plot`` or ``none`` choose. The returned `JobHistory` holds every poll's summary (its `plot`
        draws them) and the job's final metrics.
        """
        history = JobHistory(job_id=job.job_id)
        renderer = make_renderer(display)

        def on_progress(snapshot: ProgressSnapshot) -> None:
            summary = summarize(snapshot, job.job_id)
            history.add(summary, metrics=snapshot)
            renderer.update(history, summary)

        history.final = await self.wait_for_job(
            job, timeout_s=timeout_s, poll_s=poll_s, on_progress=on_progress
        )
        renderer.close(history)
        return history

    async def checkpoint(
        self, path: str | Path, job: JobSpec | None = None, *, timeout_s: float = 300.0
    ) -> Path:
        """Assemble the job's full model state from its stage owners into `path` (safetensors + JSON).

        The job (default: the run's current one) must be done and list this client's `peer_id` in
        `state_readers`. Every tensor is checked against the digests the owners published, and the names,
        dtypes and shapes against the model; see `training.model_checkpoint`. Returns the manifest path.
        """
        job = job or await read_job(self.dht)
        if job is None:
            raise RavnestError("no job in the run")
        rpc = self._state_endpoint()
        metrics = await self.metrics(job_id=job.job_id)
        await assemble_checkpoint(rpc, job, metrics, Path(path), timeout_s=timeout_s)
        return Path(path).with_suffix(".json")

    def _state_endpoint(self) -> RpcEndpoint:
        rpc: RpcEndpoint | None = getattr(self, "_rpc_endpoint", None)
        if rpc is None:
            assert self.dht.transport is not None
            rpc = self._rpc_endpoint = RpcEndpoint(self.dht.transport, self.dht.run_id)
        return rpc

    async def serve_checkpoint(
        self, path: str | Path, *, mode: str = "weights", allowed: Iterable[str] | None = None
    ) -> InitCheckpoint:
        """Serve a verified model checkpoint to the run's peers; returns the `JobSpec.init_checkpoint`.

        Peers reach this client-mode peer over the connections it dialled (it dials every peer it lists).
        Serving lasts while the client is open; the whole checkpoint is held in memory meanwhile.

        Args:
            path: the checkpoint (``.safetensors`` or its ``.json`` manifest), e.g. from `checkpoint`.
            mode: ``weights`` (fine-tune: fresh optimizer and schedule) or ``resume``.
            allowed: peers that may fetch it (default: the run's peers listed now).
        """
        manifest, state = await run_in_compute_thread(load_checkpoint, Path(path))
        peers = allowed if allowed is not None else [r.peer_id for r in await self.peers()]
        digest = entries_digest(manifest.tensors.values())
        source_id = f"init-{digest[:16]}"
        server = HandoverServer.of(self._state_endpoint())
        await server.start()
        server.publish(source_id, StaticSource(state, version=digest), epoch=0, allowed=peers)
        return InitCheckpoint(
            peer_id=self.peer_id,
            source_id=source_id,
            state_digest=digest,
            mode="resume" if mode == "resume" else "weights",
        )

    async def aclose(self) -> None:
        """Leave the DHT (idempotent)."""
        if not self._closed:
            self._closed = True
            await self.dht.aclose()

    async def __aenter__(self) -> RunClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class _Connecting:
    """What `RunClient.connect` returns: await it for the client, or use it as ``async with``."""

    def __init__(self, connecting: Coroutine[Any, Any, RunClient]) -> None:
        self._connecting: Coroutine[Any, Any, RunClient] | None = connecting
        self._client: RunClient | None = None

    def _take(self) -> Coroutine[Any, Any, RunClient]:
        if self._connecting is None:
            raise RuntimeError("RunClient.connect(...) can be awaited or entered once")
        connecting, self._connecting = self._connecting, None
        return connecting

    def __await__(self) -> Generator[Any, None, RunClient]:
        return self._take().__await__()

    async def __aenter__(self) -> RunClient:
        self._client = await self._take()
        return self._client

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.aclose()

    def __del__(self) -> None:
        if self._connecting is not None:  # never awaited: close the coroutine without a warning
            self._connecting.close()
