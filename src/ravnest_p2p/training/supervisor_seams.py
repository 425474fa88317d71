"""The job supervisor's seams and policies: its config, what it needs of the membership and of a runner,
and when a failed role may run again (see `training.supervisor`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.discovery.records import Serving
from ravnest_p2p.errors import NeighbourLost
from ravnest_p2p.planning import JobParams, Plan
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.types import LayerProfile

__all__ = [
    "PlanSource",
    "RunnerFactory",
    "StageRun",
    "SupervisorConfig",
    "SuspectReporter",
    "WorkloadFactory",
    "awaited",
    "lost_neighbour",
    "rerun_allowed",
]


def rerun_allowed(
    failed_epoch: int | None, plan_epoch: int, *, failures: int = 1, retries_per_plan: int = 0
) -> bool:
    """Whether a job on the agreed plan may run on `plan_epoch` here, given the epoch it last failed on.

    A newer plan always may (a plan is how the swarm routes around a fault). The same plan may be
    retried `retries_per_plan` times: while a re-plan spreads, a neighbour still on the old plan refuses
    the new plan's first messages and the stage fails at once (seen on loopback: a stage failed 0.2 s
    into its new plan with "moved to another plan"); a dead neighbour fails every retry the same way, and
    the membership, told of it, opens the next plan.
    """
    if failed_epoch is None or plan_epoch > failed_epoch:
        return True
    return plan_epoch == failed_epoch and failures <= retries_per_plan


class SupervisorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    poll_s: float = Field(default=2.0, gt=0, description="how often the job, plan and progress are read")
    read_timeout_s: float = Field(default=20.0, gt=0, description="one DHT read of the job or progress")
    drain_grace_s: float = Field(default=30.0, ge=0, description="a leaving peer serves its state this long")
    retries_per_plan: int = Field(default=2, ge=0, le=100, description="runs of a failed role on one plan")
    retry_delay_s: float = Field(
        default=3.0,
        ge=0,
        description="wait before retrying one plan (a dead neighbour's re-plan comes first)",
    )
    idle_after_s: float = Field(
        default=30.0,
        ge=0,
        description="a job whose progress is older than this is idle: a restarted peer may start it",
    )
    replica_tie_micro_batches: int = Field(
        default=64,
        ge=0,
        description="replicas this close in data position are tied: a hand-over takes them by cluster index",
    )


class PlanSource(Protocol):
    """The membership service, as the supervisor sees it."""

    @property
    def active_plan(self) -> Plan | None: ...

    @property
    def active_workload(self) -> str | None: ...

    def set_workload(
        self, key: str, job: JobParams, layers: list[LayerProfile], *, serving: Serving | None = None
    ) -> None: ...


class SuspectReporter(Protocol):
    """Tells the membership a peer looks dead, so it re-plans without waiting for the record to expire."""

    def report_suspect(self, peer_id: str, reason: str) -> None: ...


class StageRun(Protocol):
    """A runner for one role (`runner.StageRunner`; tests pass fakes)."""

    stop_requested: asyncio.Event
    held_state: HeldState | None

    async def run(self) -> Any: ...


RunnerFactory = Callable[[JobSpec, StageRole, "StageState | None"], StageRun]
WorkloadFactory = Callable[[JobSpec], Awaitable[tuple[JobParams, list[LayerProfile]]]]


async def awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def lost_neighbour(exc: BaseException) -> str | None:
    """The dead neighbour a stage failure names (`errors.NeighbourLost`, possibly as a cause), if any."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short cause chain: the runner wraps the service's failure
        if seen is None:
            return None
        if isinstance(seen, NeighbourLost):
            return seen.peer_id
        seen = seen.__cause__
    return None
