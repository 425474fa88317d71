"""`JobSupervisor`: the one owner of a job's life on this peer.

Life cycle, one pass per poll: read the run's job (and its signer, the job's owner) -> read the job's
progress -> compute this peer's role (`role_for`, on the job's explicit assignment or the swarm's agreed
plan) -> decide whether it may start (`progress.may_start`: never an ended or superseded job, never a
pipeline that already moved without us) -> assemble the role's starting state (`resume`) -> run the
stage -> on a new plan, keep the stage's state and start over on the new role with it; on the owner's
stop, let the run finish as done; on a failure, keep the state and wait for the next plan (an agreed
plan routes around the fault) or end the job (an explicit assignment cannot).

Why one owner: the job loop used to live in the node and re-derive the role, restart from the initial
weights on every plan change, and forget in a restarted process that a job had ended. Here the life
cycle is one object over injected seams (DHT, plan source, runner factory, state source, suspect
reporter), unit-tested with in-memory fakes; `node.py` only wires the real ones. How one role runs
(start, watch, move in place, hand over, fail) is the `RoleRuns` half in `training.supervisor_run`.

A stage whose cluster the new plan did not change (same peers, order and layers: `continuity`) is not
stopped: the runner moves to the new role in place (`StageRunner.rebase`) and keeps training.

Known limits (see docs/elastic.md): the planner rarely keeps a cluster whole, so most re-plans still
restart every stage; state moves between peers only through a `StateSource`, which the
checkpoint helper's `fetch_state` provides; without one, a stage keeps what this process held and other
layers start from the initial weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from ravnest_p2p.discovery import dht_time
from ravnest_p2p.training.datasets import load_job_data, missing_parts
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.jobs import read_job_signed
from ravnest_p2p.training.placement import job_serving
from ravnest_p2p.training.progress import (
    ProgressStore,
    ProgressView,
    may_start,
    read_progress,
)
from ravnest_p2p.training.resume import (
    HeldState,
    StateSource,
)
from ravnest_p2p.training.role import StageRole, role_for
from ravnest_p2p.training.state_choice import StateChoice
from ravnest_p2p.training.supervisor_run import RoleRuns
from ravnest_p2p.training.supervisor_seams import (
    PlanSource,
    RunnerFactory,
    StageRun,
    SupervisorConfig,
    SuspectReporter,
    WorkloadFactory,
    rerun_allowed,
)
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import TaskOwner, run_in_compute_thread

__all__ = [
    "JobSupervisor",
    "PlanSource",
    "RunnerFactory",
    "StageRun",
    "SupervisorConfig",
    "SuspectReporter",
    "rerun_allowed",
]

logger = logging.getLogger(__name__)


class JobSupervisor(RoleRuns):
    """Drives this peer's part of the run's job across plans (see module docstring).

    Args:
        config: poll period, read deadline, drain grace.
        peer_id: this peer.
        dht: job, progress (and, through the runner, metrics) live here.
        plans: the membership's agreed plans (None: only explicit assignments run).
        workload: (job params, layer profile) of a job, for the membership to plan with.
        start_runner: builds the runner of a role from its starting state.
        state_source: fetches other peers' stage state and checkpoints (None: only our own).
        suspects: reports a dead neighbour to the membership (None: wait for the record to expire).
        alive: the peers believed alive now (None: every member of the previous plan).
        prepare: awaited before a role runs (e.g. learn its peers' addresses).
        on_state: told when this peer starts/stops training or drains (the announcer's record).
        serve_to: lets the new plan's peers fetch the state this peer held on an older plan of a job
            (job id, old epoch, peer ids): the hand-over server's allow-list.
        on_unfit: told when `unfit` changes (the announcer's record says which job this peer cannot
            serve and why).
    """

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        peer_id: str,
        dht: ProgressStore,
        plans: PlanSource | None,
        workload: WorkloadFactory | None,
        start_runner: RunnerFactory,
        state_source: StateSource | None = None,
        suspects: SuspectReporter | None = None,
        alive: Callable[[], Collection[str]] | None = None,
        prepare: Callable[[StageRole], Awaitable[None]] | None = None,
        on_state: Callable[[PeerState], None] | None = None,
        serve_to: Callable[[str, int, frozenset[str]], None] | None = None,
        on_unfit: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.peer_id = peer_id
        self.dht = dht
        self.plans = plans
        self.workload = workload
        self.start_runner = start_runner
        self.state_source = state_source
        self.suspects = suspects
        self.alive = alive
        self.prepare = prepare
        self.on_state = on_state
        self.serve_to = serve_to
        self.on_unfit = on_unfit
        # (job id, why) when this peer cannot serve the run's job: its model or data set is not installed,
        # or its data differs from the job's pinned digest; None: it can (or no job was read yet)
        self.unfit: tuple[str, str] | None = None
        self._fitness_of: str | None = None  # the job (as JSON) `unfit` was judged for
        self.finished: set[str] = set()  # jobs this peer will not run again
        self.role: StageRole | None = None
        self.runner: StageRun | None = None
        self.last_origin: dict[str, str] = {}  # where the last run's state came from, by layer span
        self.runs: list[StageRole] = []  # every role this supervisor started, in order (tests, status)
        self.moved_in_place = 0  # re-plans a running stage went through without stopping
        self._failed_epoch: dict[str, tuple[int, int]] = {}  # job -> (epoch it last failed on, failures)
        self._failed_at = -1e18  # loop time of the last failure
        self._ran: set[tuple[str, int]] = set()  # (job, epoch) this process started
        self._held: dict[str, HeldState] = {}  # job -> the stage state this process holds
        self._previous: dict[str, StageRole] = {}  # job -> the role it last ran (its plan and epoch)
        # job -> how far each (epoch, cluster) got, as last read while training: a first stage that
        # already runs the next plan no longer shows its old cluster's position in the progress
        self._positions: dict[str, dict[tuple[int, int], int]] = {}
        self._workload_job: str | None = None
        self._refused: tuple[str, int] | None = None
        self._announced: set[str] = set()  # jobs whose checkpoints on disk this process announced
        self._draining = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks = TaskOwner(f"supervisor-{peer_id[-6:]}")
        self._choice = StateChoice(peer_id, state_source, alive, config.replica_tie_micro_batches)

    # ----- the loop --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Supervise jobs until cancelled or drained."""
        while not self._draining.is_set():
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one bad pass (a DHT hiccup, a bad record) never ends the loop
                logger.warning("job supervision pass failed: %r", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._draining.wait(), self.config.poll_s)

    async def step(self) -> StageRole | None:
        """One pass: read the job, compute the role, and run it if allowed (returns the role run)."""
        found = await self._read(read_job_signed(self.dht))
        if found is None:
            return None
        owner, job = found
        if job.job_id in self.finished:
            return None
        await self._announce_checkpoints(job)
        progress = await self._read(read_progress(self.dht, job.job_id, owner_peer_id=owner))
        role = await self._role(job, progress)
        if role is None:
            if progress is not None and progress.finished:
                self.finished.add(job.job_id)
            return None
        await self._share_checkpoints(job, role)
        allowed, why = may_start(
            progress,
            epoch=role.epoch,
            holds_state=(job.job_id, role.epoch) in self._ran,
            now=dht_time(),
            idle_after_s=self.config.idle_after_s,
            cluster=role.cluster_index,
        )
        if not allowed:
            if progress is not None and progress.finished:
                self.finished.add(job.job_id)
            if self._refused != (job.job_id, role.epoch):
                self._refused = (job.job_id, role.epoch)
                logger.info("job %s: not running stage %d here: %s", job.job_id, role.stage_index, why)
            return None
        failed_epoch, failures = self._failed_epoch.get(job.job_id, (None, 0))
        if role.on_agreed_plan and not rerun_allowed(
            failed_epoch, role.epoch, failures=failures, retries_per_plan=self.config.retries_per_plan
        ):
            return None
        since_failure_s = asyncio.get_running_loop().time() - self._failed_at
        if role.epoch == failed_epoch and since_failure_s < self.config.retry_delay_s:
            return None  # a dead neighbour's re-plan usually comes within this delay: run there instead
        if role.epoch == failed_epoch and self.alive is not None:
            gone = set(role.peers) - set(self.alive()) - {self.peer_id}
            if gone:  # this pipeline cannot form again: wait for the plan that goes around them
                if self._refused != (job.job_id, -role.epoch):
                    self._refused = (job.job_id, -role.epoch)
                    logger.info(
                        "job %s: not retrying epoch %d without %s", job.job_id, role.epoch, sorted(gone)
                    )
                return None
        await self._run(job, owner, role, progress)
        return role

    async def _share_checkpoints(self, job: JobSpec, role: StageRole) -> None:
        """Serve this peer's checkpoints of the job to the plan's members before anything runs here: after
        a full restart, every peer may need pieces another peer wrote."""
        if self.state_source is None:
            return
        previous = self._previous.get(job.job_id)
        members = role.plan_peers | (previous.plan_peers if previous is not None else frozenset())
        try:
            await self.state_source.share_checkpoints(job.job_id, members | frozenset(job.state_readers))
        except Exception as exc:
            logger.info("job %s: sharing checkpoints failed: %r", job.job_id, exc)

    async def _announce_checkpoints(self, job: JobSpec) -> None:
        """Announce this peer's checkpoints of `job` once per process, before it plans the job: after a
        full restart every stage must choose its step from the same announcements."""
        if self.state_source is None or job.job_id in self._announced:
            return
        self._announced.add(job.job_id)
        try:
            await self.state_source.announce_checkpoints(job)
        except Exception as exc:
            logger.info("job %s: announcing checkpoints failed: %r", job.job_id, exc)

    async def _read(self, coro: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                return await coro
        except Exception as exc:
            logger.debug("reading the job state failed: %r", exc)
            return None

    async def _fit_for(self, job: JobSpec) -> bool:
        """Whether this peer can serve `job` (judged once per job; the record tells the swarm if not)."""
        if job.assignment is not None and self.peer_id not in {s.peer_id for c in job.assignment for s in c}:
            return True
        key = job.model_dump_json(exclude={"assignment"})
        if self._fitness_of != key:
            reason = missing_parts(job)
            if reason is None:
                try:  # every stage loads the data: load it now (cached) and check its digest
                    await run_in_compute_thread(load_job_data, job)
                except ValueError as exc:
                    reason = f"data: {exc}"
                except Exception as exc:  # a plugin's loader may raise anything: this peer just cannot serve
                    reason = f"data: {type(exc).__name__}: {exc}"
            self._fitness_of = key
            unfit = (job.job_id, reason[:200]) if reason is not None else None
            if unfit != self.unfit:
                self.unfit = unfit
                if unfit is not None:
                    logger.warning("job %s: this peer cannot serve it: %s", job.job_id, reason)
                if self.on_unfit is not None:
                    self.on_unfit()
        return self.unfit is None

    async def _role(self, job: JobSpec, progress: ProgressView | None) -> StageRole | None:
        if not await self._fit_for(job):
            return None
        if job.assignment is not None:
            return role_for(job, None, self.peer_id, progress=progress)
        if self.plans is None or self.workload is None:
            return None
        if self._workload_job != job.job_id:
            params, layers = await self.workload(job)
            self.plans.set_workload(job.job_id, params, layers, serving=job_serving(job))
            self._workload_job = job.job_id
        plan = self.plans.active_plan
        if plan is None or self.plans.active_workload != job.job_id:
            return None
        return role_for(job, plan, self.peer_id, progress=progress)

    def _set_state(self, state: PeerState) -> None:
        if self.on_state is not None:
            self.on_state(state)

    # ----- leaving -----------------------------------------------------------------------------------
    def held(self, job_id: str) -> HeldState | None:
        """The stage state this process holds for `job_id` (what a hand-over server serves)."""
        return self._held.get(job_id)

    async def drain(self, grace_s: float | None = None) -> None:
        """Leave gracefully: stop training, announce draining, keep the state for the new owners.

        Returns once the swarm's plan no longer names this peer, or after `grace_s` (default the
        config's `drain_grace_s`), whichever comes first; the caller then closes the peer.
        """
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        was_running = not self._idle.is_set()
        self._draining.set()
        self._set_state(PeerState.DRAINING)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # the watch loop hands the stage over within a poll (the runner captures its state when cancelled)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - loop.time()))
        if not was_running:
            return  # nothing of ours is in a pipeline now: nobody waits for our state
        role = self.role
        if role is None or not role.on_agreed_plan:
            return
        while loop.time() < deadline:
            plan = self.plans.active_plan if self.plans is not None else None
            if plan is None:
                return
            if plan.epoch != role.epoch and self.peer_id not in {
                p for c in plan.clusters for p in c.peer_ids
            }:
                return
            # a leaving peer's own membership may never activate the plan that leaves it out: the job's
            # progress tells when the new plan's pipelines train (they pulled their state before)
            progress = await self._read(read_progress(self.dht, role.job_id, owner_peer_id=None))
            if progress is not None and progress.epoch > role.epoch and progress.all_started:
                return
            await asyncio.sleep(min(0.5, self.config.poll_s))  # polls, bounded by the grace

    async def aclose(self) -> None:
        self._draining.set()
        await self._tasks.aclose()
