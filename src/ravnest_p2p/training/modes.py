"""A job's training mode and each mode's own config section (`JobSpec.mode`, `.sync_backup`, `.ist`).

Three modes share the peers, the transport and the DHT:

- ``pipeline`` (default): clusters of asynchronous 1F1B pipelines whose replicas are averaged across
  clusters (docs/pipeline.md, docs/averaging.md).
- ``sync_backup``: synchronous data-parallel SGD with backup workers (Chen et al., arXiv 1604.00981):
  every worker holds the whole model; parameter shards are owned by workers (`strategies.sync_layout`);
  each step the owner of a shard averages the first N of N + b gradients and the workers move on
  (`training.sync_runner`).
- ``ist``: Independent Subnetwork Training (Yuan et al., arXiv 1910.02120): every worker holds a
  replica of a `wide_mlp`; each round the hidden units are dealt afresh, every worker trains its
  sub-network for K local steps and pulls its next sub-network's entries straight from the workers
  that trained them (`training.ist_runner`, docs/training-modes.md).

Why a module of its own: the JobSpec grows in several directions at once; the modes' fields stay in one
block here, imported by `training.job`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["IstConfig", "SyncBackupConfig", "TrainingMode"]


class TrainingMode(StrEnum):
    PIPELINE = "pipeline"
    SYNC_BACKUP = "sync_backup"
    IST = "ist"


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class SyncBackupConfig(_Config):
    """Synchronous SGD with backup workers.

    Attributes:
        num_required: N, gradients averaged per step (the first N of the step to arrive).
        num_backup: b, extra workers whose late gradients are dropped; the job has N + b workers.
        num_shards: parameter shards of similar bytes, dealt to the owners largest first (None: one per
            owner candidate, so each owns one; at most one per parameter piece).
        aggregation: ``sync`` (the method) or ``async`` (the apply-on-arrival baseline: every gradient is
            applied when it arrives, however stale; a worker fetches the newest parameters after each).
        step_timeout_s: a step that does not complete within this fails the job with the owner's count
            (e.g. fewer than N workers left alive), instead of hanging.
        owner_ping_timeout_s: an owner that does not answer a ping within this is declared dead, and its
            shards move to the next owner of the layout.
        owners: the workers that may own shards (None: every worker). Keep slow peers out: an owner
            on a slow peer slows every step. If all of them die, every live worker may own.
        local_steps: K; 1 is synchronous SGD. K > 1 is local SGD: each worker takes K plain SGD steps
            from the step's parameters and pushes (θ_t - θ_local) / lr; with the job's optimizer plain
            SGD this averages the models every K steps (`training.sync_compute`).
    """

    num_required: int = Field(default=1, ge=1, le=1024)
    num_backup: int = Field(default=0, ge=0, le=1024)
    num_shards: int | None = Field(default=None, ge=1, le=4096)
    aggregation: Literal["sync", "async"] = "sync"
    step_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    owner_ping_timeout_s: float = Field(default=10.0, gt=0, le=600)
    owners: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=1024)
    local_steps: int = Field(default=1, ge=1, le=100_000)

    @property
    def num_workers(self) -> int:
        return self.num_required + self.num_backup


class IstConfig(_Config):
    """Independent Subnetwork Training.

    Attributes:
        num_workers: n, sub-networks per round (the wide layers' units are dealt into n parts).
        local_steps: K, steps each worker trains its sub-network per round.
        scale_rule: ``train`` (multiply the inputs of dealt layers by n at train time), ``test`` (ResIST's
            1/n at test time) or ``none`` (see `strategies.ist.ScaleRule`).
        round_timeout_s: a holder still behind after this long is gone for the round (and excluded from
            the next deals): the round never waits longer on one worker.
        peer_timeout_s: a holder unreachable for this long is gone for the round (and excluded after).
    """

    num_workers: int = Field(default=2, ge=1, le=1024)
    local_steps: int = Field(default=10, ge=1, le=100_000)
    scale_rule: Literal["train", "test", "none"] = "train"
    round_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    peer_timeout_s: float = Field(default=10.0, gt=0, le=600)
