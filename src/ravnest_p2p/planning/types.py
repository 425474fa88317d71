"""Value types of the planner: what it is given and what it answers.

Everything here is a frozen pydantic v2 model with strict ranges and no NaN/inf, because the inputs
come from signed DHT records of other peers (untrusted numbers) and the outputs are hashed and compared
between peers (`Plan.digest`), so they must be canonical.

Units are in the names: FLOP/s, bytes, bytes per second (not bits).
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ravnest_p2p.errors import RavnestError

__all__ = [
    "ClusterPlan",
    "InfeasiblePlan",
    "JobParams",
    "PeerCapacity",
    "PeerLinkRate",
    "PlacedStage",
    "Plan",
    "StageAssignment",
]


class InfeasiblePlan(RavnestError, ValueError):
    """No assignment satisfies the constraints (e.g. the peers' memory cannot hold the model)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class PeerCapacity(_Frozen):
    """What one peer offers, as measured by itself and announced in its `PeerRecord`.

    Attributes:
        peer_id: the peer's id (base58 string); the planner's tie-breaker, so every peer sorts alike.
        flops_per_s: sustained FLOP/s in the training dtype on the peer's device.
        memory_bytes: memory free for training (parameters, optimizer state, stash, activations).
        upload_bytes_per_s: measured upstream throughput.
        download_bytes_per_s: measured downstream throughput.
    """

    peer_id: str = Field(min_length=1)
    flops_per_s: float = Field(gt=0)
    memory_bytes: int = Field(ge=0)
    upload_bytes_per_s: float = Field(gt=0)
    download_bytes_per_s: float = Field(gt=0)

    @property
    def link_bytes_per_s(self) -> float:
        """The slower direction: a pipeline stage both receives and sends every micro-batch."""
        return min(self.upload_bytes_per_s, self.download_bytes_per_s)


class JobParams(_Frozen):
    """The job-level knobs the planner needs (a projection of the `JobSpec`).

    Attributes:
        micro_batch_size: samples per micro-batch; scales compute, activations and transfers.
        max_in_flight: micro-batches in flight per pipeline; every stage keeps that many weight versions
            (the stash) and that many micro-batches' activations.
        memory_headroom: factor (>= 1) applied to every memory estimate (allocator slack, workspaces).
            1.1: the estimate (`planning.memory`) counts gradients and measured activations and came
            within a few per cent of measured peaks (docs/memory.md); it was 1.2 when it counted neither.
        min_stages: a cluster needs at least this many peers (1 allows a single-peer "pipeline").
        spare_ratio: a peer whose compute or link is below this fraction of its cluster's median waits
            as a spare instead of slowing the cluster, when the cluster fits the model without it.
    """

    micro_batch_size: int = Field(ge=1)
    max_in_flight: int = Field(default=4, ge=1)
    memory_headroom: float = Field(default=1.1, ge=1.0)
    min_stages: int = Field(default=1, ge=1)
    spare_ratio: float = Field(default=0.25, ge=0.0, lt=1.0)


class StageAssignment(_Frozen):
    """One pipeline stage: a peer and its contiguous half-open range of layers."""

    peer_id: str
    first_layer: int = Field(ge=0)
    last_layer_exclusive: int = Field(ge=1)
    stage_time_s: float = Field(ge=0, description="estimated compute + send time per micro-batch")
    memory_bytes: int = Field(ge=0, description="estimated memory the stage needs, headroom included")

    @model_validator(mode="after")
    def _non_empty(self) -> StageAssignment:
        if self.last_layer_exclusive <= self.first_layer:
            raise ValueError("a stage holds at least one layer")
        return self


class ClusterPlan(_Frozen):
    """One data-parallel replica of the model: an ordered pipeline of stages covering every layer."""

    index: int = Field(ge=0)
    stages: tuple[StageAssignment, ...] = Field(min_length=1)
    bottleneck_s: float = Field(ge=0, description="slowest stage's time per micro-batch")

    @property
    def throughput_samples_per_s(self) -> float:
        """Steady-state samples/s of the asynchronous pipeline (one micro-batch per bottleneck)."""
        return 0.0 if self.bottleneck_s == 0 else 1.0 / self.bottleneck_s

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(s.peer_id for s in self.stages)


class PeerLinkRate(_Frozen):
    """One planned peer's link rates as the plan was made with them (bytes/s; the agreed view's figures)."""

    peer_id: str = Field(min_length=1)
    upload_bytes_per_s: float = Field(gt=0)
    download_bytes_per_s: float = Field(gt=0)


class Plan(_Frozen):
    """The whole swarm's plan for one epoch: clusters plus the peers that wait as spares.

    `link_rates`: every planned peer's (upload, download) rate from the agreed view, sorted by peer id,
    inside the digest, so every member reads the same figures (the averaging rings choose their Δ codec
    from them: `averaging.codec_choice`). Empty: unknown (a plan made without them).
    """

    epoch: int = Field(ge=0)
    clusters: tuple[ClusterPlan, ...]
    spare_peer_ids: tuple[str, ...] = ()
    link_rates: tuple[PeerLinkRate, ...] = ()

    def rates_by_peer(self) -> dict[str, tuple[float, float]] | None:
        """Peer id -> (upload, download) bytes/s of the planned peers; None if the plan has none."""
        if not self.link_rates:
            return None
        return {r.peer_id: (r.upload_bytes_per_s, r.download_bytes_per_s) for r in self.link_rates}

    def digest(self) -> str:
        """Hex sha256 of a canonical JSON form: equal plans give equal digests on every peer.

        Floats are serialised by `json` (shortest round-trip repr), which is identical across
        CPython builds for the same IEEE-754 value.
        """
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class PlacedStage(_Frozen):
    """Where a peer sat in the previous agreed plan, as its signed record says (a re-plan's input).

    `make_plan` keeps a previous cluster whole when every one of its stages is still here and fits
    (`planning.replan`); the members read these from the same records, so they agree on them.
    """

    peer_id: str = Field(min_length=1)
    epoch: int = Field(ge=0)
    cluster: int = Field(ge=0)
    stage: int = Field(ge=0)
    first_layer: int = Field(ge=0)
    last_layer_exclusive: int = Field(ge=1)
