"""Delayed averaging: the formula, and the background averager over the fake network."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import Averager, AveragerConfig, RingConfig, delayed_average
from ravnest_p2p.utils.aio import wait_until
from tests.unit.averaging.helpers import fake_swarm, mean_of, owned, replica


def test_delayed_average_formula():
    snapshot = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    current = {"w": torch.tensor([1.5, 1.0]), "b": torch.tensor([0.5]).double(), "other": torch.zeros(1)}
    averaged = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([2.0])}
    out = delayed_average(averaged, snapshot, current)
    assert set(out) == {"w", "b"}
    torch.testing.assert_close(out["w"], torch.tensor([3.5, 3.0]))  # θ̄ + (θ_now - θ0)
    assert out["b"].dtype == torch.float64
    torch.testing.assert_close(out["b"], torch.tensor([2.0]).double())
    with pytest.raises(ValueError, match="missing"):
        delayed_average({"x": torch.zeros(1)}, snapshot, current)
    with pytest.raises(ValueError, match="shapes"):
        delayed_average({"w": torch.zeros(3)}, snapshot, current)


def test_config_needs_exactly_one_period():
    with pytest.raises(ValueError, match="exactly one"):
        AveragerConfig()
    with pytest.raises(ValueError, match="exactly one"):
        AveragerConfig(period_steps=2, period_s=1.0)


async def make_averagers(num_clusters, config, **ring_overrides):
    net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, RingConfig(**ring_overrides))
    replicas = [replica(seed) for seed in range(num_clusters)]
    live = {
        p: {n: t.clone() for n, t in owned(shard_map, p, replicas[cluster_of[p]]).items()} for p in servers
    }
    writes = {p: 0 for p in servers}

    def make_write(p):
        def write(named):
            writes[p] += 1
            for name, value in named.items():
                live[p][name].copy_(value)

        return write

    averagers = {
        p: Averager(
            config, servers[p], read=lambda p=p: live[p], write=make_write(p), shard_map=lambda: shard_map
        )
        for p in servers
    }
    return net, replicas, live, writes, averagers, cluster_of


async def test_round_applies_the_average_plus_the_local_progress_made_meanwhile():
    net, replicas, live, writes, averagers, _cluster_of = await make_averagers(
        3, AveragerConfig(period_steps=1)
    )
    net.delay_s = 0.005
    expected_mean = mean_of(replicas)

    snapshots = []
    for p, averager in averagers.items():  # record each averager's snapshot once it is taken

        def snapshot(names, take=averager._snapshot, p=p):
            taken = take(names)
            snapshots.append(p)
            return taken

        averager._snapshot = snapshot

    # the rings wait until the training step is done, so it falls between every snapshot and every apply
    # (session 21: without the gate, on a busy host one apply in the compute thread raced the step and
    # lost it)
    trained = asyncio.Event()
    for averager in averagers.values():

        async def gated(*args, reduce=averager._all_reduce, **kwargs):
            await trained.wait()
            return await reduce(*args, **kwargs)

        averager._all_reduce = gated

    async def train_meanwhile():
        await wait_until(lambda: set(snapshots) == set(live), timeout_s=30)  # every snapshot is taken
        for params in live.values():
            for value in params.values():
                value.add_(1.0)
        trained.set()

    results = await asyncio.gather(*(a.run_round(0) for a in averagers.values()), train_meanwhile())
    assert all(m is not None and m.rings for m in results[:-1])
    for peer, params in live.items():
        assert writes[peer] == 1
        for name, value in params.items():
            torch.testing.assert_close(value.double(), expected_mean[name] + 1.0, atol=1e-5, rtol=0)


async def test_step_mode_runs_rounds_in_the_background():
    _net, replicas, live, _writes, averagers, _cluster_of = await make_averagers(
        2, AveragerConfig(period_steps=5)
    )
    for averager in averagers.values():
        await averager.start()
    try:
        for step in range(1, 5):
            for averager in averagers.values():
                averager.notify_step(step)
        await asyncio.sleep(0.05)
        assert all(a.history == [] for a in averagers.values())
        for averager in averagers.values():
            averager.notify_step(5)
        await wait_until(lambda: all(len(a.history) == 1 for a in averagers.values()), 5)
        assert all(a.history[0].round == 1 for a in averagers.values())
        expected = mean_of(replicas)
        for params in live.values():
            for name, value in params.items():
                torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
    finally:
        for averager in averagers.values():
            await averager.aclose()


async def test_no_plan_means_no_round():
    _net, _replicas, _live, writes, averagers, _cluster_of = await make_averagers(
        2, AveragerConfig(period_s=60)
    )
    averager = next(iter(averagers.values()))
    averager._shard_map = lambda: None
    assert await averager.run_round(0) is None
    assert sum(writes.values()) == 0


async def test_a_round_due_while_one_runs_starts_after_it_and_the_newest_due_one_wins():
    # skipping it let two partners lock out of phase (one ran the even rounds, the other the odd)
    *_, averagers, _cluster_of = await make_averagers(2, AveragerConfig(period_steps=1))
    averager = next(iter(averagers.values()))
    ran: list[int] = []
    release = asyncio.Event()

    async def run_round(index):
        ran.append(index)
        if index == 1:
            await release.wait()

    averager.run_round = run_round
    await averager.start()
    try:
        averager.notify_step(1)
        await wait_until(lambda: ran == [1], timeout_s=5)
        averager.notify_step(2)  # due while round 1 runs: waits for it
        averager.notify_step(3)  # newer: replaces round 2
        release.set()
        await wait_until(lambda: ran == [1, 3], timeout_s=5)
        averager.notify_step(4)
        await wait_until(lambda: ran == [1, 3, 4], timeout_s=5)
    finally:
        await averager.aclose()
