"""IST workers over the in-memory transport: equal to the in-process IST, a dead worker, hostile replies."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.strategies import extract_subnetwork, ist_bytes_per_worker, train_ist_round
from ravnest_p2p.training.ist_runner import IstRunner
from ravnest_p2p.training.ist_state import IstState
from ravnest_p2p.training.ist_wire import IST_PULL, IstParts, IstPull, PartsKind, check_parts
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.modes import IstConfig
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_shard import SyncBatches
from ravnest_p2p.transport.fake import FakeNetwork
from ravnest_p2p.transport.rpc import CallContext, RpcEndpoint

pytestmark = pytest.mark.timeout(60)

MODEL = {"in_features": 16, "hidden_features": [48, 48], "out_features": 4}


def _job(
    workers: list[str], *, max_steps: int, local_steps: int = 3, epochs: int = 1, **ist: object
) -> JobSpec:
    end = len(build_model("wide_mlp", MODEL))
    return JobSpec(
        job_id="ist",
        model="wide_mlp",
        model_params=MODEL,
        dataset="synthetic_classification",
        dataset_config={"num_samples": 640},
        batch_size=16,
        max_steps=max_steps,
        num_epochs=epochs,
        seed=5,
        optimizer=OptimizerConfig(name="sgd", lr=0.05),
        mode="ist",
        ist=IstConfig(
            **{"num_workers": len(workers), "local_steps": local_steps, "peer_timeout_s": 0.5, **ist}
        ),
        assignment=tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers),
    )


def _runners(num: int, **job_args: object) -> tuple[FakeNetwork, list[IstRunner]]:
    network = FakeNetwork()
    transports = [network.create(f"w{i}") for i in range(num)]
    job = _job([t.peer_id for t in transports], **job_args)  # type: ignore[arg-type]
    runners = []
    for transport in transports:
        role = role_for(job, None, transport.peer_id)
        assert role is not None
        runners.append(IstRunner(RpcEndpoint(transport, "run"), None, job, role))
    return network, runners


def _reference(job: JobSpec, num_workers: int, rounds: int, steps: int) -> list[torch.nn.Module]:
    """The in-process IST (`train_ist_round`) on the same batches."""
    layers = build_model(job.model, job.model_params, seed=job.seed)
    batches = SyncBatches(
        load_dataset(job)[0], batch_size=job.batch_size, seed=job.seed, num_workers=num_workers
    )
    k = job.ist.local_steps
    for r in range(rounds):
        worker_batches = [
            [batches.batch(s, w) for s in range(r * k, min(steps, (r + 1) * k))] for w in range(num_workers)
        ]
        train_ist_round(
            layers,
            worker_batches,
            round_index=r,
            seed=job.seed,
            lr=job.optimizer.lr,
            loss_fn=make_loss("cross_entropy"),
        )
    return layers


async def test_networked_ist_equals_the_in_process_ist() -> None:
    _, runners = _runners(3, max_steps=9)
    results = await asyncio.wait_for(asyncio.gather(*(r.run() for r in runners)), 50)
    assert all(m.done and m.mode == "ist" and m.eval_accuracy is not None for m in results)
    assert (runners[0].steps, runners[0].num_rounds) == (9, 3)
    reference = torch.nn.Sequential(*_reference(runners[0].job, 3, 3, 9)).state_dict()
    for runner in runners:
        got = torch.nn.Sequential(*runner.state.layers).state_dict()
        for name, expected in reference.items():
            torch.testing.assert_close(got[name], expected, atol=1e-6, rtol=0, msg=name)
    # the traffic of a round is about one sub-network, not the whole model
    traffic = ist_bytes_per_worker(16, (48, 48), 4, 3)
    for runner in runners:
        pulled = [entry["bytes_pulled"] for entry in runner.round_log[1:]]
        assert all(0.3 * traffic.total_bytes < b < 1.2 * traffic.total_bytes + 8192 for b in pulled), pulled


async def test_a_dead_worker_is_left_out_and_the_run_goes_on() -> None:
    network, runners = _runners(3, max_steps=30, local_steps=2, epochs=3)
    victim = runners[2]
    tasks = {r.rpc.peer_id: asyncio.create_task(r.run()) for r in runners}
    assert victim.num_rounds == 15
    while victim.round < 9:  # past the first pruned holder maps
        await asyncio.sleep(0.005)  # polling the victim's progress, bounded by the test timeout
    network.kill(victim.rpc.peer_id)
    tasks[victim.rpc.peer_id].cancel()
    survivors = runners[:2]
    results = await asyncio.wait_for(asyncio.gather(*(tasks[r.rpc.peer_id] for r in survivors)), 50)
    with contextlib.suppress(asyncio.CancelledError):
        await tasks[victim.rpc.peer_id]
    assert all(m.done for m in results), [m.failed for m in results]
    for runner in survivors:
        assert 2 in runner.state.dead_since
        last = runner.round_log[-1]
        assert last["live"] == [0, 1], runner.round_log[-3:]
    # both survivors gathered the same final model
    a, b = (torch.nn.Sequential(*r.state.layers).state_dict() for r in survivors)
    assert all(torch.equal(a[name], b[name]) for name in a)


def _parts(round_index: int, tensors: list[torch.Tensor], num_shared: int = 1) -> IstParts:
    return IstParts(
        kind=PartsKind.PARTS, round=round_index, num_dealt=len(tensors) - num_shared, num_shared=num_shared
    )


def test_malformed_parts_are_refused() -> None:
    shared = [torch.zeros(4)]
    good = [torch.ones(6), torch.ones(3), torch.zeros(4)]
    args = {"counts": [6, 3], "dealt_dtypes": [torch.float32, torch.float32], "shared": shared}
    dealt, got_shared = check_parts(_parts(2, good), good, round_index=2, **args)  # type: ignore[arg-type]
    assert [t.numel() for t in dealt] == [6, 3]
    assert got_shared[0].shape == (4,)
    bad_cases = {
        "another round": (_parts(1, good), good),
        "a wrong count": (_parts(2, good), [torch.ones(5), torch.ones(3), torch.zeros(4)]),
        "a wrong shape": (_parts(2, good), [torch.ones(2, 3), torch.ones(3), torch.zeros(4)]),
        "a wrong dtype": (
            _parts(2, good),
            [torch.ones(6, dtype=torch.float64), torch.ones(3), torch.zeros(4)],
        ),
        "a NaN": (_parts(2, good), [torch.full((6,), float("nan")), torch.ones(3), torch.zeros(4)]),
        "a missing tensor": (_parts(2, good), good[:2]),
        "a wrong shared shape": (_parts(2, good), [torch.ones(6), torch.ones(3), torch.zeros(5)]),
        "pending": (IstParts(kind=PartsKind.PENDING, round=2), []),
    }
    for reply, tensors in bad_cases.values():
        with pytest.raises(InvalidMessage):
            check_parts(reply, tensors, round_index=2, **args)  # type: ignore[arg-type]


async def test_the_holder_refuses_malformed_pulls() -> None:
    _, runners = _runners(3, max_steps=6)
    state = runners[0].state
    me = CallContext(remote_peer_id="w1", method="ist_pull")
    ok = {"job_id": "ist", "round": 0, "live": (0, 1, 2), "wait_s": 0.1}
    bad = [
        ({**ok, "job_id": "other"}, me),
        (ok, CallContext(remote_peer_id="stranger", method="ist_pull")),
        ({**ok, "live": (0, 2)}, me),  # the requester is not dealt the round
        ({**ok, "live": (2, 1, 0)}, me),  # not ascending
        ({**ok, "live": (0, 1, 7)}, me),  # not a worker
        ({**ok, "gone": (0,)}, me),  # we are gone for the requester
        ({**ok, "round": 99}, me),  # past the final gather
        ({**ok, "final": True}, me),  # round 0 is not the final one
        ({**ok, "dead_workers": (1,), "dead_since": ()}, me),
    ]
    for body, context in bad:
        with pytest.raises(InvalidMessage):
            await state.handle_pull(IstPull(**body), [], context)  # type: ignore[arg-type]
    reply, tensors = await state.handle_pull(IstPull(**ok), [], me)  # type: ignore[arg-type]
    assert reply.kind == PartsKind.PARTS
    assert all(t.numel() == 0 for t in tensors[: reply.num_dealt])
    later = IstPull(**{**ok, "round": 1, "live": (0, 1)})  # type: ignore[arg-type]
    pending, _ = await state.handle_pull(later, [], me)
    assert pending.kind == PartsKind.PENDING  # round 0 is not committed yet


def test_a_holder_one_round_ahead_computes_the_same_fallback_as_the_requester() -> None:
    """The fallback chain of a dead worker's holdings must not depend on which old maps a worker pruned."""
    layers = build_model("wide_mlp", MODEL, seed=0)
    ahead, behind = (IstState("ist", ["w0", "w1", "w2"], me, layers, seed=5, num_rounds=20) for me in (0, 1))
    for state, last in ((ahead, 12), (behind, 11)):
        for r in range(last + 1):
            live = (0, 1, 2)
            deal = state.deal(r, live)
            state.commit(r, live, deal, extract_subnetwork(state.layers, deal, live.index(state.me)))
    for a, b in zip(ahead.holders_for(12, [2]).maps, behind.holders_for(12, [2]).maps, strict=True):
        assert torch.equal(a, b)


async def test_a_worker_the_others_exclude_stops_without_failing_the_job() -> None:
    _, runners = _runners(3, max_steps=12, local_steps=2)
    runners[0].state.learn([2], [3])  # worker 0 believes worker 2 dead from round 3 on (e.g. too slow)
    results = await asyncio.wait_for(asyncio.gather(*(r.run() for r in runners)), 50)
    assert all(m.done for m in results[:2]), [m.failed for m in results]
    assert not results[2].done
    assert results[2].failed is None
    assert runners[2].left is not None
    assert "declared dead" in runners[2].left
    assert all(r.state.dead_since.get(2, 99) <= 3 for r in runners[:2])


async def test_a_worker_sending_malformed_parts_is_excluded() -> None:
    _, runners = _runners(3, max_steps=12, local_steps=2)
    hostile = runners[2]
    honest_handler = hostile.state.handle_pull

    async def corrupting(request, tensors, context):  # type: ignore[no-untyped-def]
        reply, out = await honest_handler(request, tensors, context)
        if reply.kind == PartsKind.PARTS and request.round >= 2:
            out = [t.double() for t in out]  # the right entries, the wrong dtype
        return reply, out

    await hostile.rpc.unserve(IST_PULL)
    hostile.state.handle_pull = corrupting  # type: ignore[method-assign]
    results = await asyncio.wait_for(asyncio.gather(*(r.run() for r in runners)), 50)
    assert all(m.done for m in results[:2]), [m.failed for m in results]
    assert all(r.state.dead_since.get(2) == 3 for r in runners[:2])  # gone in round 2, dead from 3
    assert not results[2].done
