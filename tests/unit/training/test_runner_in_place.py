"""`StageRunner.rebase`: a running cluster moves to a new plan without stopping (in-memory transport)."""

from __future__ import annotations

import asyncio

import pytest

from ravnest_p2p.training.handover import HandoverServer
from ravnest_p2p.training.progress import read_progress
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.runner import StageRunner
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT, make_plan
from .test_supervisor_runner import BASE

pytestmark = pytest.mark.timeout(60)

P = [("p0", 0, 1), ("p1", 1, 3)]


class FakeReplicas:
    """Stands in for `ReplicaAverager` (its rings need the real transport): records what it is told."""

    made: list[FakeReplicas] = []
    outer = None  # plain averaging (no outer optimizer state to move)

    def __init__(self, rpc, executor, shard_map, *, final_step, **kw) -> None:
        self.shard_map, self.final_step = shard_map, final_step
        self.steps: list[int] = []
        self.closed = False
        self.rounds: list = []
        self.bytes_sent = 0
        self.last_round_participants = None
        FakeReplicas.made.append(self)

    async def start(self) -> None:
        pass

    def rebase(self, shard_map, *, final_step, link_rates=None) -> None:
        self.shard_map, self.final_step = shard_map, final_step

    async def on_step(self, step: int) -> None:
        self.steps.append(step)

    async def aclose(self) -> None:
        self.closed = True


Q = [("q0", 0, 1), ("q1", 1, 3)]


@pytest.mark.timeout(180)  # three plans' training on one event loop: 2-3 s idle, minutes on a busy host
async def test_a_cluster_keeps_training_through_two_re_plans_and_finishes_the_new_plans_data(monkeypatch):
    monkeypatch.setattr("ravnest_p2p.training.runner_moves.ReplicaAverager", FakeReplicas)
    FakeReplicas.made = []
    # enough data per plan that the test's moves land while there is some left (a late move is refused:
    # test_runner_feed.py)
    job = BASE.model_copy(update={"assignment": None, "num_epochs": 16, "averaging_period_steps": 4})
    net, dht = FakeNetwork(), FakeDHT("p0")
    plan1 = make_plan(1, P, Q, [("r0", 0, 3)])
    plan2 = make_plan(2, Q, P)  # r left; p is now cluster 1 of 2
    plan3 = make_plan(3, P)  # q left too: p is the only cluster
    finals = [role_for(job, plan, "p0").final_step for plan in (plan1, plan2, plan3)]
    assert finals[0] < finals[1] < finals[2]  # fewer clusters: each trains on more of the data
    # only cluster p runs (the replicas are fakes: nobody else needs to train)
    runners = [
        StageRunner(
            RpcEndpoint(net.create(p), "t"),
            dht if p == "p0" else dht.as_signer(p),
            job,
            role_for(job, plan1, p),
            metrics_period_s=0.05,
        )
        for p in ("p0", "p1")
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    try:
        await _switch_twice(job, runners, tasks, dht, (plan1, plan2, plan3), finals)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _switch_twice(job, runners, tasks, dht, plans, finals) -> None:
    _, plan2, plan3 = plans
    first, last = runners

    await wait_until(
        lambda: (
            any(t.done() for t in tasks) or (first.service is not None and first.service.stats.completed >= 6)
        ),
        30,
        message="training",
    )
    for task in tasks:
        if task.done():
            task.result()  # a runner that failed to start: its error, not a timeout
            raise AssertionError("a runner ended before the first move")
    assert first.role.final_step == finals[0]
    replicas = first.replicas
    assert isinstance(replicas, FakeReplicas)
    # the stages see the new plan at different moments
    await last.rebase(role_for(job, plan2, "p1"))
    await first.rebase(role_for(job, plan2, "p0"))
    assert first.replicas is replicas  # the same averager, on the new plan's rings
    assert replicas.shard_map.epoch == 2
    assert replicas.final_step > 0
    assert first.role.final_step == finals[1]
    assert first.role.cluster_index == 1

    async def started_on_epoch_2() -> bool:  # keyed by the new (epoch, cluster), started at once
        view = await read_progress(dht, job.job_id, owner_peer_id=None)
        return view is not None and (2, 1) in view.started

    await wait_until(started_on_epoch_2, 30, message="progress of epoch 2")
    steps_before = first.service.executor.num_steps
    await first.rebase(role_for(job, plan3, "p0"))
    await last.rebase(role_for(job, plan3, "p1"))
    assert first.replicas is None  # no other cluster to average with
    assert replicas.closed
    assert first.role.final_step == finals[2]
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert all(m.done for m in results)
    assert all(m.epoch == 3 for m in results)
    assert first.service.executor.num_steps > steps_before
    assert first.service.stats.dropped == 0
    assert last.service.stats.refused == 0
    view = await read_progress(dht, job.job_id, owner_peer_id=None)
    assert view is not None
    assert view.epoch == 3
    assert view.done
    assert view.micro_batches == finals[2]  # its own position carried over, up to the new plan's last step
    assert (3, 0) in view.started
    # the hand-over server serves epoch 2 as a snapshot taken at the switch (the new plan's owners may
    # pull it while the stage trains on) and epoch 3 live
    assert HandoverServer.of(first.rpc).published(job.job_id) == [2, 3]
