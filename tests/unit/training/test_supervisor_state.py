"""Where a JobSupervisor's new role gets its starting state (its own copy, the previous holders, replicas,
their newest state, checkpoints), on a re-plan or a join; the fakes and helpers of `test_supervisor.py`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ravnest_p2p.training.placement import assignment_from_plan
from ravnest_p2p.training.progress import JobProgress, publish_progress
from ravnest_p2p.training.resume import (
    CheckpointQuery,
    Segment,
    freshest_first,
    gather_state,
    state_sources,
)
from ravnest_p2p.training.role import role_for
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT, FakePlans, FakeRunners, FakeStateSource, layer_state, make_plan
from .test_supervisor import JOB, publish, running, supervisor

pytestmark = pytest.mark.timeout(30)


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
