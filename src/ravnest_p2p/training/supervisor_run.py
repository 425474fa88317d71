"""How `JobSupervisor` runs one role (a mixin; `training.supervisor` owns the loop and the state).

One run: pull the role's starting state (`StateChoice`) unless the plan moves first, start its runner,
watch it (the owner's stop, the positions the progress shows, a plan change), move it in place when its
cluster is unchanged on the new plan (`continuity.continues_in_place`), keep its state when it ends or
is handed over, and on a failure either wait for the plan that routes around it or end the job.

Why separate: the supervisor's loop (read the job, compute the role, decide whether it may start) and
its leaving (`drain`) read apart from the life of a single run; the run half has its own module so each
stays small. The supervisor declares and owns every attribute listed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ravnest_p2p.planning import Plan
from ravnest_p2p.training.continuity import continues_in_place
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import (
    JobProgress,
    ProgressStore,
    ProgressView,
    publish_progress,
    read_progress,
)
from ravnest_p2p.training.resume import HeldState
from ravnest_p2p.training.role import StageRole, role_for
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.training.state_choice import StateChoice
from ravnest_p2p.training.supervisor_seams import (
    PlanSource,
    RunnerFactory,
    StageRun,
    SupervisorConfig,
    SuspectReporter,
    awaited,
    lost_neighbour,
)
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import TaskOwner

__all__ = ["RoleRuns"]

logger = logging.getLogger(__name__)


class RoleRuns:
    """The one-run half of `JobSupervisor` (the supervisor owns the state declared here)."""

    config: SupervisorConfig
    peer_id: str
    dht: ProgressStore
    plans: PlanSource | None
    start_runner: RunnerFactory
    suspects: SuspectReporter | None
    prepare: Callable[[StageRole], Awaitable[None]] | None
    serve_to: Callable[[str, int, frozenset[str]], None] | None
    finished: set[str]
    role: StageRole | None
    runner: StageRun | None
    last_origin: dict[str, str]
    runs: list[StageRole]
    moved_in_place: int
    _failed_epoch: dict[str, tuple[int, int]]
    _failed_at: float
    _ran: set[tuple[str, int]]
    _held: dict[str, HeldState]
    _previous: dict[str, StageRole]
    _positions: dict[str, dict[tuple[int, int], int]]
    _draining: asyncio.Event
    _idle: asyncio.Event
    _tasks: TaskOwner
    _choice: StateChoice

    async def _read(self, coro: Awaitable[Any]) -> Any:
        raise NotImplementedError

    def _set_state(self, state: PeerState) -> None:
        raise NotImplementedError

    async def _starting_state(
        self, job: JobSpec, role: StageRole, progress: ProgressView | None
    ) -> StageState | None:
        state, self.last_origin = await self._choice.starting_state(
            job,
            role,
            progress,
            held=self._held.get(role.job_id),
            previous=self._previous.get(role.job_id),
            positions=self._positions.get(role.job_id, {}),
        )
        return state

    async def _run(self, job: JobSpec, owner: str, role: StageRole, progress: ProgressView | None) -> None:
        logger.info(
            "job %s: stage %d of %d in cluster %d (epoch %d, from micro-batch %d)",
            job.job_id,
            role.stage_index,
            role.num_stages,
            role.cluster_index,
            role.epoch,
            role.data_start,
        )
        self.role = role
        self.runs.append(role)
        self._ran.add((job.job_id, role.epoch))
        self._set_state(PeerState.TRAINING)
        self._idle.clear()
        try:
            previous = self._previous.get(job.job_id)
            if self.serve_to is not None and previous is not None and previous.epoch != role.epoch:
                # the new owners pull from us (the old plan's peers may still ask too)
                self.serve_to(job.job_id, previous.epoch, previous.plan_peers | role.plan_peers)
            # learning addresses and pulling state may wait on a peer that died: not past a plan change
            prepared = await self._unless_plan_moves(role, self._prepare_state(job, role, progress))
            if prepared is None:
                logger.info("job %s: the plan moved while stage %d prepared", job.job_id, role.stage_index)
                return
            (state,) = prepared
            placed = job.model_copy(update={"assignment": role.assignment})
            runner = self.runner = self.start_runner(placed, role, state)
            if self._failed_epoch.get(job.job_id, (None, 0))[0] == role.epoch and hasattr(
                runner, "ready_timeout_s"
            ):
                # a retry on the plan that failed: a neighbour not back within seconds is not coming;
                # the stage names it (`NeighbourLost`) and the supervisor waits for the next plan
                runner.ready_timeout_s = self.config.retry_ready_s
            task = self._tasks.spawn(runner.run(), name=f"job-{job.job_id}-{role.epoch}")
            try:
                await self._watch(job, owner, role, runner, task)
            except asyncio.CancelledError:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                raise
        finally:
            self._idle.set()
            self._set_state(PeerState.READY if not self._draining.is_set() else PeerState.DRAINING)

    async def _prepare_state(
        self, job: JobSpec, role: StageRole, progress: ProgressView | None
    ) -> tuple[StageState | None]:
        if self.prepare is not None:
            await self.prepare(role)
        if progress is None and self._previous.get(role.job_id) is not None:
            # which replica is freshest comes from the progress: one more read if the first failed
            progress = await self._read(read_progress(self.dht, role.job_id, owner_peer_id=None))
        return (await self._starting_state(job, role, progress),)

    async def _unless_plan_moves(self, role: StageRole, coro: Awaitable[Any]) -> Any:
        """Await `coro`, or cancel it and return None once the agreed plan moves past `role`'s."""
        task = self._tasks.spawn(awaited(coro), name=f"prepare-{role.job_id}-{role.epoch}")
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.config.poll_s)
                plan = self.plans.active_plan if self.plans is not None else None
                moved = role.on_agreed_plan and plan is not None and plan.epoch != role.epoch
                if not task.done() and (moved or self._draining.is_set()):
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    return None
            return task.result()
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def _watch(
        self, job: JobSpec, owner: str, role: StageRole, runner: StageRun, task: asyncio.Task[Any]
    ) -> None:
        progress: ProgressView | None = None
        while not task.done():
            await asyncio.wait({task}, timeout=self.config.poll_s)
            if task.done():
                break
            plan = self.plans.active_plan if self.plans is not None else None
            moved = role.on_agreed_plan and plan is not None and plan.epoch != role.epoch
            if moved and not self._draining.is_set() and plan is not None:
                # a cluster the new plan did not change keeps training: the stage moves in place
                kept = await self._move_in_place(job, role, runner, plan, progress)
                if kept is not None:
                    role, moved = kept, False
            if self._draining.is_set() or moved:
                why = (
                    "draining"
                    if self._draining.is_set()
                    else f"plan moved to epoch {plan.epoch if plan else '?'}"
                )
                logger.info("job %s: %s; handing the stage over", job.job_id, why)
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                self._keep(role, runner)
                return
            progress = await self._read(read_progress(self.dht, job.job_id, owner_peer_id=owner))
            if progress is not None:
                seen = self._positions.setdefault(job.job_id, {})
                for key, position in progress.positions.items():
                    seen[key] = max(seen.get(key, 0), position)
            if progress is not None and progress.stopped and not runner.stop_requested.is_set():
                logger.info("job %s: stopped by its owner; finishing", job.job_id)
                runner.stop_requested.set()
        try:
            task.result()
        except Exception as exc:
            self._keep(role, runner)
            await self._on_failure(job, role, exc)
            return
        self._keep(role, runner)
        self.finished.add(job.job_id)
        logger.info("job %s finished here", job.job_id)

    async def _move_in_place(
        self, job: JobSpec, role: StageRole, runner: StageRun, plan: Plan, progress: ProgressView | None
    ) -> StageRole | None:
        """Move the running stage to its role on `plan` without stopping it, if its cluster is unchanged
        there (`continuity.continues_in_place`); returns the new role, or None for a hand-over."""
        rebase = getattr(runner, "rebase", None)
        if rebase is None or self.plans is None or self.plans.active_workload != job.job_id:
            return None
        new = role_for(job, plan, self.peer_id, progress=progress)
        if new is None or not continues_in_place(role, new):
            return None
        try:
            await rebase(new)
        except Exception as exc:  # e.g. the stage is still starting: hand it over the usual way
            logger.warning("job %s: moving stage %d in place failed: %r", job.job_id, role.stage_index, exc)
            return None
        logger.info(
            "job %s: plan moved to epoch %d; cluster unchanged, stage %d keeps training (cluster %d -> %d)",
            job.job_id,
            new.epoch,
            new.stage_index,
            role.cluster_index,
            new.cluster_index,
        )
        if self.serve_to is not None:  # the re-formed clusters' new owners may pull the old epoch's state
            self.serve_to(job.job_id, role.epoch, role.plan_peers | new.plan_peers)
        self.role = new
        self.runs.append(new)
        self.moved_in_place += 1
        self._ran.add((job.job_id, new.epoch))
        if self.prepare is not None:  # the new replicas' addresses, for the averaging rings
            self._tasks.spawn(awaited(self.prepare(new)), name=f"prepare-{job.job_id}-{new.epoch}")
        return new

    def _keep(self, role: StageRole, runner: StageRun) -> None:
        if runner.held_state is not None:
            self._held[role.job_id] = runner.held_state
        self._previous[role.job_id] = role

    async def _on_failure(self, job: JobSpec, role: StageRole, exc: BaseException) -> None:
        logger.error("job %s failed on this peer: %s", job.job_id, exc)
        lost = lost_neighbour(exc)
        if lost is not None and self.suspects is not None:
            # the membership verifies (pings) and opens a new epoch without waiting for the record to expire
            self.suspects.report_suspect(lost, f"stage {role.stage_index}: {exc}"[:200])
        if role.on_agreed_plan:
            # e.g. a pipeline partner died: the swarm re-plans without it, and we run again there
            failed_epoch, failures = self._failed_epoch.get(job.job_id, (None, 0))
            failures = failures + 1 if failed_epoch == role.epoch else 1
            self._failed_epoch[job.job_id] = (role.epoch, failures)
            self._failed_at = asyncio.get_running_loop().time()
            return
        # an explicit assignment cannot route around the fault: the job has ended (a peer restarted
        # with the same identity must not pick it back up)
        self.finished.add(job.job_id)
        record = JobProgress(
            job_id=job.job_id,
            peer_id=self.peer_id,
            epoch=role.epoch,
            cluster=role.cluster_index,
            num_clusters=role.num_clusters,
            ended=True,
            reason=f"stage {role.stage_index} of cluster {role.cluster_index} failed: {exc}"[:500],
        )
        await publish_progress(self.dht, record, final=True)
