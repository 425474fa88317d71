"""Rings over the in-memory transport: exact means, compression bounds, refusals, dead members."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import RingConfig
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import Compression
from tests.unit.averaging.helpers import fake_swarm, mean_of, owned, replica

SMALL_PARTS = RingConfig(part_size_bytes=1024, step_timeout_s=2.0, probe_timeout_s=0.5)


async def run_round(servers, shard_map, replicas, cluster_of, round_index=0, skip=()):
    peers = [p for p in servers if p not in skip]
    results = await asyncio.gather(
        *(
            servers[p].all_reduce(
                shard_map, owned(shard_map, p, replicas[cluster_of[p]]), round_index=round_index
            )
            for p in peers
        )
    )
    return dict(zip(peers, results, strict=True))


@pytest.mark.parametrize("num_clusters", [2, 3, 4])
async def test_result_is_the_mean_of_all_clusters(num_clusters):
    _net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, SMALL_PARTS)
    replicas = [replica(seed) for seed in range(num_clusters)]
    expected = mean_of(replicas)
    results = await run_round(servers, shard_map, replicas, cluster_of)
    for peer, (averaged, metrics) in results.items():
        assert set(averaged) == set(owned(shard_map, peer, replicas[0]))
        for name, value in averaged.items():
            assert value.dtype == torch.float32
            torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
        assert metrics.round == 0
        assert metrics.bytes_sent > 0
        assert metrics.bytes_received > 0
        for ring in metrics.rings:
            assert len(ring.participants) == num_clusters
            assert ring.attempts == 1
    # every replica ends up with bit-identical values
    by_name = {}
    for averaged, _ in results.values():
        for name, value in averaged.items():
            by_name.setdefault(name, []).append(value)
    assert all(torch.equal(v[0], w) for v in by_name.values() for w in v)


@pytest.mark.parametrize("streams_per_neighbour", [1, 3])
async def test_parts_dealt_over_several_streams_per_neighbour_give_the_exact_mean(
    streams_per_neighbour, monkeypatch
):
    opened: list[tuple[str, str]] = []
    open_stream = MemoryStreamHub._open

    def counting_open(hub, src, dst, name):
        opened.append((src, dst))
        return open_stream(hub, src, dst, name)

    monkeypatch.setattr(MemoryStreamHub, "_open", counting_open)
    config = SMALL_PARTS.model_copy(update={"streams_per_neighbour": streams_per_neighbour})
    _net, shard_map, servers, cluster_of = await fake_swarm(3, config)
    replicas = [replica(seed) for seed in range(3)]
    expected = mean_of(replicas)
    results = await run_round(servers, shard_map, replicas, cluster_of)
    for averaged, metrics in results.values():
        assert all(len(ring.participants) == 3 and ring.attempts == 1 for ring in metrics.rings)
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
    # every member of every ring opened that many streams to its right neighbour, and no other
    rights = [(r[i], r[(i + 1) % len(r)]) for r in (s.ring for s in shard_map.shards) for i in range(len(r))]
    assert sorted(opened) == sorted(rights * streams_per_neighbour)


@pytest.mark.parametrize("compression", [Compression.FP16, Compression.MEANSTD16])
async def test_lossy_compression_stays_within_documented_bound(compression):
    num_clusters = 4
    config = SMALL_PARTS.model_copy(update={"compression": compression})
    _net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, config)
    replicas = [replica(seed) for seed in range(num_clusters)]
    expected = mean_of(replicas)
    results = await run_round(servers, shard_map, replicas, cluster_of)
    for averaged, metrics in results.values():
        assert metrics.bytes_sent > 0
        for name, value in averaged.items():
            # fp16: each of the C-1 partial sums and the gathered sum is rounded once (rel. 2^-11), so the
            # mean is off by at most C * 2^-11 * max|x|; meanstd16 is documented at ~1e-3 of the std
            max_abs = max(r[name].abs().max().item() for r in replicas)
            bound = num_clusters * 2**-11 * max_abs
            assert (value.double() - expected[name]).abs().max().item() <= bound
    values = {}
    for averaged, _ in results.values():
        for name, value in averaged.items():
            values.setdefault(name, []).append(value)
    if compression is Compression.FP16:  # fp16 re-encoding is exact, so forwarding changes nothing
        assert all(torch.equal(v[0], w) for v in values.values() for w in v)  # replicas agree bitwise


async def test_fp16_halves_the_bytes():
    _net, shard_map, servers, cluster_of = await fake_swarm(3, SMALL_PARTS)
    replicas = [replica(s) for s in range(3)]
    plain = await run_round(servers, shard_map, replicas, cluster_of, round_index=0)
    _net2, map2, servers2, cluster2 = await fake_swarm(
        3, SMALL_PARTS.model_copy(update={"compression": "fp16"})
    )
    half = await run_round(servers2, map2, replicas, cluster2, round_index=0)
    assert sum(m.bytes_sent for _, m in half.values()) * 2 == sum(m.bytes_sent for _, m in plain.values())


async def test_dead_member_is_dropped_and_survivors_get_their_mean():
    num_clusters = 3
    net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, SMALL_PARTS)
    replicas = [replica(seed) for seed in range(num_clusters)]
    dead = [p for p, c in cluster_of.items() if c == 2]
    for peer in dead:
        net.kill(peer)
    survivors_mean = mean_of(replicas[:2])
    results = await asyncio.wait_for(run_round(servers, shard_map, replicas, cluster_of, skip=dead), 10)
    for averaged, metrics in results.values():
        for ring in metrics.rings:
            assert set(ring.participants) == {p for p in ring.participants if cluster_of[p] < 2}
            assert len(ring.participants) == 2
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), survivors_mean[name], atol=1e-6, rtol=0)


async def test_member_dying_mid_round_is_dropped_within_the_deadline():
    num_clusters = 4
    net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, SMALL_PARTS)
    net.delay_s = 0.01  # every part write waits this long: the round is still running when the member dies
    replicas = [replica(seed) for seed in range(num_clusters)]
    victim = next(p for p, c in cluster_of.items() if c == 1)

    async def kill_soon():
        await asyncio.sleep(0.02)
        net.kill(victim)

    round_task = asyncio.gather(
        run_round(servers, shard_map, replicas, cluster_of, skip=[victim]),
        servers[victim].all_reduce(shard_map, owned(shard_map, victim, replicas[1]), round_index=0),
        kill_soon(),
    )
    results, _, _ = await asyncio.wait_for(round_task, 15)
    for _peer, (averaged, metrics) in results.items():
        for ring in metrics.rings:
            contributors = [replicas[cluster_of[p]] for p in ring.participants]
            shard = next(s for s in shard_map.shards if s.ring_id == ring.ring_id)
            expected = mean_of(contributors)
            for name in shard.names:
                torch.testing.assert_close(averaged[name].double(), expected[name], atol=1e-6, rtol=0)
            if victim in shard.owners and victim not in ring.participants:
                assert ring.attempts >= 2  # dropped: the ring went round again without it
            elif victim in shard.owners:  # its attempt completed before the kill landed (a busy host):
                assert ring.attempts == 1  # the survivors apply that mean (`averaging/commit.py`)


async def test_round_without_answering_peers_returns_local_values_by_the_deadline():
    config = SMALL_PARTS.model_copy(update={"round_timeout_s": 3.0})
    _net, shard_map, servers, cluster_of = await fake_swarm(2, config)
    replicas = [replica(0), replica(1)]
    peer = next(p for p, c in cluster_of.items() if c == 0)
    averaged, metrics = await asyncio.wait_for(
        servers[peer].all_reduce(shard_map, owned(shard_map, peer, replicas[0]), round_index=0), 5
    )
    for name, value in averaged.items():
        assert torch.equal(value, replicas[0][name])
    assert all(r.participants == (peer,) for r in metrics.rings)


async def test_stalled_member_that_never_joins_the_round_is_dropped():
    config = SMALL_PARTS.model_copy(update={"step_timeout_s": 0.5})
    _net, shard_map, servers, cluster_of = await fake_swarm(3, config)
    replicas = [replica(seed) for seed in range(3)]
    stalled = [p for p, c in cluster_of.items() if c == 0]  # serving, but never starts the round
    results = await asyncio.wait_for(run_round(servers, shard_map, replicas, cluster_of, skip=stalled), 10)
    survivors_mean = mean_of(replicas[1:])
    for averaged, metrics in results.values():
        assert all(len(r.participants) == 2 for r in metrics.rings)
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), survivors_mean[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("wait_for_all", [False, True])
async def test_closing_round_waits_for_a_member_that_is_behind(wait_for_all):
    """A member of the epoch's rings that reaches the round after several step deadlines: a closing
    round (`wait_for_all`) waits for it and every replica gets the mean of both; a periodic round
    leaves it out (the early member keeps its values, the late one finds the round over)."""
    config = SMALL_PARTS.model_copy(update={"step_timeout_s": 0.5, "probe_timeout_s": 0.3})
    _net, shard_map, servers, cluster_of = await fake_swarm(2, config)
    replicas = [replica(0), replica(1)]
    late = [p for p, c in cluster_of.items() if c == 1]
    for peer in late:
        servers[peer].expect(shard_map)  # as `ReplicaAverager.start` does: it knows the epoch's rings

    def start(peer):
        return asyncio.create_task(
            servers[peer].all_reduce(
                shard_map,
                owned(shard_map, peer, replicas[cluster_of[peer]]),
                round_index=7,
                wait_for_all=wait_for_all,
            )
        )

    early = {p: start(p) for p in servers if p not in late}
    if not wait_for_all:  # the early members finish alone, by their attempts' deadlines
        await asyncio.wait_for(asyncio.gather(*early.values()), 15)
    else:  # the late members start after several step deadlines (not a wait for a condition)
        await asyncio.sleep(4 * config.step_timeout_s)
        assert not any(t.done() for t in early.values())
    tasks = {**early, **{p: start(p) for p in late}}
    results = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 30), strict=True))
    expected = mean_of(replicas)
    for peer, (averaged, metrics) in results.items():
        for ring in metrics.rings:
            assert len(ring.participants) == (2 if wait_for_all else 1), (peer, ring)
        for name, value in averaged.items():
            if wait_for_all:
                torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
            else:
                assert torch.equal(value, replicas[cluster_of[peer]][name])
