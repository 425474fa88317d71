"""JobSupervisor's life cycle against in-memory fakes: read job -> role -> run -> hand over -> re-plan.

Where a new role's starting state comes from is in `test_supervisor_state.py`; both use the helpers here.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

from ravnest_p2p.errors import NeighbourLost, RavnestError
from ravnest_p2p.planning import JobParams
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.progress import PROGRESS_KEY, JobProgress, publish_progress, read_progress
from ravnest_p2p.training.runner import JOB_KEY
from ravnest_p2p.training.supervisor import JobSupervisor, SupervisorConfig
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT, FakePlans, FakeRunners, FakeStateSource, make_plan

pytestmark = pytest.mark.timeout(30)

JOB = JobSpec(
    job_id="j",
    model="mlp",
    dataset="synthetic_classification",
    dataset_config={"num_samples": 256, "in_features": 16, "num_classes": 4},
    model_params={"in_features": 16, "hidden_features": [32, 32], "out_features": 4},
    batch_size=16,
)
ASSIGNED = JOB.model_copy(
    update={
        "assignment": (
            (
                StagePlacement(peer_id="a", first_layer=0, end_layer=1),
                StagePlacement(peer_id="me", first_layer=1, end_layer=3),
            ),
        )
    }
)


async def _workload(job: JobSpec) -> tuple[JobParams, list[Any]]:
    return JobParams(micro_batch_size=job.batch_size), []


class Suspects:
    def __init__(self) -> None:
        self.reports: list[tuple[str, str]] = []

    def report_suspect(self, peer_id: str, reason: str) -> None:
        self.reports.append((peer_id, reason))


async def publish(dht: FakeDHT, job: JobSpec) -> FakeDHT:
    owner = dht.as_signer("owner")
    await owner.store_own(JOB_KEY, job.to_wire(), ttl_s=600)
    return owner


def supervisor(dht: FakeDHT, runners: FakeRunners, *, plans: FakePlans | None = None, **kw: Any):
    states: list[PeerState] = []
    sup = JobSupervisor(
        SupervisorConfig(poll_s=0.02, read_timeout_s=2.0, drain_grace_s=5.0, retry_delay_s=0.05),
        peer_id=dht.signer,
        dht=dht,
        plans=plans,
        workload=_workload,
        start_runner=runners,
        on_state=states.append,
        **kw,
    )
    return sup, states


@contextlib.asynccontextmanager
async def running(sup: JobSupervisor):
    task = asyncio.create_task(sup.run())
    try:
        yield task
    finally:
        await sup.aclose()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_assigned_job_runs_once_and_is_not_run_again():
    dht, runners = FakeDHT("me"), FakeRunners()
    await publish(dht, ASSIGNED)
    sup, states = supervisor(dht, runners)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        run = runners.made[0]
        assert run.role.stage_index == 1
        assert run.role.epoch == 0
        assert run.initial_state is None
        run.finish.set()
        await wait_until(lambda: "j" in sup.finished, 5, message="finished")
        await asyncio.sleep(0.1)  # several more polls: nothing new starts
    assert len(runners.made) == 1
    assert states[:1] == [PeerState.TRAINING]
    assert states[-1] == PeerState.READY
    assert await sup.step() is None


async def test_no_job_and_a_job_not_naming_us_start_nothing():
    dht, runners = FakeDHT("stranger"), FakeRunners()
    sup, _ = supervisor(dht, runners)
    assert await sup.step() is None
    await publish(dht, ASSIGNED)
    assert await sup.step() is None
    assert runners.made == []


async def test_a_restarted_peer_does_not_take_a_stage_of_a_pipeline_that_moved_on():
    """The bug: a peer SIGKILLed and restarted with the same identity sat in `training` on a dead job."""
    dht, runners = FakeDHT("me"), FakeRunners()
    await publish(dht, ASSIGNED)
    first_stage = dht.as_signer("a")
    await publish_progress(first_stage, JobProgress(job_id="j", peer_id="a", cluster=0, micro_batches=40))
    sup, states = supervisor(dht, runners)  # a fresh process: it never ran epoch 0 of this job
    assert await sup.step() is None
    assert runners.made == []
    assert PeerState.TRAINING not in states
    # once the survivors report the job ended, it is never picked up again
    await publish_progress(
        first_stage, JobProgress(job_id="j", peer_id="a", cluster=0, micro_batches=41, ended=True, reason="x")
    )
    assert await sup.step() is None
    assert "j" in sup.finished


async def test_a_failed_stage_on_an_assignment_ends_the_job_and_reports_the_lost_neighbour():
    dht, runners, suspects = FakeDHT("me"), FakeRunners(), Suspects()
    await publish(dht, ASSIGNED)
    sup, _ = supervisor(dht, runners, suspects=suspects)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        lost = NeighbourLost("a", "no answer for 6.0s")
        wrapped = RavnestError("stage failed")  # the runner wraps the service's failure, as a cause
        wrapped.__cause__ = lost
        runners.made[0].fail = wrapped
        runners.made[0].finish.set()
        await wait_until(lambda: "j" in sup.finished, 5, message="ended")
    assert suspects.reports
    assert suspects.reports[0][0] == "a"
    view = await read_progress(dht, "j", owner_peer_id="owner")
    assert view is not None
    assert view.ended
    assert "failed" in (view.reason or "")
    # a restarted process with the same identity reads that and stays out
    again, _ = supervisor(FakeDHT("me", dht.store), FakeRunners())
    assert await again.step() is None
    assert "j" in again.finished


async def test_a_failure_on_the_agreed_plan_is_retried_a_little_then_waits_for_the_next_plan():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 3)])
    sup, _ = supervisor(dht, runners, plans=plans)  # retries_per_plan=2 (the default)
    async with running(sup):
        for attempt in range(3):  # the first run and two retries on plan 1
            await wait_until(
                lambda n=attempt: len(runners.made) > n and runners.made[n].started.is_set(), 5, message="run"
            )
            runners.made[attempt].fail = RuntimeError("neighbour on the old plan")
            runners.made[attempt].finish.set()
        await asyncio.sleep(0.2)  # ten more polls on the same plan: no fourth run
        assert len(runners.made) == 3
        # each retry resumes what the failed run held (same plan, same stage)
        assert runners.made[1].initial_state is runners.made[0].held_state.state
        plans.active_plan = make_plan(2, [("me", 0, 3)])
        await wait_until(lambda: len(runners.made) == 4, 5, message="run on the next plan")
    assert runners.made[3].role.epoch == 2
    assert runners.made[3].initial_state is runners.made[2].held_state.state
    assert "j" not in sup.finished


async def test_the_owners_stop_reaches_the_runner_and_stops_nothing_else():
    dht, runners = FakeDHT("me"), FakeRunners()
    owner = await publish(dht, ASSIGNED)
    sup, _ = supervisor(dht, runners)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        # a stop signed by someone else than the job's owner is ignored
        await publish_progress(dht.as_signer("a"), JobProgress(job_id="j", peer_id="a", stopped=True))
        await asyncio.sleep(0.1)
        assert not runners.made[0].stop_requested.is_set()
        await publish_progress(owner, JobProgress(job_id="j", peer_id="owner", stopped=True, ended=True))
        await wait_until(lambda: "j" in sup.finished, 5, message="stopped job finished")
    assert runners.made[0].stop_requested.is_set()
    assert PROGRESS_KEY in dht.store


async def test_drain_hands_the_stage_over_and_returns_when_the_plan_moves_on_without_us():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 1), ("b", 1, 3)])
    sup, states = supervisor(dht, runners, plans=plans)
    async with running(sup) as task:
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        drain = asyncio.create_task(sup.drain(grace_s=5.0))
        await wait_until(lambda: runners.made[0].cancelled, 5, message="run handed over")
        assert sup.held("j") is runners.made[0].held_state  # kept for the new owners
        assert not drain.done()  # still serving: the plan still names us
        plans.active_plan = make_plan(2, [("b", 0, 3)])
        await asyncio.wait_for(drain, 5)
        await asyncio.wait_for(task, 5)  # the loop ends after a drain
    assert PeerState.DRAINING in states
    assert len(runners.made) == 1


async def test_an_idle_peer_drains_at_once():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, ASSIGNED)
    sup, states = supervisor(dht, runners, plans=plans)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        runners.made[0].finish.set()
        await wait_until(lambda: "j" in sup.finished, 5, message="finished")
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(sup.drain(grace_s=30.0), 5)  # nothing to hand over: no grace spent
        assert asyncio.get_running_loop().time() - started < 2.0
    assert states[-1] == PeerState.DRAINING


async def test_a_preparation_stuck_on_a_dead_peer_is_abandoned_when_the_plan_moves():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 1), ("dead", 1, 3)])
    prepared: list[int] = []

    async def prepare(role: Any) -> None:
        prepared.append(role.epoch)
        if role.epoch == 1:
            await asyncio.Event().wait()  # e.g. learning the addresses of a peer that died

    sup, _ = supervisor(dht, runners, plans=plans, prepare=prepare)
    async with running(sup):
        await wait_until(lambda: prepared == [1], 5, message="preparing plan 1")
        plans.active_plan = make_plan(2, [("me", 0, 3)])
        await wait_until(lambda: len(runners.made) == 1, 5, message="a run on plan 2")
    assert prepared == [1, 2]
    assert runners.made[0].role.epoch == 2


async def test_drain_ends_when_the_job_trains_on_a_plan_our_own_membership_never_activated():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 1), ("b", 1, 3)])
    sup, _ = supervisor(dht, runners, plans=plans)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
        drain = asyncio.create_task(sup.drain(grace_s=10.0))
        await wait_until(lambda: runners.made[0].cancelled, 5, message="handed over")
        await asyncio.sleep(0.1)
        assert not drain.done()  # our plan (epoch 1) still names us
        # the others train on epoch 2 (they pulled our state first): nothing more to serve
        await publish_progress(
            dht.as_signer("b"),
            JobProgress(job_id="j", peer_id="b", epoch=2, cluster=0, epoch_start=40, micro_batches=44),
        )
        await asyncio.wait_for(drain, 5)


async def test_every_peer_restarted_may_start_the_job_again_once_its_progress_is_idle():
    """A full restart: nobody holds epoch 0's state, so nobody would ever start it again."""
    dht, runners = FakeDHT("me"), FakeRunners()
    await publish(dht, ASSIGNED)
    first_stage = dht.as_signer("a")
    await publish_progress(first_stage, JobProgress(job_id="j", peer_id="a", cluster=0, micro_batches=40))
    source = FakeStateSource({}, checkpoint_tag=700.0)
    sup, _ = supervisor(dht, runners, state_source=source)
    assert await sup.step() is None  # the record is fresh: a pipeline may still train without us
    progress = await read_progress(dht, "j", owner_peer_id=None)
    assert progress is not None
    assert progress.updated_at > 0
    idle, _ = supervisor(dht, runners, state_source=source)
    idle.config = idle.config.model_copy(update={"idle_after_s": 1e-3})
    await asyncio.sleep(0.01)  # the record ages past the (tiny) idle bound
    async with running(idle):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
    run = runners.made[0]
    assert run.role.data_start == 40
    # before anything ran, this peer served its checkpoints to the plan's members
    assert source.shared[0] == ("j", {"a", "me"})
    # nobody serves the layers any more: they come from the newest step complete across the model
    assert source.checkpoint_calls == [(1, 3)]
    (query,) = source.checkpoint_queries
    assert (query.job, query.num_layers, query.members) == (ASSIGNED, 3, {"a", "me"})
    assert idle.last_origin == {"1-3": "checkpoint"}
    assert torch.equal(run.initial_state.tensors["2.weight"], torch.full((2,), 702.0))
