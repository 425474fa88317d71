"""A middle stage whose daemon dies mid-training: the first stage names it within seconds, not 300 s."""

from __future__ import annotations

import asyncio
import time

import pytest

from ravnest_p2p.errors import NeighbourLost
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import local_hosts, local_pipeline
from ravnest_p2p.training.stages import load_dataset, train_batches
from ravnest_p2p.utils import wait_until

pytestmark = pytest.mark.timeout(60)

JOB = JobSpec(
    model="digits_cnn",
    dataset="digits",
    batch_size=16,
    num_epochs=20,
    seed=3,
    optimizer=OptimizerConfig(name="adam", lr=3e-3),
)


async def test_first_stage_fails_with_neighbour_lost_within_ten_seconds_of_the_middle_dying():
    train, _ = load_dataset(JOB)
    async with local_hosts(3) as transports, local_pipeline(JOB, transports, max_in_flight=3) as services:
        first, middle, _ = services
        assert first.config.neighbour_timeout_s <= 10  # the default
        batches = train_batches(JOB, train, cluster_index=0, num_clusters=1)
        training = asyncio.create_task(first.train(batches))
        try:
            await wait_until(lambda: first.stats.completed >= 3, 60, message="training under way")
            killed_at = time.monotonic()
            await transports[1].aclose()  # the middle peer's daemon is gone: no goodbye, no reply
            services.remove(middle)  # (its handlers died with its daemon: nothing to unserve)
            await middle._tasks.aclose()
            with pytest.raises(NeighbourLost) as lost:
                await training
            detected_s = time.monotonic() - killed_at
        finally:
            training.cancel()
        assert lost.value.peer_id == middle.rpc.peer_id
        assert detected_s < 10.0, detected_s
        await wait_until(lambda: first.executor.in_flight == (), 10, message="the first stage's stash freed")
