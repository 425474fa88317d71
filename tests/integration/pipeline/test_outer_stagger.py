"""Staggered outer syncs end to end: two clusters of real peers, int4 Δ in 2 fragments, replicas agree."""

from __future__ import annotations

import asyncio

import pytest

from ravnest_p2p.averaging import DeltaCompression, OuterAverager, OuterOptimizerConfig
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.local import local_hosts
from ravnest_p2p.training.replicas import tensor_digests
from ravnest_p2p.training.runner import StageRunner, find_placement
from ravnest_p2p.transport import RpcEndpoint

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


async def test_fragments_sync_in_turn_and_the_replicas_agree_after_the_final_round():
    async with local_hosts(4) as transports:
        peers = [t.peer_id for t in transports]
        job = JobSpec(
            job_id="outer-stagger",
            model="digits_cnn",
            dataset="digits",
            batch_size=32,
            max_steps=12,
            averaging_period_steps=4,
            outer_optimizer=OuterOptimizerConfig(compression=DeltaCompression.INT4, num_fragments=2),
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
        assert runner.replicas.num_fragments == 2
        assert (
            len(runner.replicas.rounds) >= 2
        )  # fragment syncs (those it owns rings in), then the closing one
    synced = {r.ring_id for runner in runners for m in runner.replicas.rounds[:-1] for r in m.rings}  # type: ignore[union-attr]
    assert len(synced) >= 2  # both fragments synced during training
    by_cluster: list[dict[str, str]] = [{}, {}]
    for runner in runners:
        assert runner.service is not None
        executor = runner.service.executor
        tensors = {**executor.parameters_by_name(), **executor.buffers_by_name()}
        by_cluster[runner.placement.cluster_index].update(tensor_digests(tensors))
    assert by_cluster[0] == by_cluster[1]
