"""Training metrics that peers publish to the DHT (`metrics/<epoch>`) and researchers read back."""

from __future__ import annotations

from pydantic import Field

from ravnest_p2p.types import WireModel

__all__ = ["METRICS_KEY", "StageMetrics", "metrics_key"]

METRICS_KEY = "metrics"


def metrics_key(epoch: int) -> str:
    return f"{METRICS_KEY}/{epoch}"


class StageMetrics(WireModel):
    """One stage's progress. Read from the wire: unknown fields ignored, numbers range-checked."""

    schema_version: int = 1
    epoch: int = Field(default=0, ge=0, description="the plan epoch this stage trains on")
    job_id: str = Field(max_length=64)
    peer_id: str = Field(max_length=128)
    cluster: int = Field(ge=0, le=100_000)
    stage: int = Field(ge=0, le=100_000)
    num_stages: int = Field(ge=1, le=100_000)
    step: int = Field(ge=0, description="micro-batches this stage has finished (first stage: completed)")
    optimizer_steps: int = Field(ge=0)
    loss: float | None = Field(default=None, ge=0, le=1e9)
    samples_per_s: float = Field(default=0.0, ge=0, le=1e12)
    queue_forward: int = Field(default=0, ge=0)
    queue_backward: int = Field(default=0, ge=0)
    in_flight: int = Field(default=0, ge=0)
    window: int = Field(default=0, ge=0, le=1_000_000, description="first stage: in-flight limit now")
    bytes_sent: int = Field(default=0, ge=0)
    compute_s: float = Field(default=0.0, ge=0, le=1e9)
    send_busy_s: float = Field(default=0.0, ge=0, le=1e9, description="time with a send in progress")
    averaging_rounds: int = Field(default=0, ge=0)
    averaging_bytes_sent: int = Field(default=0, ge=0)
    last_round_s: float | None = Field(default=None, ge=0, le=1e9)
    last_round: int | None = Field(default=None, ge=0, description="index of the last averaging round")
    last_round_participants: int | None = Field(
        default=None, ge=0, le=100_000, description="fewest replicas in any of this stage's rings' averages"
    )
    param_digests: dict[str, str] | None = Field(
        default=None, max_length=4096, description="when done: digest of each averaged tensor, by global name"
    )
    train_wall_s: float = Field(default=0.0, ge=0, le=1e9)
    eval_loss: float | None = Field(default=None, ge=0, le=1e9)
    eval_accuracy: float | None = Field(default=None, ge=0, le=1)
    peak_memory_bytes: int = Field(default=0, ge=0)
    done: bool = False
    failed: str | None = Field(default=None, max_length=500)
    updated_at: float = Field(ge=0)
