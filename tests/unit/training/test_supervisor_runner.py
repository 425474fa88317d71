"""The runner a supervisor drives, over the in-memory transport: resume from held state, stop conditions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.progress import ProgressView, read_progress
from ravnest_p2p.training.role import StageRole, role_for
from ravnest_p2p.training.runner import StageRunner, cluster_batches
from ravnest_p2p.training.stages import load_dataset, train_batches
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils import wait_until

from ._fakes import FakeDHT

pytestmark = pytest.mark.timeout(60)

TWO_STAGES = (
    (
        StagePlacement(peer_id="p0", first_layer=0, end_layer=1),
        StagePlacement(peer_id="p1", first_layer=1, end_layer=3),
    ),
)
BASE = JobSpec(
    assignment=TWO_STAGES,
    job_id="r",
    model="mlp",
    dataset="synthetic_classification",
    dataset_config={"num_samples": 256, "in_features": 16, "num_classes": 4},
    model_params={"in_features": 16, "hidden_features": [32, 32], "out_features": 4},
    batch_size=16,
    num_epochs=10,
    optimizer=OptimizerConfig(name="adam", lr=1e-2),
)


def roles(job: JobSpec, progress: ProgressView | None = None) -> list[StageRole]:
    out = [role_for(job, None, p, progress=progress) for p in ("p0", "p1")]
    assert all(r is not None for r in out)
    return out  # type: ignore[return-value]


async def train(job: JobSpec, *, progress: ProgressView | None = None, states=None, dht=None):
    net = FakeNetwork()
    runners = [
        StageRunner(
            RpcEndpoint(net.create(role.peer_id), "t"),
            dht,
            job,
            role,
            initial_state=states[i] if states else None,
            metrics_period_s=0.05,
        )
        for i, role in enumerate(roles(job, progress))
    ]
    results = await asyncio.gather(*(r.run() for r in runners))
    return runners, results


def test_cluster_batches_resume_where_a_run_left_off_and_wrap_epochs():
    train_set, _ = load_dataset(BASE)
    job = BASE.model_copy(update={"num_epochs": 2})
    whole = list(train_batches(job, train_set, cluster_index=1, num_clusters=2))
    mine = list(cluster_batches(job, train_set, cluster_index=1, num_clusters=2, start=0, stop=len(whole)))
    tail = list(cluster_batches(job, train_set, cluster_index=1, num_clusters=2, start=5, stop=len(whole)))
    assert len(mine) == len(whole)
    assert len(tail) == len(whole) - 5
    assert all(torch.equal(a[0], b[0]) for a, b in zip(mine, whole, strict=True))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(tail, whole[5:], strict=True))
    endless = cluster_batches(job, train_set, cluster_index=0, num_clusters=1, start=0, stop=None)
    assert sum(1 for _, _ in zip(range(3 * len(whole)), endless, strict=False)) == 3 * len(whole)


async def test_a_run_resumed_from_held_state_continues_instead_of_starting_over():
    first_half = BASE.model_copy(update={"max_steps": 20})
    runners, _ = await train(first_half)
    held = [r.held_state for r in runners]
    assert all(h is not None and h.state.meta is not None and h.state.meta.num_steps == 20 for h in held)
    states = [h.state for h in held if h is not None]
    loss_at_20 = runners[0].eval_loss
    at_20 = ProgressView(job_id="r", epoch=0, micro_batches=20, optimizer_steps=20)
    # resumed with nothing left to train: the very same model (evaluation is deterministic)
    same, _ = await train(first_half, progress=at_20, states=states)
    assert [r.restored for r in same] == ["full", "full"]
    assert same[0].eval_loss == pytest.approx(loss_at_20, rel=1e-6)
    _, initial = await train(BASE.model_copy(update={"max_steps": 1}))  # about where a restart would be
    assert initial[0].eval_loss is not None
    assert loss_at_20 < 0.5 * initial[0].eval_loss
    # resumed for 20 more: steps, data position and progress continue from 20
    dht = FakeDHT("p0")
    resumed, _ = await train(
        BASE.model_copy(update={"max_steps": 40}), progress=at_20, states=states, dht=dht
    )
    assert resumed[1].service is not None
    assert resumed[1].service.executor.num_steps == 40
    assert resumed[0].role.data_start == 20
    assert resumed[0].metrics().step == 40
    assert resumed[0].service is not None
    assert resumed[0].service.stats.completed == 20
    view = await read_progress(dht, "r", owner_peer_id=None)
    assert view is not None
    assert view.done
    assert view.micro_batches == 40
    assert view.optimizer_steps == 40


async def test_until_stopped_runs_past_its_epochs_until_the_stop_request():
    job = BASE.model_copy(update={"until_stopped": True, "num_epochs": 1})
    net, dht = FakeNetwork(), FakeDHT("p0")
    runners = [
        StageRunner(RpcEndpoint(net.create(r.peer_id), "t"), dht, job, r, metrics_period_s=0.05)
        for r in roles(job)
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    per_epoch = 13  # 204 training samples / 16
    await wait_until(
        lambda: runners[0].service is not None and runners[0].service.stats.completed > 2 * per_epoch,
        30,
        message="two data epochs",
    )
    assert not any(t.done() for t in tasks)
    runners[0].stop_requested.set()
    final = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert final[0].done
    assert final[0].step > 2 * per_epoch
    assert final[0].eval_loss is not None
    view = await read_progress(dht, "r", owner_peer_id=None)
    assert view is not None
    assert view.done


async def test_a_wall_time_limit_ends_the_job_counting_earlier_plans():
    job = BASE.model_copy(update={"until_stopped": True, "max_wall_s": 1.0})
    earlier = ProgressView(job_id="r", train_wall_s=0.7)  # 0.7 s already trained on earlier plans
    _, final = await asyncio.wait_for(train(job, progress=earlier), 30)
    assert final[0].done
    assert final[0].train_wall_s < 5.0


async def test_a_run_cancelled_for_a_new_plan_keeps_its_state_and_records_where_its_data_stopped():
    job = BASE.model_copy(update={"until_stopped": True})
    net, dht = FakeNetwork(), FakeDHT("p0")
    runners = [
        StageRunner(RpcEndpoint(net.create(r.peer_id), "t"), dht, job, r, metrics_period_s=60.0)
        for r in roles(job)
    ]
    tasks = [asyncio.create_task(r.run()) for r in runners]
    await wait_until(
        lambda: runners[0].service is not None and runners[0].service.stats.completed > 10,
        30,
        message="steps",
    )
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    fed = runners[0].service.stats.completed if runners[0].service else 0
    view = await read_progress(dht, "r", owner_peer_id=None)
    assert view is not None
    assert view.micro_batches >= fed - 1  # published on hand-over, not a metrics period earlier
    assert not view.done
    assert all(r.held_state is not None for r in runners)
