"""A job's progress, which outlives plan epochs: the `progress` DHT key and how it is read.

Problem: a job used to live inside one plan epoch. When the plan moved (a peer joined or was lost) every
stage started over from the initial weights and the first data batch, a restarted peer picked a dead job
back up, and a client waited on metrics of an epoch nobody ran any more. Progress now belongs to the job:
the first stage of each cluster (the one that feeds data) publishes a `JobProgress` under the run's fixed
`progress` key, in its own signed subkey; a new plan reads the newest records back and continues from
them (data position, optimizer steps, training time), and a peer decides from them whether a job may run
at all (`may_start`).

Trust: a record counts only when its signer is the peer it names (the DHT already checked the signature).
A *stop* counts only when signed by the job's owner (the key that published the job). A *done* or *ended*
is accepted from any signer, as metrics are today: a swarm member that lies about it ends the job early
(known limit: records are not yet checked against the plan's membership).

Alternatives rejected: a progress key per epoch (`progress/<epoch>`) — readers could not enumerate it
(hivemind hashes key names) and it ties progress to the plan again; one record written by an elected
leader — elections need their own agreement and a dead leader loses the record.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import Field

from ravnest_p2p.discovery import dht_time
from ravnest_p2p.types import WireModel

__all__ = [
    "PROGRESS_KEY",
    "PROGRESS_TTL_S",
    "JobProgress",
    "ProgressStore",
    "ProgressView",
    "may_start",
    "merge_progress",
    "parse_progress",
    "publish_progress",
    "read_progress",
]

logger = logging.getLogger(__name__)

PROGRESS_KEY = "progress"
PROGRESS_TTL_S = 3600.0  # a restarted peer must still see that a job ended; refreshed while it runs


class ProgressStore(Protocol):
    """What jobs and progress need of the DHT (`discovery.RunDHT`, and the unit tests' in-memory fake)."""

    @property
    def run_owner(self) -> str | None: ...

    async def store_own(
        self, name: str, value: Any, *, ttl_s: float, pin_to_initial_peers: bool = False
    ) -> bool: ...

    async def get_signed(
        self, name: str, *, from_initial_peers: bool = False
    ) -> dict[str, tuple[Any, float]]: ...


class JobProgress(WireModel):
    """One writer's account of a job (a cluster's first stage, or the owner's stop request).

    Attributes:
        job_id: the job.
        peer_id: the writer (must equal the record's signer).
        epoch: the plan epoch the writer trains on (0: an explicit assignment).
        cluster: the writer's cluster index (None: the owner's stop request).
        num_clusters: clusters of that plan.
        epoch_start: data position (micro-batches of this cluster) when this epoch's run began.
        micro_batches: data position now: micro-batches this cluster fed since the job began.
        optimizer_steps: optimizer steps of the writer's stage since the job began (the LR schedule's
            position).
        samples: samples fed since the job began.
        seed: the data/shuffle seed the cluster uses (the job's seed; recorded for checkpoints).
        train_wall_s: seconds of training since the job began, summed over plans.
        done: the job reached its stop condition (steps, epochs, wall time, or a stop request).
        stopped: the owner asked the job to stop (`RunClient.stop_job`).
        ended: the job will not run again (done, stopped, or failed where no new plan can help).
        reason: why it ended, for people.
        updated_at: DHT time of the record.
    """

    schema_version: int = 1
    job_id: str = Field(min_length=1, max_length=64)
    peer_id: str = Field(min_length=1, max_length=128)
    epoch: int = Field(default=0, ge=0)
    cluster: int | None = Field(default=None, ge=0, le=100_000)
    num_clusters: int = Field(default=1, ge=1, le=100_000)
    epoch_start: int = Field(default=0, ge=0)
    micro_batches: int = Field(default=0, ge=0)
    optimizer_steps: int = Field(default=0, ge=0)
    samples: int = Field(default=0, ge=0)
    seed: int = Field(default=0, ge=0, le=2**31)
    train_wall_s: float = Field(default=0.0, ge=0, le=1e9)
    done: bool = False
    stopped: bool = False
    ended: bool = False
    reason: str | None = Field(default=None, max_length=500)
    updated_at: float = Field(default=0.0, ge=0)


@dataclass(frozen=True)
class ProgressView:
    """The merged progress of one job over every accepted record.

    Attributes:
        job_id: the job.
        epoch: the newest plan epoch any cluster trained on.
        micro_batches: data position to resume from (the furthest cluster; clusters move together).
        optimizer_steps: optimizer steps to resume the LR schedule from.
        train_wall_s: training time so far.
        started_epoch: whether any pipeline of the newest epoch already moved past its start.
        started: the (plan epoch, cluster) pipelines that moved past their start (a cluster kept
            running in place through a re-plan starts its new epoch at once; the others after their
            hand-over).
        num_clusters: clusters of the newest epoch's plan (as its records say).
        positions: data position by (plan epoch, cluster): how far each cluster of each plan got (a
            cluster whose pipeline broke stops early; the hand-over prefers the furthest replica).
        ended_clusters: the (plan epoch, cluster) pipelines whose record says they ended (done or not).
        done / stopped / ended: see `JobProgress` (``done``: any cluster finished; the job then never
            starts again, but the other clusters of its plan train on to their own end).
        reason: why it ended, if it did.
        updated_at: DHT time of the newest record of the newest epoch (a training first stage
            refreshes its record every metrics period).
    """

    job_id: str
    epoch: int = 0
    micro_batches: int = 0
    optimizer_steps: int = 0
    train_wall_s: float = 0.0
    started_epoch: bool = False
    started: frozenset[tuple[int, int]] = frozenset()
    num_clusters: int = 1
    positions: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    ended_clusters: frozenset[tuple[int, int]] = frozenset()
    done: bool = False
    stopped: bool = False
    ended: bool = False
    reason: str | None = None
    updated_at: float = 0.0

    @property
    def all_started(self) -> bool:
        """Whether every cluster of the newest epoch's plan trains (e.g. a re-plan is complete)."""
        return all((self.epoch, c) in self.started for c in range(self.num_clusters))

    @property
    def finished(self) -> bool:
        """Whether the job must not run (again): done, stopped or ended."""
        return self.done or self.stopped or self.ended


def parse_progress(value: Any, signer_peer_id: str) -> JobProgress:
    """The DHT validator's schema of the ``progress`` key: a valid record its signer wrote about itself."""
    record = JobProgress.model_validate(value)
    if record.peer_id != signer_peer_id:
        raise ValueError(f"progress names {record.peer_id[:16]!r}, signed by {signer_peer_id[:16]!r}")
    return record


def merge_progress(
    records: Mapping[str, JobProgress], *, job_id: str, owner_peer_id: str | None
) -> ProgressView | None:
    """Merge the signed `records` ({signer: record}) of `job_id`; None when there is none.

    Records whose writer is not their signer, or of another job, are ignored; a stop counts only from
    `owner_peer_id` (None: no stop is trusted).
    """
    mine = [r for signer, r in records.items() if r.peer_id == signer and r.job_id == job_id]
    stops = [r for r in mine if r.stopped and r.peer_id == owner_peer_id]
    runs = [r for r in mine if r.cluster is not None]
    if not runs and not stops:
        return None
    epoch = max((r.epoch for r in runs), default=0)
    newest = [r for r in runs if r.epoch == epoch]
    ended = next((r for r in runs if r.ended or r.done), None)
    positions: dict[tuple[int, int], int] = {}
    for r in runs:
        assert r.cluster is not None
        key = (r.epoch, r.cluster)
        positions[key] = max(positions.get(key, 0), r.micro_batches)
    return ProgressView(
        job_id=job_id,
        epoch=epoch,
        micro_batches=max((r.micro_batches for r in runs), default=0),
        optimizer_steps=max((r.optimizer_steps for r in runs), default=0),
        train_wall_s=max((r.train_wall_s for r in runs), default=0.0),
        started_epoch=any(r.micro_batches > r.epoch_start for r in newest),
        started=frozenset(
            (r.epoch, r.cluster) for r in runs if r.cluster is not None and r.micro_batches > r.epoch_start
        ),
        num_clusters=max((r.num_clusters for r in newest), default=1),
        positions=positions,
        ended_clusters=frozenset(
            (r.epoch, r.cluster) for r in runs if (r.ended or r.done) and r.cluster is not None
        ),
        done=any(r.done for r in runs),
        stopped=bool(stops),
        ended=ended is not None or bool(stops),
        reason=(ended.reason if ended is not None else None) or ("stopped by its owner" if stops else None),
        updated_at=max((r.updated_at for r in newest), default=0.0),
    )


def may_start(
    progress: ProgressView | None,
    *,
    epoch: int,
    holds_state: bool,
    now: float | None = None,
    idle_after_s: float = 0.0,
    cluster: int | None = None,
) -> tuple[bool, str]:
    """Whether this peer may start its role of a job on plan `epoch`, and why not.

    Args:
        progress: the job's merged progress (None: never started).
        epoch: the plan epoch of the role (0: an explicit assignment).
        holds_state: this process already ran the job on this epoch (a restart of the same role by the
            supervisor, not a restarted process).
        now: DHT time now (None: never treat the job's pipelines as idle).
        idle_after_s: a job whose newest progress record is older than this has no pipeline moving
            (every peer stopped, e.g. all restarted): its plans are neither superseding nor in the way,
            and a restarted peer may start (its state comes from checkpoints). 0: never.
        cluster: the role's cluster: only that cluster's pipeline moving without us refuses the start
            (None: any cluster of the epoch). A cluster kept running in place starts the new epoch at
            once; the re-formed clusters must still be able to start theirs.

    A job never runs again once done, stopped or ended; a plan older than one the job already ran on is
    superseded; and a peer that was not part of an epoch's pipeline from its start (e.g. a process
    restarted with the same identity after a kill) must not take a stage of a pipeline that already
    moved: its neighbours' micro-batches and weights are past anything it could hold. It waits for the
    next plan, which moves the state to it.
    """
    if progress is None:
        return True, ""
    if progress.finished:
        return False, f"ended ({progress.reason or 'done'})"
    if idle_after_s > 0 and now is not None and now - progress.updated_at > idle_after_s:
        return True, ""
    if progress.epoch > epoch:
        return False, f"superseded: the job already runs on plan epoch {progress.epoch}"
    moved = progress.started_epoch if cluster is None else (epoch, cluster) in progress.started
    if progress.epoch == epoch and moved and not holds_state:
        return False, f"plan epoch {epoch} already trains without this peer's state"
    return True, ""


async def read_progress(dht: ProgressStore, job_id: str, *, owner_peer_id: str | None) -> ProgressView | None:
    """Read and merge the job's progress records (malformed ones are ignored)."""
    found = await dht.get_signed(PROGRESS_KEY, from_initial_peers=True)
    records: dict[str, JobProgress] = {}
    for signer, (value, _) in found.items():
        try:
            records[signer] = JobProgress.model_validate(value)
        except Exception as exc:
            logger.debug("ignoring malformed progress from %s: %s", signer, exc)
    return merge_progress(records, job_id=job_id, owner_peer_id=owner_peer_id)


async def publish_progress(
    dht: ProgressStore, record: JobProgress, *, final: bool = False, pin: bool | None = None
) -> bool:
    """Store `record` under our own subkey of `progress`; `pin` (default: `final`) also stores it at the
    initial peers.

    The key's nearest nodes may all be the run's peers: when every peer restarts, a record that lived only
    there is gone, and the restarted peers would not know where the job stood. Pinned copies live on the
    initial peers (the bootstrap nodes), which `read_progress` also asks. The record is stamped with the DHT
    time now (the run's validator refuses values that are not fresh).
    """
    record = record.model_copy(update={"updated_at": dht_time()})
    try:
        return await dht.store_own(
            PROGRESS_KEY,
            record.model_dump(mode="json"),
            ttl_s=PROGRESS_TTL_S,
            pin_to_initial_peers=final if pin is None else pin,
        )
    except Exception as exc:  # best effort; the next publication retries
        logger.debug("progress publication failed: %r", exc)
        return False
