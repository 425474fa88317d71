"""The researcher's JobSpec: what to train, on what data, how; published under the run's `job` key.

A job names its model by registry key + config and its data set by name (never shipped code), so a
peer can only ever run what its own installed package defines. `assignment` is an explicit placement
(clusters of ordered stages) for use until the self-organising planner's plan is active, and for tests
and benchmarks that must pin the layout.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from ravnest_p2p.averaging.outer import OuterOptimizerConfig
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.modes import IstConfig, SyncBackupConfig, TrainingMode
from ravnest_p2p.transport.codec import Compression

__all__ = ["DatasetName", "InitCheckpoint", "JobSpec", "StagePlacement"]

# A built-in data set (`training.datasets.BUILTIN_DATASETS`) or a plugin's. Only the form is checked here:
# a peer that lacks a plugin must still parse the job to say so; `training.datasets.check_job` checks the
# name against what is installed where the job is built, `missing_parts` where a peer decides to serve it.
DatasetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,47}$")]


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class StagePlacement(_Config):
    """One stage: which peer runs layers [first_layer, end_layer)."""

    peer_id: str = Field(min_length=1, max_length=128)
    first_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)

    @model_validator(mode="after")
    def _non_empty(self) -> StagePlacement:
        if self.end_layer <= self.first_layer:
            raise ValueError("a stage needs at least one layer")
        return self


class InitCheckpoint(_Config):
    """Start a job from a model checkpoint a peer serves (e.g. `RunClient.serve_checkpoint`).

    Attributes:
        peer_id: who serves it (its `fetch_state`).
        source_id: the id it is served under (a `fetch_state` job id).
        state_digest: `stage_state.entries_digest` of every tensor in it: stages trust the per-tensor
            digests the server lists only when they hash to this.
        mode: ``weights`` (parameters and buffers; fresh optimizer and schedule: fine-tuning) or
            ``resume`` (also optimizer state and step counters).
    """

    peer_id: str = Field(min_length=1, max_length=128)
    source_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    state_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    mode: Literal["weights", "resume"] = "weights"


class JobSpec(_Config):
    """A training job.

    Attributes:
        job_id: names the job in metrics and checkpoints.
        model / model_params: registry key and its config (see `ravnest_p2p.models`).
        dataset / dataset_config: data set name (built-in, local source or plugin) and its config (see
            `training.datasets`, docs/your-model-and-data.md).
        batch_size: samples per micro-batch.
        num_epochs: passes over each cluster's shard of the data.
        max_steps: cap on micro-batches per cluster (None: the epochs decide).
        max_wall_s: stop after this many seconds of training, summed over plans (None: no limit).
        until_stopped: ignore `num_epochs` (data epochs wrap) and train until `max_steps`, `max_wall_s`
            or the owner's `RunClient.stop_job` ends the job (see docs/elastic.md).
        min_stages: the planner gives every cluster at least this many stages (peers).
        max_in_flight: micro-batches in a pipeline at once (None: 3 x stages - 2, see
            `planning.window`).
        adaptive_window: experimental; the first stage sizes its window between the number of stages
            and max_in_flight from measured delivery rate x min round trip (`runtime.window`).
        update_every: backwards per optimizer step.
        schedule: ``async_1f1b`` (no flushes) or ``gpipe`` (synchronous fill-drain of one window at a
            time; use ``update_every = max_in_flight`` for GPipe's semantics) — the baseline we compare to.
        eval_every_steps: evaluate on held-out data every this many micro-batches (0: only at the end).
        averaging_period_steps: average replicas across clusters every this many micro-batches.
        averaging_period_s: average every this many seconds of wall clock instead (overrides the
            steps; pairs clusters that run at different speeds).
        averaging_compression: the replicas' periodic averaging on the wire: ``none`` (fp32) or ``fp16``
            (half the bytes; every replica still ends a round with the same bits). Not with
            `outer_optimizer`, which compresses its pseudo-gradients itself (`outer_optimizer.compression`).
        assignment: explicit clusters (each an ordered list of stages) instead of the planner's plan.
        checkpoint_every_steps / checkpoint_every_s / checkpoint_keep_last: stage checkpoints (see
            docs/checkpoints.md; written where the peer keeps them, nowhere if it keeps none).
        state_readers: peers besides the job's own that may fetch its stage state (e.g. the
            researcher's client, for `RunClient.checkpoint`).
        init_checkpoint: start from this checkpoint instead of the initial weights (docs/checkpoints.md).
        mode: ``pipeline`` (default), ``sync_backup`` or ``ist``; each mode reads its own section
            (`training.modes`, docs/training-modes.md). With ``sync_backup`` or ``ist`` an explicit
            assignment is one single-stage cluster per worker (N + b, or ``ist.num_workers``, of them).
    """

    schema_version: int = 1
    job_id: str = Field(default="job", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    model: str = "digits_cnn"
    model_params: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetName = "digits"
    dataset_config: dict[str, Any] = Field(default_factory=dict)
    optimizer: OptimizerConfig = OptimizerConfig()
    batch_size: int = Field(default=32, ge=1, le=65536)
    num_epochs: int = Field(default=1, ge=1, le=10_000)
    max_steps: int | None = Field(default=None, ge=1)
    max_wall_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86_400)
    until_stopped: bool = False
    max_in_flight: int | None = Field(default=None, ge=1, le=1024)
    adaptive_window: bool = False
    min_stages: int = Field(default=1, ge=1, le=1024)
    update_every: int = Field(default=1, ge=1)
    recompute: bool = False
    schedule: Literal["async_1f1b", "gpipe"] = "async_1f1b"
    compression: Compression = Compression.NONE
    seed: int = Field(default=0, ge=0, le=2**31)
    eval_every_steps: int = Field(default=0, ge=0)
    eval_batch_size: int = Field(default=256, ge=1)
    averaging_period_steps: int = Field(default=0, ge=0)
    averaging_period_s: float = Field(default=0.0, ge=0, le=86_400)
    averaging_compression: Compression = Compression.NONE
    outer_optimizer: OuterOptimizerConfig | None = None
    assignment: tuple[tuple[StagePlacement, ...], ...] | None = None
    checkpoint_every_steps: int = Field(default=0, ge=0)
    checkpoint_every_s: float = Field(default=0.0, ge=0, le=30 * 86_400)
    checkpoint_keep_last: int = Field(default=3, ge=1, le=1000)
    state_readers: tuple[str, ...] = Field(default=(), max_length=64)
    init_checkpoint: InitCheckpoint | None = None
    # ----- training modes (training/modes.py) -----
    mode: TrainingMode = TrainingMode.PIPELINE
    sync_backup: SyncBackupConfig = SyncBackupConfig()
    ist: IstConfig = IstConfig()

    @model_validator(mode="after")
    def _outer_needs_a_period(self) -> JobSpec:
        if self.outer_optimizer is not None and not (self.averaging_period_steps or self.averaging_period_s):
            raise ValueError("outer_optimizer needs averaging_period_steps (H) or averaging_period_s")
        fragments = 1 if self.outer_optimizer is None else self.outer_optimizer.num_fragments
        if fragments > 1 and not self.averaging_period_steps:
            raise ValueError(
                "outer_optimizer.num_fragments > 1 staggers syncs by step: set averaging_period_steps"
            )
        if fragments > (self.averaging_period_steps or fragments):
            raise ValueError("outer_optimizer.num_fragments must not exceed averaging_period_steps (H)")
        wire = self.averaging_compression
        if wire not in (Compression.NONE, Compression.FP16):
            raise ValueError(f"averaging_compression must be 'none' or 'fp16', not {wire.value!r}")
        if wire is not Compression.NONE and self.outer_optimizer is not None:
            raise ValueError(
                "averaging_compression applies to plain averaging; with outer_optimizer compress the "
                "pseudo-gradients instead (outer_optimizer.compression)"
            )
        return self

    @model_validator(mode="after")
    def _contiguous(self) -> JobSpec:
        for index, cluster in enumerate(self.assignment or ()):
            if not cluster:
                raise ValueError(f"cluster {index} has no stages")
            if cluster[0].first_layer != 0:
                raise ValueError(f"cluster {index} must start at layer 0")
            for a, b in itertools.pairwise(cluster):
                if b.first_layer != a.end_layer:
                    raise ValueError(f"cluster {index}: stages must be contiguous")
            if len({s.peer_id for s in cluster}) != len(cluster):
                raise ValueError(f"cluster {index}: a peer appears twice")
        self._check_mode()
        return self

    def _check_mode(self) -> None:
        if self.mode == TrainingMode.PIPELINE or self.assignment is None:
            return
        mode = self.mode.value
        workers = [stage.peer_id for cluster in self.assignment for stage in cluster]
        if any(len(cluster) != 1 for cluster in self.assignment):
            raise ValueError(f"{mode}: every worker is a one-stage cluster holding the whole model")
        if len(set(workers)) != len(workers):
            raise ValueError(f"{mode}: a worker appears twice")
        expected = (
            self.sync_backup.num_workers if self.mode == TrainingMode.SYNC_BACKUP else self.ist.num_workers
        )
        if len(workers) != expected:
            raise ValueError(
                f"{mode}: {len(workers)} workers assigned, the mode's section asks for {expected}"
            )
        if self.sync_backup.owners is not None and not set(self.sync_backup.owners) <= set(workers):
            raise ValueError("sync_backup: every peer of `owners` must be an assigned worker")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
