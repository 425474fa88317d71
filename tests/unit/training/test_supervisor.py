"""JobSupervisor's life cycle against in-memory fakes: read job -> role -> run -> hand over -> re-plan."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch

from ravnest_p2p.errors import NeighbourLost, RavnestError
from ravnest_p2p.planning import JobParams
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.placement import assignment_from_plan
from ravnest_p2p.training.progress import PROGRESS_KEY, JobProgress, publish_progress, read_progress
from ravnest_p2p.training.resume import (
    CheckpointQuery,
    Segment,
    freshest_first,
    gather_state,
    state_sources,
)
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.runner import JOB_KEY
from ravnest_p2p.training.supervisor import JobSupervisor, SupervisorConfig
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT, FakePlans, FakeRunners, FakeStateSource, layer_state, make_plan

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


async def trained_on_epoch_2() -> tuple[FakeDHT, FakeRunners, FakePlans]:
    """Our DHT, runners and plans for job j, whose two clusters (first stages a and c) reached micro-batch
    50 on plan epoch 2, which we never ran."""
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    for peer, cluster in (("a", 0), ("c", 1)):
        await publish_progress(
            dht.as_signer(peer),
            JobProgress(job_id="j", peer_id=peer, epoch=2, cluster=cluster, micro_batches=50),
        )
    plans.active_workload = "j"
    return dht, runners, plans


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


async def test_a_new_plan_hands_the_stage_over_from_the_right_sources():
    dht, runners, plans = FakeDHT("me"), FakeRunners(tag=100.0), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 2), ("b", 2, 3)], [("c", 0, 1), ("d", 1, 3)])
    source = FakeStateSource({"c": 300.0, "d": 400.0, "b": 200.0})
    alive = {"me", "c", "d"}  # b died
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: alive)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run 1")
        assert plans.workloads == ["j"]
        first = runners.made[0]
        assert (first.role.epoch, first.role.first_layer, first.role.end_layer) == (1, 0, 2)
        assert first.initial_state is None
        assert source.calls == []
        # b is lost: the swarm re-plans; we now own layers [0, 3) of cluster 0
        plans.active_plan = make_plan(2, [("me", 0, 3)], [("c", 0, 1), ("d", 1, 3)])
        await wait_until(
            lambda: len(runners.made) == 2 and runners.made[1].started.is_set(), 5, message="run 2"
        )
    assert first.cancelled
    second = runners.made[1]
    assert (second.role.epoch, second.role.first_layer, second.role.end_layer) == (2, 0, 3)
    # layers 0-1: our own copy (no call); layer 2: b is dead, so its replica in cluster 1 (d)
    assert [(p, f, e) for p, f, e, _ in source.calls] == [("d", 2, 3)]
    assert source.calls[0][3] == {"me", "b", "c", "d"}  # only members of the previous plan
    assert source.epochs == [1]  # d's state as it held it on the previous plan
    tensors = second.initial_state.tensors
    assert torch.equal(tensors["0.weight"], torch.full((2,), 100.0))  # ours
    assert torch.equal(tensors["2.weight"], torch.full((2,), 402.0))  # d's
    assert sup.last_origin == {"0-1": "me", "1-2": "me", "2-3": "d"}


async def test_an_unchanged_stage_resumes_its_whole_state_and_lost_layers_fall_back_to_a_checkpoint():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("me", 0, 1), ("b", 1, 3)])
    source = FakeStateSource({}, checkpoint_tag=700.0)
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: {"me", "c"})
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run 1")
        plans.active_plan = make_plan(2, [("me", 0, 1), ("c", 1, 3)])
        await wait_until(lambda: len(runners.made) == 2, 5, message="run 2")
    second = runners.made[1]
    assert (
        second.initial_state is runners.made[0].held_state.state
    )  # same range: the whole state, optimizer too
    assert sup.last_origin == {"0-1": "self (full)"}
    # c, the new owner of [1, 3), finds no live previous owner (b died, one cluster): the checkpoint
    role = role_for(JOB, plans.active_plan, "c", num_train_samples=204)
    assert role is not None
    previous = assignment_from_plan(make_plan(1, [("me", 0, 1), ("b", 1, 3)]))
    segments = state_sources(previous, role, alive={"me", "c"})
    assert segments == [Segment(1, 3, ())]
    query = CheckpointQuery.of(JOB, role, frozenset({"me", "b"}))
    state, origin = await gather_state(
        role,
        segments,
        held=None,
        source=source,
        allowed=frozenset({"me", "b"}),
        previous_epoch=1,
        checkpoints=query,
    )
    assert origin == {"1-3": "checkpoint"}
    assert source.checkpoint_calls == [(1, 3)]
    # a step counts when complete across the whole model; the current and previous plans' peers count
    assert (query.num_layers, query.members) == (3, {"me", "b", "c"})
    assert state is not None
    assert torch.equal(state.tensors["2.weight"], torch.full((2,), 702.0))
    # and with no checkpoint either, the layers start from the initial weights (no state at all)
    state, origin = await gather_state(
        role, segments, held=None, source=None, allowed=frozenset(), previous_epoch=1
    )
    assert state is None
    assert origin == {"1-3": "initial weights"}


async def test_layers_whose_holders_never_ran_the_previous_plan_come_from_their_newest_state():
    # a lab kill's split vote: epoch 3's holder of layers [1, 3) never activated epoch 3 (it still
    # trained them on epoch 2); asked for epoch 3 it has nothing, asked for its newest it has them, which
    # beats an older checkpoint and the initial weights (0.06 -> 0.29 held-out loss on that lab run)
    source = FakeStateSource({"b": 2.0}, checkpoint_tag=7.0, held_epochs={"b": {2}})
    role = role_for(JOB, make_plan(4, [("me", 0, 1), ("c", 1, 3)]), "c", num_train_samples=204)
    assert role is not None
    previous = assignment_from_plan(make_plan(3, [("me", 0, 1), ("b", 1, 3)]))
    segments = state_sources(previous, role, alive={"me", "b"})
    assert segments == [Segment(1, 3, ("b",))]
    allowed = frozenset({"me", "b"})
    state, origin = await gather_state(
        role,
        segments,
        held=None,
        source=source,
        allowed=allowed,
        previous_epoch=3,
        checkpoints=CheckpointQuery.of(JOB, role, allowed),
    )
    assert origin == {"1-3": "b (newest)"}
    assert source.epochs == [3, None]
    assert source.checkpoint_calls == []
    assert state is not None
    assert torch.equal(state.tensors["2.weight"], layer_state(2.0, 1, 3).tensors["2.weight"])


def test_sources_prefer_our_copy_then_the_same_cluster_then_replicas_and_skip_the_dead():
    previous = assignment_from_plan(
        make_plan(1, [("a", 0, 1), ("b", 1, 3)], [("c", 0, 2), ("d", 2, 3)], [("e", 0, 3)])
    )
    role = role_for(JOB, make_plan(2, [("x", 0, 3)], [("c", 0, 3)]), "c", num_train_samples=204)
    assert role is not None
    assert role.cluster_index == 1
    # ours first (c held 0-1 in cluster 1), then the same cluster index's owner, then clusters 0 and 2
    assert state_sources(previous, role, alive={"a", "b", "d", "e"}) == [
        Segment(0, 1, ("c", "a", "e")),
        Segment(1, 2, ("c", "b", "e")),
        Segment(2, 3, ("d", "b", "e")),
    ]
    assert state_sources(previous, role, alive={"a", "e"}) == [  # b and d died
        Segment(0, 1, ("c", "a", "e")),
        Segment(1, 2, ("c", "e")),
        Segment(2, 3, ("e",)),
    ]


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


def test_sources_follow_the_freshest_cluster_so_a_stage_is_not_stitched_from_stale_replicas():
    previous = assignment_from_plan(make_plan(1, [("a", 0, 1), ("b", 1, 3)], [("c", 0, 2), ("d", 2, 3)]))
    role = role_for(JOB, make_plan(2, [("a", 0, 3)]), "a", num_train_samples=204)
    assert role is not None
    # cluster 0 broke at micro-batch 64 (b died); cluster 1 trained on to 320
    order = freshest_first({(1, 0): 64, (1, 1): 320, (0, 0): 999}, epoch=1, num_clusters=2, prefer=0)
    assert order == [1, 0]
    assert state_sources(previous, role, alive={"a", "c", "d"}, cluster_order=order) == [
        Segment(0, 1, ("c", "a")),  # c's fresh copy, not our own stale one
        Segment(1, 2, ("c",)),  # b died
        Segment(2, 3, ("d",)),
    ]
    assert freshest_first({}, epoch=1, num_clusters=2, prefer=0) is None
    # a cluster whose first stage already reports a newer plan: no ranking (the default order instead)
    assert freshest_first({(1, 1): 5, (1, 2): 7}, epoch=1, num_clusters=3, prefer=2) is None
    assert freshest_first({(1, 0): 5, (1, 1): 5, (1, 2): 5}, epoch=1, num_clusters=3, prefer=2) == [2, 0, 1]
    # near-tied replicas: every peer ranks them by index, whatever its own cluster and its read's moment
    racing = {(1, 0): 300, (1, 1): 330, (1, 2): 100}
    for prefer in (0, 1, 2):
        order = freshest_first(racing, epoch=1, num_clusters=3, prefer=prefer, tie_micro_batches=64)
        assert order == [0, 1, 2]
    assert freshest_first(racing, epoch=1, num_clusters=3, prefer=2, tie_micro_batches=16) == [1, 0, 2]


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


async def test_the_freshest_replica_is_remembered_when_its_first_stage_already_runs_the_next_plan():
    """The lab bug: the healthy cluster's first stage started the new plan first, so its old position
    vanished from the progress; the stalled cluster ranked first and a stage was stitched from it."""
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, [("a", 0, 2), ("b", 2, 3)], [("me", 0, 2), ("x", 2, 3)])
    source = FakeStateSource({"a": 300.0, "b": 200.0})
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: {"me", "a", "b"})
    first_stage_a = dht.as_signer("a")
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run 1")
        await publish_progress(
            first_stage_a, JobProgress(job_id="j", peer_id="a", epoch=1, cluster=0, micro_batches=100)
        )
        await publish_progress(
            dht, JobProgress(job_id="j", peer_id="me", epoch=1, cluster=1, micro_batches=40)
        )
        await wait_until(lambda: sup._positions.get("j", {}).get((1, 0)) == 100, 5, message="positions read")
        # x died; a already runs the next plan, and its record no longer shows how far cluster 0 got
        await publish_progress(
            first_stage_a,
            JobProgress(job_id="j", peer_id="a", epoch=2, cluster=0, epoch_start=100, micro_batches=100),
        )
        plans.active_plan = make_plan(2, [("a", 0, 2), ("b", 2, 3)], [("me", 0, 3)])
        await wait_until(lambda: len(runners.made) == 2, 5, message="run 2")
    # every layer from the furthest replica (cluster 0), none of our stale copy
    assert sup.last_origin == {"0-2": "a", "2-3": "b"}
    assert torch.equal(runners.made[1].initial_state.tensors["0.weight"], torch.full((2,), 300.0))


async def test_a_peer_joining_mid_job_takes_its_layers_from_their_holder_on_the_previous_plan():
    dht, runners, plans = await trained_on_epoch_2()
    # the plan that adds us (epoch 3): we never ran the job, our cluster-mates hold other layers
    plans.active_plan = make_plan(3, [("a", 0, 2), ("b", 2, 3)], [("c", 0, 2), ("me", 2, 3)])
    source = FakeStateSource({"b": 200.0}, checkpoint_tag=700.0)
    alive = {"me", "a", "b", "c"}
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: alive)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
    run = runners.made[0]
    assert run.role.data_start == 50
    assert [(p, f, e) for p, f, e, _ in source.calls] == [("b", 2, 3)]
    assert source.calls[0][3] == {"a", "b", "c"}  # only the plan's other members
    assert source.epochs == [2]  # b's layers as it held them on the previous plan
    assert sup.last_origin == {"2-3": "b"}
    assert torch.equal(run.initial_state.tensors["2.weight"], torch.full((2,), 202.0))


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


async def test_a_plan_only_this_peer_ran_is_not_a_source_its_layers_come_from_the_plan_that_trained():
    """A joiner alone activated epoch 3 (the others disagreed on it and stayed on epoch 2): nobody served
    it, it held initial weights that never took a step, and no cluster published progress on epoch 3.
    On epoch 4 it must not hand itself that state, nor ask epoch 3's "holders": its layers come from
    their holders on epoch 2 (a lab join resumed from initial weights that way: loss 0.09 -> 0.76)."""
    dht, runners, plans = await trained_on_epoch_2()
    plans.active_plan = make_plan(3, [("a", 0, 2), ("b", 2, 3)], [("c", 0, 2), ("me", 2, 3)])
    source = FakeStateSource({}, checkpoint_tag=None)  # nobody serves the joiner on epoch 3
    alive = {"me", "a", "b", "c"}
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: alive)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run 1")
        assert sup.last_origin == {"2-3": "initial weights"}
        source.tags = {"a": 100.0, "b": 200.0, "c": 300.0}
        plans.active_plan = make_plan(4, [("a", 0, 2), ("b", 2, 3)], [("c", 0, 1), ("me", 1, 3)])
        await wait_until(
            lambda: len(runners.made) == 2 and runners.made[1].started.is_set(), 5, message="run 2"
        )
    run = runners.made[1]
    assert (run.role.epoch, run.role.first_layer, run.role.end_layer) == (4, 1, 3)
    # from the epoch-2 holders of layers 1-3 in the other cluster, not from our own untrained copy
    assert source.epochs[-1] == 2
    assert sup.last_origin == {"1-2": "a", "2-3": "b"}
    assert torch.equal(run.initial_state.tensors["2.weight"], torch.full((2,), 202.0))


async def test_a_newcomer_asks_every_live_member_when_the_plans_holders_of_its_layers_held_others_before():
    """The plan's other holder of our layers (b) re-formed: on the earlier plan it held other layers and
    answers nothing. Another member (a, now on layers 0-2) held them there: it is asked next, before
    any checkpoint or the initial weights."""
    dht, runners, plans = await trained_on_epoch_2()
    plans.active_plan = make_plan(3, [("a", 0, 2), ("b", 2, 3)], [("c", 0, 2), ("me", 2, 3)])
    source = FakeStateSource({"a": 100.0}, checkpoint_tag=700.0)
    alive = {"me", "a", "b", "c"}
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: alive)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
    assert [(p, f, e) for p, f, e, _ in source.calls] == [("b", 2, 3), ("a", 2, 3)]
    assert source.epochs == [2, 2]
    assert source.checkpoint_calls == []
    assert sup.last_origin == {"2-3": "a"}


async def test_an_answer_without_tensors_is_not_taken_while_another_holder_has_them():
    """b holds none of our layers on the earlier plan and answers an empty state: taking it left a
    joiner's layers at the initial weights (held-out loss 1.91 on the lab). a's tensors win."""
    dht, runners, plans = await trained_on_epoch_2()
    plans.active_plan = make_plan(3, [("a", 0, 2), ("b", 2, 3)], [("c", 0, 2), ("me", 2, 3)])

    class EmptyFromB(FakeStateSource):
        async def fetch(self, peer_id: str, **kw: Any) -> Any:
            state = await super().fetch(peer_id, **kw)
            return state.subset([]) if peer_id == "b" and state is not None else state

    source = EmptyFromB({"a": 100.0, "b": 200.0})
    alive = {"me", "a", "b", "c"}
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, alive=lambda: alive)
    async with running(sup):
        await wait_until(lambda: runners.made and runners.made[0].started.is_set(), 5, message="run")
    assert [p for p, *_ in source.calls] == ["b", "a"]
    assert sup.last_origin == {"2-3": "a"}
    assert torch.equal(runners.made[0].initial_state.tensors["2.weight"], torch.full((2,), 102.0))
