"""`role_for`: every per-stage fact of a peer's part in a job, computed once, in one place.

Problem: a stage's layer range, neighbours, window, shard map and last step used to be derived in several
places (the node's job loop, the runner, the replica averager, the planner) and they disagreed (the
planner budgeted memory for a window of 4 while the runtime ran 3*S-2). `role_for` is a pure function of
(job, plan or explicit assignment, peer id, progress) returning a frozen `StageRole`; the supervisor
computes it once per plan and everything downstream reads it, never re-derives it.

Known limit: the data shards of a new plan are cut for its number of clusters; a plan with another
cluster count resumes every cluster at the job's furthest data position of the shard layout it has now,
so some samples of the previous layout are seen once more or once less in that data epoch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass

from ravnest_p2p.averaging import ShardMap
from ravnest_p2p.planning import PeerCapacity, Plan
from ravnest_p2p.planning.window import pipeline_window
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.placement import assignment_from_plan
from ravnest_p2p.training.progress import ProgressView
from ravnest_p2p.training.replicas import shard_map_for
from ravnest_p2p.training.stages import load_dataset, steps_per_cluster

__all__ = ["Assignment", "StageRole", "role_for", "train_size"]

Assignment = tuple[tuple[StagePlacement, ...], ...]


@dataclass(frozen=True, eq=False)
class StageRole:
    """One peer's part of one job on one plan (see module docstring). Compare roles with `same_stage`.

    Attributes:
        job_id: the job.
        peer_id: this peer.
        epoch: the plan epoch (0: the job's explicit assignment).
        on_agreed_plan: the role comes from the swarm's agreed plan (it moves when the plan moves).
        cluster_index / num_clusters: this peer's cluster, and how many there are.
        stage_index: this peer's stage in its cluster.
        stages: the cluster's stages in pipeline order.
        assignment: every cluster's stages (the whole plan, as placements).
        first_layer / end_layer: this stage's layers [first_layer, end_layer).
        window: micro-batches in flight in this cluster (`planning.window.pipeline_window`).
        shard_map: the averaging rings' shard map over every cluster (None with one cluster).
        link_in_bytes_per_s / link_out_bytes_per_s: planned rates of the links from the previous and to
            the next stage (None: unknown, or no such neighbour).
        final_step: micro-batches each cluster trains in the whole job (None: until stopped).
        data_start: micro-batches already trained by the job (where this run's data resumes).
        optimizer_steps_start: optimizer steps already taken (the LR schedule's position).
        train_wall_s_start: seconds the job already trained.
        plan_link_rates: every planned peer's (upload, download) bytes/s as the agreed plan records them
            (`Plan.link_rates`, the same at every member: the rings' Δ codec); None off a plan or unknown.
    """

    job_id: str
    peer_id: str
    epoch: int
    on_agreed_plan: bool
    cluster_index: int
    num_clusters: int
    stage_index: int
    stages: tuple[StagePlacement, ...]
    assignment: Assignment
    first_layer: int
    end_layer: int
    window: int
    shard_map: ShardMap | None
    link_in_bytes_per_s: float | None
    link_out_bytes_per_s: float | None
    final_step: int | None
    data_start: int
    optimizer_steps_start: int
    train_wall_s_start: float
    plan_link_rates: Mapping[str, tuple[float, float]] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == len(self.stages) - 1

    @property
    def peers(self) -> list[str]:
        """The cluster's peers in stage order."""
        return [s.peer_id for s in self.stages]

    @property
    def plan_peers(self) -> frozenset[str]:
        """Every peer of the plan (the allow-list for state hand-over, and whose addresses we need)."""
        return frozenset(s.peer_id for cluster in self.assignment for s in cluster)

    @property
    def prev_peer_id(self) -> str | None:
        return self.stages[self.stage_index - 1].peer_id if self.stage_index > 0 else None

    @property
    def next_peer_id(self) -> str | None:
        return self.stages[self.stage_index + 1].peer_id if not self.is_last else None

    @property
    def remaining_steps(self) -> int | None:
        """Micro-batches this run still has to train (None: until stopped)."""
        return None if self.final_step is None else max(0, self.final_step - self.data_start)

    def same_stage(self, other: StageRole | None) -> bool:
        """Whether `other` is the same job, plan, cluster and layers (a restart would change nothing)."""
        return other is not None and (
            other.job_id,
            other.epoch,
            other.cluster_index,
            other.first_layer,
            other.end_layer,
        ) == (self.job_id, self.epoch, self.cluster_index, self.first_layer, self.end_layer)


@functools.lru_cache(maxsize=8)
def _train_size(dataset: str, config_json: str, job_json: str) -> int:
    job = JobSpec.model_validate_json(job_json)
    return len(load_dataset(job)[0])


def train_size(job: JobSpec) -> int:
    """Samples in the job's training split (cached: every role of a job asks)."""
    key_job = job.model_copy(update={"assignment": None})
    return _train_size(job.dataset, json.dumps(job.dataset_config, sort_keys=True), key_job.model_dump_json())


def _final_step(job: JobSpec, num_train_samples: int, num_clusters: int) -> int | None:
    if job.until_stopped:
        return job.max_steps
    return steps_per_cluster(job, num_train_samples, num_clusters)


def _link(capacities: Mapping[str, PeerCapacity], sender: str | None, receiver: str | None) -> float | None:
    if sender is None or receiver is None or sender not in capacities or receiver not in capacities:
        return None
    return min(capacities[sender].upload_bytes_per_s, capacities[receiver].download_bytes_per_s)


def role_for(
    job: JobSpec,
    plan_or_assignment: Plan | Assignment | None,
    peer_id: str,
    *,
    progress: ProgressView | None = None,
    num_train_samples: int | None = None,
    capacities: Mapping[str, PeerCapacity] | None = None,
) -> StageRole | None:
    """This peer's role in `job` on the given plan (or assignment; None: the job's own), or None.

    Args:
        job: the job.
        plan_or_assignment: the agreed plan, an explicit assignment, or None for `job.assignment`.
        peer_id: this peer.
        progress: the job's progress so far (where data, steps and time resume).
        num_train_samples: size of the training split (None: load the data set to find out).
        capacities: measured capacities by peer id, for the link rates (optional).

    Returns:
        The role, or None when the plan does not name this peer (a spare, or not a member).
    """
    rates = None
    if isinstance(plan_or_assignment, Plan):
        assignment, epoch, on_plan = assignment_from_plan(plan_or_assignment), plan_or_assignment.epoch, True
        rates = plan_or_assignment.rates_by_peer()
    else:
        assignment, epoch, on_plan = plan_or_assignment or job.assignment or (), 0, False
    for cluster_index, stages in enumerate(assignment):
        for stage_index, stage in enumerate(stages):
            if stage.peer_id != peer_id:
                continue
            num_clusters = len(assignment)
            samples = train_size(job) if num_train_samples is None else num_train_samples
            placed = job.model_copy(update={"assignment": assignment})
            caps = capacities or {}
            prev = stages[stage_index - 1].peer_id if stage_index > 0 else None
            nxt = stages[stage_index + 1].peer_id if stage_index + 1 < len(stages) else None
            return StageRole(
                job_id=job.job_id,
                peer_id=peer_id,
                epoch=epoch,
                on_agreed_plan=on_plan,
                cluster_index=cluster_index,
                num_clusters=num_clusters,
                stage_index=stage_index,
                stages=stages,
                assignment=assignment,
                first_layer=stage.first_layer,
                end_layer=stage.end_layer,
                window=pipeline_window(job.max_in_flight, len(stages)),
                shard_map=shard_map_for(placed, epoch=epoch),
                link_in_bytes_per_s=_link(caps, prev, peer_id),
                link_out_bytes_per_s=_link(caps, peer_id, nxt),
                final_step=_final_step(job, samples, num_clusters),
                data_start=progress.micro_batches if progress is not None else 0,
                optimizer_steps_start=progress.optimizer_steps if progress is not None else 0,
                train_wall_s_start=progress.train_wall_s if progress is not None else 0.0,
                plan_link_rates=rates,
            )
    return None
