"""sync_backup workers over the in-memory transport: b = 0 is large-batch SGD, backups and deaths."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from torch import nn

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import SyncBackupConfig
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_runner import SyncBackupRunner
from ravnest_p2p.training.sync_shard import ShardOwner, SyncBatches
from ravnest_p2p.training.sync_wire import SyncPush
from ravnest_p2p.transport.fake import FakeNetwork
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint

pytestmark = pytest.mark.timeout(60)

MODEL = {"in_features": 16, "hidden_features": [32], "out_features": 4}


def _job(workers: list[str], *, n: int, b: int, max_steps: int, lr: float = 0.1, **sync: object) -> JobSpec:
    end = len(build_model("mlp", MODEL))
    return JobSpec(
        job_id="sync",
        model="mlp",
        model_params=MODEL,
        dataset="synthetic_classification",
        dataset_config={"num_samples": 640},
        batch_size=16,
        max_steps=max_steps,
        seed=3,
        optimizer=OptimizerConfig(name="sgd", lr=lr),
        mode="sync_backup",
        sync_backup=SyncBackupConfig(
            **{"num_required": n, "num_backup": b, "step_timeout_s": 20, "owner_ping_timeout_s": 0.5, **sync}
        ),
        assignment=tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers),
    )


def _runners(num: int, **job_args: object) -> tuple[FakeNetwork, list[SyncBackupRunner]]:
    network = FakeNetwork()
    transports = [network.create(f"w{i}") for i in range(num)]
    job = _job([t.peer_id for t in transports], **job_args)  # type: ignore[arg-type]
    runners = []
    for transport in transports:
        role = role_for(job, None, transport.peer_id)
        assert role is not None
        runners.append(SyncBackupRunner(RpcEndpoint(transport, "run"), None, job, role))
    return network, runners


def _reference(job: JobSpec, num_workers: int, steps: int) -> dict[str, torch.Tensor]:
    """Single-process SGD on the union of the workers' batches of every step."""
    model = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    batches = SyncBatches(
        load_dataset(job)[0], batch_size=job.batch_size, seed=job.seed, num_workers=num_workers
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=job.optimizer.lr)
    loss_fn = make_loss("cross_entropy")
    for step in range(steps):
        parts = [batches.batch(step, w) for w in range(num_workers)]
        inputs = torch.cat([x for x, _ in parts])
        labels = torch.cat([y for _, y in parts])
        optimizer.zero_grad()
        loss_fn(model(inputs), labels).backward()
        optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


async def test_b0_equals_single_process_large_batch_sgd() -> None:
    _, runners = _runners(3, n=3, b=0, max_steps=6)
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done and m.step == 6 and m.mode == "sync_backup" for m in results)
    reference = _reference(runners[0].job, 3, 6)
    for runner in runners:
        for name, expected in reference.items():
            torch.testing.assert_close(runner.params[name].detach(), expected, atol=1e-5, rtol=0)
    # every step of every shard counted exactly the three workers
    for runner in runners:
        for owner in runner.owners.owned.values():
            assert len(owner.contributors) == 6
            assert all(sorted(c) == ["w0", "w1", "w2"] for c in owner.contributors)


async def test_backup_workers_drop_the_late_and_all_agree() -> None:
    _, runners = _runners(3, n=2, b=1, max_steps=8)
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done for m in results)
    first = runners[0].params
    for runner in runners[1:]:
        for name, value in first.items():
            assert torch.equal(runner.params[name], value)
    owners = [o for r in runners for o in r.owners.owned.values()]
    assert all(len(c) == 2 for o in owners for c in o.contributors)


async def test_a_dead_owner_is_replaced_and_the_steps_go_on() -> None:
    network, runners = _runners(4, n=2, b=2, max_steps=10)
    victim = next(r for r in runners if r.layout.shards_of(r.rpc.peer_id))  # owns a shard at the start
    tasks = {r.rpc.peer_id: asyncio.create_task(r.run()) for r in runners}

    async def kill_after_steps() -> None:
        while victim.step < 3:
            await asyncio.sleep(0.01)
        network.kill(victim.rpc.peer_id)
        tasks[victim.rpc.peer_id].cancel()

    await kill_after_steps()
    survivors = [r for r in runners if r is not victim]
    results = await asyncio.wait_for(asyncio.gather(*(tasks[r.rpc.peer_id] for r in survivors)), 50)
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[victim.rpc.peer_id]
    assert all(m.done and m.step == victim.final_step for m in results), [(m.step, m.failed) for m in results]
    assert all(victim.rpc.peer_id in r.owners.dead for r in survivors)
    assert sum(r.owners.takeovers for r in survivors) == len(victim.layout.shards_of(victim.rpc.peer_id))


async def test_too_few_workers_fail_at_the_step_deadline() -> None:
    network, runners = _runners(3, n=3, b=0, max_steps=50, step_timeout_s=1.5)
    tasks = [asyncio.create_task(r.run()) for r in runners]
    while runners[0].step < 2:
        await asyncio.sleep(0.01)
    network.kill(runners[2].rpc.peer_id)
    tasks[2].cancel()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks[:2], return_exceptions=True), 30)
    assert all(isinstance(o, Exception) for o in outcomes)
    assert any("gradients" in str(o) or "silent" in str(o) for o in outcomes), outcomes


async def test_the_owner_refuses_malformed_pushes() -> None:
    _, runners = _runners(2, n=2, b=0, max_steps=2)
    owner_runner = next(r for r in runners if r.layout.shards_of(r.rpc.peer_id))
    service = owner_runner.owners
    await service.serve()
    shard = next(iter(service.owned))
    names = owner_runner.layout.shards[shard]
    good = [torch.zeros_like(owner_runner.params[n]) for n in names]
    other = next(r.rpc.peer_id for r in runners if r is not owner_runner)

    async def push(tensors: list[torch.Tensor], *, sender: str = other, **fields: object) -> None:
        part = {"shard": shard, "step": 0, "names": names, **fields}
        job_id = part.pop("job_id", "sync")
        request = SyncPush.model_validate({"job_id": job_id, "parts": [part], "wait_s": 0})
        await service.handle_push(request, tensors, CallContext(remote_peer_id=sender, method="sync_push"))

    with pytest.raises(InvalidMessage, match="not a worker"):
        await push(good, sender="stranger")
    with pytest.raises(InvalidMessage, match="not job"):
        await push(good, job_id="other")
    with pytest.raises(InvalidMessage, match="names"):
        await push(good[:-1])
    with pytest.raises(InvalidMessage, match="expected"):
        await push([good[0].double(), *good[1:]])
    with pytest.raises(InvalidMessage, match="expected"):
        await push([torch.zeros(3), *good[1:]])
    with pytest.raises(InvalidMessage, match="non-finite"):
        await push([torch.full_like(good[0], float("nan")), *good[1:]])
    with pytest.raises(InvalidMessage, match="ahead"):
        await push(good, step=5)
    assert service.owned[shard].num_pending == 0
    assert service.owned[shard].step == 0
    await push(good)  # well-formed: counted (the step waits for the second worker)
    assert service.owned[shard].num_pending == 1
    await service.aclose()


def test_shard_owner_async_baseline_counts_staleness() -> None:
    params = {"w": torch.zeros(2)}
    owner = ShardOwner(
        params,
        ["a", "b"],
        2,
        OptimizerConfig(name="sgd", lr=1.0),
        start_step=0,
        final_step=10,
        aggregation="async",
    )
    owner.submit("a", 0, {"w": torch.ones(2)})
    owner.submit("b", 0, {"w": torch.ones(2)})  # computed on version 0, applied at version 1
    assert owner.step == 2
    assert dict(owner.staleness) == {0: 1, 1: 1}
    assert torch.equal(owner.params["w"].detach(), torch.full((2,), -2.0))


async def test_only_the_jobs_owner_candidates_own_shards() -> None:
    _, runners = _runners(3, n=2, b=1, max_steps=4, owners=("w0", "w1"))
    assert runners[2].layout.shards_of("w2") == []
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done for m in results)
    assert not runners[2].owners.owned
    assert {s for r in runners[:2] for s in r.owners.owned} == set(range(len(runners[0].layout.shards)))


def test_owner_candidates_must_be_workers() -> None:
    with pytest.raises(ValueError, match="owners"):
        _job(["w0", "w1"], n=2, b=0, max_steps=2, owners=("w0", "x"))
