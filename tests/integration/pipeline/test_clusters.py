"""Two clusters x three stages, split at different points, averaged by rings while they train."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterAverager, OuterOptimizerConfig
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.local import local_hosts
from ravnest_p2p.training.replicas import shard_map_for, tensor_digests
from ravnest_p2p.training.runner import StageRunner, find_placement
from ravnest_p2p.training.stages import load_dataset, steps_per_cluster
from ravnest_p2p.transport import RpcEndpoint

pytestmark = pytest.mark.timeout(300)


def two_clusters(peers: list[str]) -> tuple[tuple[StagePlacement, ...], ...]:
    a = [(0, 1), (1, 2), (2, 4)]
    b = [(0, 2), (2, 3), (3, 4)]
    return (
        tuple(
            StagePlacement(peer_id=p, first_layer=f, end_layer=e)
            for p, (f, e) in zip(peers[:3], a, strict=True)
        ),
        tuple(
            StagePlacement(peer_id=p, first_layer=f, end_layer=e)
            for p, (f, e) in zip(peers[3:], b, strict=True)
        ),
    )


@pytest.mark.parametrize("period", [2])
async def test_two_clusters_learn_and_agree_after_the_final_round(period):
    async with local_hosts(6) as transports:
        job = JobSpec(
            job_id="two",
            model="digits_cnn",
            dataset="digits",
            batch_size=16,
            num_epochs=16,
            seed=1,
            optimizer=OptimizerConfig(name="adam", lr=3e-3),
            averaging_period_steps=period,
            assignment=two_clusters([t.peer_id for t in transports]),
        )
        # a decaying learning rate, batch 16 and a round every 2 steps: with a constant 3e-3, batch 32 and
        # a round every 10 steps a CI run ended at 96.4 % (the bar is 97 %); 10 epochs gave 96.9-97.8 %,
        # 16 epochs 97.8-98.1 % (3 runs)
        steps = steps_per_cluster(job, len(load_dataset(job)[0]), 2)
        optimizer = OptimizerConfig(
            name="adam", lr=3e-3, schedule="warmup_cosine", warmup_steps=20, total_steps=steps
        )
        job = job.model_copy(update={"optimizer": optimizer})
        shard_map = shard_map_for(job, epoch=0)
        assert shard_map is not None
        assert len(shard_map.shards) == 4  # cut at layers 1, 2, 3: the union of both clusters' boundaries
        runners = [
            StageRunner(RpcEndpoint(t, "job"), None, job, find_placement(job, t.peer_id)) for t in transports
        ]
        finals = await asyncio.gather(*(r.run() for r in runners))

    firsts = [m for m in finals if m.stage == 0]
    assert len(firsts) == 2
    print("accuracy", [m.eval_accuracy for m in firsts])
    for m in firsts:
        assert m.eval_accuracy is not None
        assert m.eval_accuracy >= 0.97, firsts
    # periodic rounds ran during training, plus the final one, on every stage
    rounds = [None if r.replicas is None else len(r.replicas.rounds) for r in runners]
    print("rounds per stage", rounds)
    assert all(n is not None and n >= 3 for n in rounds), rounds
    # right after the final round the replicas hold the same weights
    by_cluster: list[dict[str, torch.Tensor]] = [{}, {}]
    for runner in runners:
        assert runner.service is not None
        executor = runner.service.executor
        tensors = {**executor.parameters_by_name(), **executor.buffers_by_name()}
        by_cluster[runner.placement.cluster_index].update(
            {n: t.detach() for n, t in tensors.items() if t.is_floating_point()}
        )
    assert set(by_cluster[0]) == set(by_cluster[1])
    for name, value in by_cluster[0].items():
        torch.testing.assert_close(by_cluster[1][name], value, atol=1e-6, rtol=0, msg=name)


async def test_without_periodic_rounds_only_the_final_round_runs():
    async with local_hosts(4) as transports:
        peers = [t.peer_id for t in transports]
        job = JobSpec(
            job_id="final-only",
            model="digits_cnn",
            dataset="digits",
            batch_size=64,
            max_steps=6,
            averaging_period_steps=0,
            assignment=(
                (
                    StagePlacement(peer_id=peers[0], first_layer=0, end_layer=2),
                    StagePlacement(peer_id=peers[1], first_layer=2, end_layer=4),
                ),
                (
                    StagePlacement(peer_id=peers[2], first_layer=0, end_layer=3),
                    StagePlacement(peer_id=peers[3], first_layer=3, end_layer=4),
                ),
            ),
        )
        runners = [
            StageRunner(RpcEndpoint(t, "job"), None, job, find_placement(job, t.peer_id)) for t in transports
        ]
        await asyncio.gather(*(r.run() for r in runners))
    assert all(r.replicas is not None and len(r.replicas.rounds) == 1 for r in runners)


async def test_outer_optimizer_syncs_and_the_replicas_agree_after_the_final_round():
    async with local_hosts(4) as transports:
        peers = [t.peer_id for t in transports]
        job = JobSpec(
            job_id="outer",
            model="digits_cnn",
            dataset="digits",
            batch_size=32,
            max_steps=12,
            averaging_period_steps=4,
            outer_optimizer=OuterOptimizerConfig(compression=DeltaCompression.INT8),
            assignment=(
                (
                    StagePlacement(peer_id=peers[0], first_layer=0, end_layer=2),
                    StagePlacement(peer_id=peers[1], first_layer=2, end_layer=4),
                ),
                (
                    StagePlacement(peer_id=peers[2], first_layer=0, end_layer=3),
                    StagePlacement(peer_id=peers[3], first_layer=3, end_layer=4),
                ),
            ),
        )
        runners = [
            StageRunner(RpcEndpoint(t, "job"), None, job, find_placement(job, t.peer_id)) for t in transports
        ]
        await asyncio.gather(*(r.run() for r in runners))
    for runner in runners:
        assert runner.replicas is not None
        assert isinstance(runner.replicas.averager, OuterAverager)
        assert len(runner.replicas.rounds) >= 2  # outer syncs, then the closing round (int8 Δ)
        exported = runner.replicas.export_outer_state()
        assert any(name.endswith("/theta") for name in exported)
        # whether the closing round went coded (and spent the residuals) depends on every member making
        # every sync and the closing round in time, which a busy host does not promise (busy runs: a
        # ring closed plainly twice); `tests/unit/averaging/test_outer_closing.py` checks the coded
        # closing itself. What must hold whatever happened: the replicas end identical (below).
    by_cluster: list[dict[str, str]] = [{}, {}]
    for runner in runners:
        assert runner.service is not None
        executor = runner.service.executor
        tensors = {**executor.parameters_by_name(), **executor.buffers_by_name()}
        by_cluster[runner.placement.cluster_index].update(tensor_digests(tensors))
    assert by_cluster[0] == by_cluster[1]
