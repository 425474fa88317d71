"""The stage service over the in-memory transport: window bound, 1F1B, dead or slow neighbours, drops."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from ravnest_p2p.errors import InvalidMessage, NeighbourLost, RemoteError
from ravnest_p2p.runtime.messages import FORWARD, ForwardRequest
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import even_split
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils import wait_until

JOB = JobSpec(
    model="mlp",
    dataset="synthetic_classification",
    dataset_config={"num_samples": 256, "in_features": 16, "num_classes": 4},
    model_params={"in_features": 16, "hidden_features": [32, 32], "out_features": 4},
    batch_size=16,
    max_steps=10,
    optimizer=OptimizerConfig(name="sgd", lr=0.1),
)


async def make_cluster(net: FakeNetwork, num_stages: int, *, window: int, timeout_s: float = 30.0, **knobs):
    peers = [f"p{i}" for i in range(num_stages)]
    services = []
    for i, (first, end) in enumerate(even_split(num_layers(JOB), num_stages)):
        service = StageService(
            RpcEndpoint(net.create(peers[i]), "t"),
            build_stage(JOB, first, end, max_in_flight=window),
            epoch=3,
            cluster_peers=peers,
            stage_index=i,
            config=PipelineConfig(
                max_in_flight=window,
                micro_batch_timeout_s=timeout_s,
                send_attempts=1,
                send_timeout_s=1.0,
                **knobs,
            ),
        )
        await service.start()
        services.append(service)
    return services


def batches():
    train, _ = load_dataset(JOB)
    return list(train_batches(JOB, train, cluster_index=0, num_clusters=1))


async def test_window_bounds_in_flight_and_all_micro_batches_complete():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2)
    seen_in_flight = []
    original = services[1].executor.forward

    def spy(mb, x):
        seen_in_flight.append(len(services[1].executor.in_flight))
        return original(mb, x)

    services[1].executor.forward = spy
    try:
        stats = await services[0].train(batches())
        assert stats.completed == 10
        assert max(seen_in_flight) < 2
        assert all(s.executor.num_steps == 10 for s in services)
    finally:
        for s in services:
            await s.aclose()


async def test_single_stage_cluster_trains_locally():
    net = FakeNetwork()
    (only,) = await make_cluster(net, 1, window=1)
    try:
        stats = await only.train(batches())
        assert stats.completed == 10
        assert only.executor.num_steps == 10
    finally:
        await only.aclose()


async def test_dead_next_stage_fails_the_pipeline_within_its_deadline():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2, timeout_s=2.0)
    net.kill("p2")
    try:
        with pytest.raises(NeighbourLost) as lost:
            await services[0].train(batches())
        assert lost.value.peer_id == "p2"  # named by the middle stage, whose forward to p2 failed
    finally:
        for s in services:
            await s.aclose()


async def test_evaluate_goes_through_all_stages_without_touching_state():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2)
    _, test = load_dataset(JOB)
    before = [s.executor.weight_version for s in services]
    try:
        loss, accuracy = await services[0].evaluate([(test.inputs[:32], test.labels[:32])])
        assert loss > 0
        assert 0 <= accuracy <= 1
        assert [s.executor.weight_version for s in services] == before
        assert all(not s.executor.in_flight for s in services)
    finally:
        for s in services:
            await s.aclose()
    assert torch.isfinite(torch.tensor(loss))


FAST = {"heartbeat_period_s": 0.1, "neighbour_timeout_s": 0.6}


async def test_a_dead_middle_stage_is_named_within_the_neighbour_timeout_and_the_stash_is_freed():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=3, **FAST)
    original = services[1].executor.forward

    def forward_then_die(mb, x):
        if mb == 2:
            net.kill("p1")  # dies after taking micro-batch 2: nothing comes back, nothing is sent to it
        return original(mb, x)

    services[1].executor.forward = forward_then_die
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(NeighbourLost) as lost:
            await services[0].train(batches())
        assert lost.value.peer_id == "p1"
        assert loop.time() - started < 5.0  # not micro_batch_timeout_s (30 s here)
        await wait_until(lambda: services[0].executor.in_flight == (), 5.0, message="stash freed")
        assert services[0].executor.stashed_versions in ((), (services[0].executor.weight_version,))
    finally:
        for s in services:
            await s.aclose()


async def test_a_slow_but_alive_neighbour_is_not_declared_dead():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2, **FAST)
    original = services[2].executor.forward_loss

    def slow_forward_loss(mb, x, y):
        time.sleep(0.3)  # the compute thread is busy for longer than a ping's patience, pings still answer
        return original(mb, x, y)

    services[2].executor.forward_loss = slow_forward_loss
    try:
        stats = await services[0].train(batches()[:6])
        assert stats.completed == 6
        assert all(s.failure is None for s in services)
        assert services[1].watch.num_pings > 0
    finally:
        for s in services:
            await s.aclose()


async def test_a_refused_forward_drops_the_micro_batch_and_the_first_stage_reissues_it():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2, **FAST)
    last = services[2]
    original = last.executor.validate_forward
    refused = []

    def refuse_once(mb, x, labels=None, **kw):
        if not refused:
            refused.append(mb)
            raise InvalidMessage("refused for the test")
        return original(mb, x, labels, **kw)

    last.executor.validate_forward = refuse_once
    try:
        stats = await services[0].train(batches())
        assert refused == [0]
        assert stats.completed == 10
        assert stats.reissued == 1
        assert stats.skipped == 0
        assert services[1].stats.dropped == 1
        assert services[0].stats.dropped == 1
        assert last.ledger.refused["p1"] == 1  # counted against its sender
        assert all(s.failure is None for s in services)
        assert all(s.executor.in_flight == () for s in services)
        assert all(s.executor.num_steps == 10 for s in services)
    finally:
        for s in services:
            await s.aclose()


async def test_a_neighbour_past_the_misbehaviour_threshold_is_excluded_and_named():
    net = FakeNetwork()
    services = await make_cluster(net, 3, window=2, misbehaviour_threshold=3, **FAST)
    excluded = []
    services[1].on_exclude = lambda peer, reason: excluded.append(peer)
    rpc_as_first = services[0].rpc
    x = torch.zeros(4, 16)
    try:
        for mb in range(3):
            bad = ForwardRequest(epoch=3, micro_batch_id=mb, weight_version=0)
            with pytest.raises(RemoteError):
                await rpc_as_first.call("p1", FORWARD, bad, tensors=[x[:, :3], torch.zeros(4)], timeout_s=5)
        assert excluded == ["p0"]
        assert isinstance(services[1].failure, NeighbourLost)
        assert services[1].failure.peer_id == "p0"
        with pytest.raises(RemoteError, match="excluded"):  # refused before its handler runs
            await rpc_as_first.call("p1", FORWARD, bad, tensors=[x, torch.zeros(4)], timeout_s=5)
    finally:
        for s in services:
            await s.aclose()


async def test_a_neighbour_still_on_the_previous_epoch_is_waited_for_not_declared_lost():
    net = FakeNetwork()
    peers = ["p0", "p1"]
    old = StageService(  # p1 still serves the previous plan's stage
        RpcEndpoint(net.create("p1"), "t"),
        build_stage(JOB, 2, num_layers(JOB), max_in_flight=2),
        epoch=2,
        cluster_peers=peers,
        stage_index=1,
        config=PipelineConfig(max_in_flight=2, **FAST),
    )
    new = StageService(
        RpcEndpoint(net.create("p0"), "t"),
        build_stage(JOB, 0, 2, max_in_flight=2),
        epoch=3,
        cluster_peers=peers,
        stage_index=0,
        config=PipelineConfig(max_in_flight=2, **FAST),
    )
    await old.start()
    await new.start()
    try:
        await asyncio.sleep(4 * FAST["neighbour_timeout_s"])  # asserting an absence: nothing to poll for
        assert new.failure is None
        assert new.watch.silent_for("p1") is None  # never heard on our epoch
    finally:
        await new.aclose()
        await old.aclose()
