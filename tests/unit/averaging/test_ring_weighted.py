"""Rings with chunks sized by link rate: still the exact mean, less traffic for the slow member."""

import asyncio
import time

import torch

from ravnest_p2p.averaging import RingConfig
from tests.unit.averaging.helpers import fake_swarm, mean_of, owned, replica

SMALL_PARTS = RingConfig(part_size_bytes=1024, step_timeout_s=2.0, probe_timeout_s=0.5)
RATES_MBPS = [25.0, 50.0, 100.0, 200.0]  # by cluster


async def run_round(servers, shard_map, replicas, cluster_of, *, round_index, link_rates):
    peers = list(servers)
    results = await asyncio.gather(
        *(
            servers[p].all_reduce(
                shard_map,
                owned(shard_map, p, replicas[cluster_of[p]]),
                round_index=round_index,
                link_rates=link_rates(p),
            )
            for p in peers
        )
    )
    return dict(zip(peers, results, strict=True))


def sent_by(results, cluster_of, cluster):
    return sum(m.bytes_sent for p, (_, m) in results.items() if cluster_of[p] == cluster)


async def test_weighted_chunks_give_the_exact_mean_and_unload_the_slow_member():
    _net, shard_map, servers, cluster_of = await fake_swarm(4, SMALL_PARTS)
    rates = {p: (RATES_MBPS[c], RATES_MBPS[c]) for p, c in cluster_of.items()}
    replicas = [replica(seed) for seed in range(4)]
    expected = mean_of(replicas)
    equal = await run_round(
        servers, shard_map, replicas, cluster_of, round_index=0, link_rates=lambda p: None
    )
    weighted = await run_round(
        servers, shard_map, replicas, cluster_of, round_index=1, link_rates=lambda p: rates
    )
    by_name: dict[str, list[torch.Tensor]] = {}
    for averaged, metrics in weighted.values():
        assert all(len(r.participants) == 4 and r.attempts == 1 for r in metrics.rings)
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
            by_name.setdefault(name, []).append(value)
    assert all(torch.equal(v[0], w) for v in by_name.values() for w in v)  # replicas agree bitwise
    # every ring has one member per cluster; the 25 Mbit/s one now sends each shard ~once, not 1.5x
    total = sum(s.numel for s in shard_map.shards) * 4
    assert sent_by(weighted, cluster_of, 0) <= total * 1.01
    assert sent_by(equal, cluster_of, 0) >= total * 1.45
    # the total, 2(C-1) S per ring, does not change: the faster members carry what the slow one no longer does
    assert sum(sent_by(weighted, cluster_of, c) for c in range(4)) == sum(
        sent_by(equal, cluster_of, c) for c in range(4)
    )


async def test_weighting_can_be_switched_off():
    config = SMALL_PARTS.model_copy(update={"weighted_chunks": False})
    _net, shard_map, servers, cluster_of = await fake_swarm(4, config)
    rates = {p: (RATES_MBPS[c], RATES_MBPS[c]) for p, c in cluster_of.items()}
    replicas = [replica(seed) for seed in range(4)]
    results = await run_round(
        servers, shard_map, replicas, cluster_of, round_index=0, link_rates=lambda p: rates
    )
    total = sum(s.numel for s in shard_map.shards) * 4
    assert sent_by(results, cluster_of, 0) >= total * 1.45


async def test_members_given_different_rates_refuse_each_other_and_keep_their_values():
    config = SMALL_PARTS.model_copy(update={"round_timeout_s": 8.0})
    _net, shard_map, servers, cluster_of = await fake_swarm(3, config)
    rates = {p: (RATES_MBPS[c], RATES_MBPS[c]) for p, c in cluster_of.items()}
    odd = next(p for p, c in cluster_of.items() if c == 1)
    other = {**rates, odd: (10.0, 10.0)}  # this member believes it is the slowest
    replicas = [replica(seed) for seed in range(3)]
    results = await asyncio.wait_for(
        run_round(
            servers,
            shard_map,
            replicas,
            cluster_of,
            round_index=0,
            link_rates=lambda p: other if p == odd else rates,
        ),
        12,
    )
    odd_rings = {s.ring_id for s in shard_map.shards_of(odd)}
    expected = mean_of(replicas)
    for peer, (averaged, metrics) in results.items():
        local = replicas[cluster_of[peer]]
        for ring in metrics.rings:
            shard = shard_map.by_ring_id(ring.ring_id)
            assert shard is not None
            if ring.ring_id in odd_rings:
                assert ring.participants == (peer,)
                assert all(torch.equal(averaged[n], local[n]) for n in shard.names)
            else:
                assert len(ring.participants) == 3
                for name in shard.names:
                    torch.testing.assert_close(averaged[name].double(), expected[name], atol=1e-6, rtol=0)


async def test_paced_rings_stay_exact_and_keep_to_the_rate():
    config = SMALL_PARTS.model_copy(update={"pace_fraction": 0.5})
    _net, shard_map, servers, cluster_of = await fake_swarm(3, config)
    rates = {p: (4e5 * (c + 1), 4e5 * (c + 1)) for p, c in cluster_of.items()}  # bytes/s
    replicas = [replica(seed) for seed in range(3)]
    expected = mean_of(replicas)
    started = time.monotonic()
    results = await run_round(
        servers, shard_map, replicas, cluster_of, round_index=0, link_rates=lambda p: rates
    )
    elapsed = time.monotonic() - started
    # a cluster-0 member's links run at min(4e5, its neighbour's >= 4e5), paced to half of that
    slowest_ring_bytes = max(
        r.bytes_sent for p, (_, m) in results.items() if cluster_of[p] == 0 for r in m.rings
    )
    assert elapsed >= slowest_ring_bytes / 2e5 * 0.9
    for averaged, metrics in results.values():
        assert all(len(r.participants) == 3 for r in metrics.rings)
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), expected[name], atol=1e-6, rtol=0)
