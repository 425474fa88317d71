"""Multi-ring all-reduce over real p2p daemons on loopback: 3 clusters x 2 stages, different splits."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig, build_shard_map
from ravnest_p2p.transport import HostConfig, P2PTransport, RpcEndpoint, load_or_create_identity

pytestmark = pytest.mark.timeout(90)

# 5 layers, ~1.1 M floats in all (parts of 256 KiB, a few parts per chunk)
SHAPES = {
    "0.weight": (256, 256),
    "0.bias": (256,),
    "1.weight": (512, 256),
    "2.running_mean": (512,),
    "2.weight": (512,),
    "3.weight": (512, 512),
    "4.weight": (256, 512),
    "4.bias": (256,),
}
SPLITS = [3, 1, 4]  # cluster c: stage 0 = layers < SPLITS[c], stage 1 = the rest
CONFIG = RingConfig(part_size_bytes=256 << 10, step_timeout_s=3.0, probe_timeout_s=1.0)


def replica(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


@pytest.fixture
async def swarm():
    transports = await asyncio.gather(
        *(P2PTransport.create(HostConfig(), load_or_create_identity(None)) for _ in range(2 * len(SPLITS)))
    )
    servers: list[RingAllReduce] = []
    closed: set[int] = set()
    try:
        maddrs = {t.peer_id: await t.visible_maddrs() for t in transports}
        for t in transports:
            for peer_id, addrs in maddrs.items():
                if peer_id != t.peer_id:
                    t.add_addresses(peer_id, addrs)
        clusters, owner_values = [], {}
        for c, cut in enumerate(SPLITS):
            values = replica(c)
            stages = []
            for s in range(2):
                peer = transports[2 * c + s].peer_id
                names = [n for n in SHAPES if (int(n.split(".")[0]) < cut) == (s == 0)]
                stages.append((peer, [(n, values[n].numel()) for n in names]))
                owner_values[peer] = (c, {n: values[n] for n in names})
            clusters.append(stages)
        shard_map = build_shard_map(clusters, epoch=2)
        for t in transports:
            server = RingAllReduce(RpcEndpoint(t, "it-avg"), CONFIG)
            await server.start()
            servers.append(server)
        yield transports, servers, shard_map, owner_values, closed
    finally:
        for i, server in enumerate(servers):
            if i not in closed:
                await server.aclose()
        open_transports = [t for i, t in enumerate(transports) if i not in closed]
        await asyncio.wait_for(
            asyncio.gather(*(t.aclose() for t in open_transports), return_exceptions=True), 30
        )


def mean(seeds: list[int], name: str) -> torch.Tensor:
    return torch.stack([replica(s)[name].double() for s in seeds]).mean(0)


async def test_three_clusters_average_exactly(swarm):
    _, servers, shard_map, owner_values, _ = swarm
    assert len(shard_map.shards) == 4  # cuts at layers 1, 3, 4
    results = await asyncio.gather(
        *(s.all_reduce(shard_map, owner_values[s.peer_id][1], round_index=0) for s in servers)
    )
    for server, (averaged, metrics) in zip(servers, results, strict=True):
        assert set(averaged) == set(owner_values[server.peer_id][1])
        for name, value in averaged.items():
            torch.testing.assert_close(value.double(), mean([0, 1, 2], name), atol=1e-6, rtol=0)
        assert all(len(r.participants) == 3 and r.attempts == 1 for r in metrics.rings)
        assert metrics.bytes_sent > 0


async def test_member_closed_mid_round_is_dropped_and_the_others_finish_in_time(swarm):
    transports, servers, shard_map, owner_values, closed = swarm
    victim = servers[3]  # cluster 1, stage 1: owns layers 1..4 of cluster 1, in three rings
    others = [s for s in servers if s is not victim]

    async def close_victim_soon():
        await asyncio.sleep(0.05)
        closed.add(3)
        await transports[3].aclose()

    started = time.monotonic()
    rounds = asyncio.gather(
        *(s.all_reduce(shard_map, owner_values[s.peer_id][1], round_index=1) for s in others)
    )
    victim_round = asyncio.ensure_future(
        victim.all_reduce(shard_map, owner_values[victim.peer_id][1], round_index=1)
    )
    results, _ = await asyncio.gather(rounds, close_victim_soon())
    elapsed = time.monotonic() - started
    assert elapsed < CONFIG.step_timeout_s * CONFIG.max_attempts + 5
    for averaged, metrics in results:
        for ring in metrics.rings:
            shard = shard_map.by_ring_id(ring.ring_id)
            seeds = sorted(owner_values[p][0] for p in ring.participants)
            if victim.peer_id in shard.owners:
                assert victim.peer_id not in ring.participants or ring.attempts == 1
            for name in shard.names:
                torch.testing.assert_close(averaged[name].double(), mean(seeds, name), atol=1e-6, rtol=0)
    dropped = [r for _, m in results for r in m.rings if len(r.participants) == 2]
    assert dropped, "the victim should have been dropped from at least one ring"
    victim_round.cancel()
    with contextlib.suppress(BaseException):
        await victim_round
