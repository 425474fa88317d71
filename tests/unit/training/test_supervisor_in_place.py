"""The supervisor keeps an unchanged cluster's stage running through a re-plan; changed ones hand over."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ravnest_p2p.errors import RavnestError
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT, FakePlans, FakeRun, FakeRunners, FakeStateSource, make_plan
from .test_supervisor import JOB, publish, running, supervisor

pytestmark = pytest.mark.timeout(30)

A = [("me", 0, 1), ("b", 1, 3)]
B = [("c", 0, 1), ("d", 1, 3)]


class MovableRun(FakeRun):
    """A fake runner that can move to a new role in place (as `StageRunner.rebase`)."""

    def __init__(self, role: StageRole, state: StageState | None, *, tag: float) -> None:
        super().__init__(role, state, tag=tag)
        self.rebased: list[StageRole] = []
        self.refuse: BaseException | None = None
        self.ready_timeout_s = 120.0

    async def rebase(self, role: StageRole) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.rebased.append(role)
        self.role = role


class MovableRunners(FakeRunners):
    def __call__(self, job: Any, role: StageRole, state: StageState | None) -> MovableRun:
        run = MovableRun(role, state, tag=self.tag)
        self.made.append(run)
        return run


async def started(runners: FakeRunners, n: int) -> FakeRun:
    await wait_until(
        lambda: len(runners.made) > n and runners.made[n].started.is_set(), 5, message=f"run {n}"
    )
    return runners.made[n]


async def test_an_unchanged_cluster_keeps_its_runner_through_a_re_plan_and_a_changed_one_hands_over():
    dht, runners, plans = FakeDHT("me"), MovableRunners(tag=100.0), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, A, B)
    served: list[tuple[str, int, frozenset[str]]] = []
    source = FakeStateSource({"b": 200.0, "c": 300.0, "d": 400.0})
    sup, _ = supervisor(dht, runners, plans=plans, state_source=source, serve_to=lambda *a: served.append(a))
    async with running(sup):
        first = await started(runners, 0)
        assert (first.role.epoch, first.role.cluster_index) == (1, 0)
        # d died: the other cluster re-forms; ours is unchanged and becomes cluster 1
        plans.active_plan = make_plan(2, [("c", 0, 3)], A)
        await wait_until(lambda: first.rebased, 5, message="moved in place")
        await asyncio.sleep(0.1)  # several polls: nothing restarts
        assert len(runners.made) == 1
        assert not first.cancelled
        assert (first.role.epoch, first.role.cluster_index, first.role.num_clusters) == (2, 1, 2)
        assert sup.role is first.role
        assert sup.moved_in_place == 1
        assert [r.epoch for r in sup.runs] == [1, 2]
        # the re-formed cluster's new owner may pull our layers as they were on epoch 1
        assert served == [("j", 1, frozenset({"me", "b", "c", "d"}))]
        assert source.calls == []  # nothing was fetched: the stage kept its live state
        # another peer joins and a third cluster forms: still unchanged
        plans.active_plan = make_plan(3, [("c", 0, 3)], A, [("e", 0, 3)])
        await wait_until(lambda: len(first.rebased) == 2, 5, message="moved in place again")
        assert first.role.num_clusters == 3
        # now our cluster changes (b leaves): the stage is handed over as before
        plans.active_plan = make_plan(4, [("c", 0, 3)], [("me", 0, 3)], [("e", 0, 3)])
        second = await started(runners, 1)
    assert first.cancelled
    assert (second.role.epoch, second.role.first_layer, second.role.end_layer) == (4, 0, 3)
    # its own layers come back from what it held; layers 1-2 from b on epoch 3, the plan it last ran
    assert source.epochs == [3]
    assert source.calls[0][0] == "b"
    assert second.initial_state is not None


async def test_a_runner_that_cannot_move_in_place_is_handed_over_as_before():
    dht, runners, plans = FakeDHT("me"), MovableRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, A, B)
    sup, _ = supervisor(dht, runners, plans=plans)
    async with running(sup):
        first = await started(runners, 0)
        first.refuse = RavnestError("the stage is not running yet")
        plans.active_plan = make_plan(2, A, [("c", 0, 3)])
        second = await started(runners, 1)
    assert first.cancelled
    assert second.role.epoch == 2
    assert second.initial_state is first.held_state.state  # same stage: its whole state comes back

    # a runner without `rebase` (e.g. the synchronous modes) restarts too
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, A, B)
    sup, _ = supervisor(dht, runners, plans=plans)
    async with running(sup):
        first = await started(runners, 0)
        plans.active_plan = make_plan(2, A, [("c", 0, 3)])
        await started(runners, 1)
    assert first.cancelled


async def test_a_retry_on_a_failed_plan_waits_briefly_for_its_stages_and_not_at_all_for_a_gone_peer():
    dht, runners, plans = FakeDHT("me"), MovableRunners(), FakePlans()
    await publish(dht, JOB)
    plans.active_workload = "j"
    plans.active_plan = make_plan(1, A, B)
    alive = {"me", "b", "c", "d"}
    sup, _ = supervisor(dht, runners, plans=plans, alive=lambda: alive)
    async with running(sup):
        first = await started(runners, 0)
        assert first.ready_timeout_s == 120.0  # a first run: stages may still be fetching their state
        first.fail = RavnestError("b not ready")
        first.finish.set()
        retry = await started(runners, 1)
        assert retry.ready_timeout_s == sup.config.retry_ready_s
        assert retry.ready_timeout_s < 30
        alive.discard("b")  # b's record is gone: its pipeline cannot form on this plan
        retry.fail = RavnestError("b not ready")
        retry.finish.set()
        await asyncio.sleep(0.3)  # many polls past the retry delay: no retry without b
        assert len(runners.made) == 2
        plans.active_plan = make_plan(2, [("me", 0, 3)], B)
        third = await started(runners, 2)
    assert third.role.epoch == 2
    assert third.ready_timeout_s == 120.0
