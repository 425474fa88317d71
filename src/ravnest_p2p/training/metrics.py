"""Training metrics that peers publish to the DHT (the run's ``metrics`` key) and researchers read back.

Each stage peer holds one value under its own signed subkey of ``metrics``: its newest `StageMetrics`,
which carries the job id and plan epoch (the key name is fixed so the DHT validator can check it).

Whose word counts (`member_metrics`): a signed metrics record only proves who wrote it. Any identity in
the run can write one that says ``done`` for any job, so a reader counts a record only if its signer
holds the (cluster, stage) it reports: in the job's explicit `assignment` (the owner signed the job,
so this is authoritative), or else in the plan of its epoch, as `plan_members` derives from signed
records: the signer's ``peers`` record places it there and its ``plan`` record carries the digest most
of that epoch's peers published. A position claimed by two peers counts for neither. Known limit: on an
agreed plan a run member can still claim a position no one else claims (e.g. a departed peer's).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.membership import PlanRecord
from ravnest_p2p.types import WireModel

__all__ = ["METRICS_KEY", "StageMetrics", "member_metrics", "parse_metrics", "plan_members"]

METRICS_KEY = "metrics"


class StageMetrics(WireModel):
    """One stage's progress. Read from the wire: unknown fields ignored, numbers range-checked."""

    schema_version: int = 1
    mode: str = Field(default="pipeline", max_length=32, description="the job's training mode")
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


def parse_metrics(value: Any, signer_peer_id: str) -> StageMetrics:
    """Validate an untrusted metrics value (the DHT validator's schema for ``metrics``); raises if bad."""
    metrics = StageMetrics.model_validate(value)
    if metrics.peer_id != signer_peer_id:
        raise ValueError(f"metrics claim peer {metrics.peer_id} but are signed by {signer_peer_id}")
    return metrics


Position = tuple[int, int]  # (cluster, stage)


def plan_members(
    records: Mapping[str, PeerRecord], plans: Mapping[str, PlanRecord]
) -> dict[int, dict[str, Position]]:
    """Epoch -> {peer id: (cluster, stage)} of the peers whose signed records place them in that plan.

    A peer is a member of epoch E's plan at (c, s) if its ``peers`` record says epoch E, cluster c and
    stage s, and its ``plan`` record says epoch E with the digest that most of those peers published
    (a tie: no agreement, no members). A position claimed by two peers is dropped for both.

    Args:
        records: valid peer records by signer (e.g. `PeerDirectory.peers`).
        plans: valid plan records by signer (e.g. `DhtPlanBoard.read_all()`).
    """
    claims: dict[int, list[tuple[str, Position, str]]] = defaultdict(list)
    for peer_id, record in records.items():
        plan = plans.get(peer_id)
        if record.cluster is None or record.stage is None or plan is None or plan.epoch != record.epoch:
            continue
        claims[record.epoch].append((peer_id, (record.cluster, record.stage), plan.digest))
    out: dict[int, dict[str, Position]] = {}
    for epoch, entries in claims.items():
        ranked = Counter(digest for _, _, digest in entries).most_common(2)
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            continue
        agreed = [(peer_id, position) for peer_id, position, digest in entries if digest == ranked[0][0]]
        claimed = Counter(position for _, position in agreed)
        out[epoch] = {peer_id: position for peer_id, position in agreed if claimed[position] == 1}
    return out


def member_metrics(
    metrics: Sequence[StageMetrics],
    *,
    assignment: Sequence[Sequence[Any]] | None = None,
    members: Mapping[int, Mapping[str, Position]] | None = None,
) -> list[StageMetrics]:
    """The metrics whose signer holds the (cluster, stage) they report; the others do not count.

    Args:
        metrics: metrics of one job, each already checked to be signed by its ``peer_id``.
        assignment: the job's explicit clusters of stages (items with a ``peer_id``), if it has one;
            then it alone decides.
        members: else, `plan_members` of the run (epoch -> {peer id: (cluster, stage)}).
    """
    if assignment is not None:
        return [
            m
            for m in metrics
            if m.cluster < len(assignment)
            and m.stage < len(assignment[m.cluster])
            and assignment[m.cluster][m.stage].peer_id == m.peer_id
        ]
    members = members or {}
    return [m for m in metrics if members.get(m.epoch, {}).get(m.peer_id) == (m.cluster, m.stage)]
