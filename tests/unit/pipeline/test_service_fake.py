"""The stage service over the in-memory transport: window bound, 1F1B preference, dead neighbours."""

from __future__ import annotations

import pytest
import torch

from ravnest_p2p.errors import NeighbourLost
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.service import PipelineConfig, StageService
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import even_split
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

JOB = JobSpec(
    model="mlp",
    dataset="synthetic_classification",
    dataset_config={"num_samples": 256, "in_features": 16, "num_classes": 4},
    model_params={"in_features": 16, "hidden_features": [32, 32], "out_features": 4},
    batch_size=16,
    max_steps=10,
    optimizer=OptimizerConfig(name="sgd", lr=0.1),
)


async def make_cluster(net: FakeNetwork, num_stages: int, *, window: int, timeout_s: float = 30.0):
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
                max_in_flight=window, micro_batch_timeout_s=timeout_s, send_attempts=1, send_timeout_s=1.0
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
