"""A toy model split differently per cluster, replicas with different values, and a fake swarm."""

from __future__ import annotations

import torch

from ravnest_p2p.averaging import RingAllReduce, RingConfig
from ravnest_p2p.averaging.shards import ShardMap, build_shard_map
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

# 6 layers, with a BatchNorm-like layer (floating running stats) at index 2
SHAPES: dict[str, tuple[int, ...]] = {
    "0.weight": (16, 8),
    "0.bias": (16,),
    "1.weight": (32, 16),
    "2.running_mean": (32,),
    "2.running_var": (32,),
    "2.weight": (32,),
    "3.weight": (8, 32),
    "3.bias": (8,),
    "4.weight": (50, 8),
    "10.weight": (3, 50),  # layer 10 after layer 4: numeric, not lexicographic, order
}
LAYERS = sorted({int(n.split(".")[0]) for n in SHAPES})

# stage boundaries (layer indices where a new stage starts) per cluster
SPLITS = [[3], [1, 4], [2, 3, 10], [4]]


def stage_names(cuts: list[int]) -> list[list[str]]:
    bounds = [min(LAYERS), *cuts, max(LAYERS) + 1]
    return [
        [n for n in SHAPES if bounds[k] <= int(n.split(".")[0]) < bounds[k + 1]]
        for k in range(len(bounds) - 1)
    ]


def make_clusters(num_clusters: int, splits: list[list[int]] = SPLITS) -> list[list[tuple[str, list]]]:
    clusters = []
    for c in range(num_clusters):
        stages = stage_names(splits[c % len(splits)])
        clusters.append(
            [
                (f"c{c}s{s}", [(n, int(torch.Size(SHAPES[n]).numel())) for n in names])
                for s, names in enumerate(stages)
            ]
        )
    return clusters


def replica(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, shape in SHAPES.items()}


def mean_of(replicas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: torch.stack([r[n].double() for r in replicas]).mean(0) for n in SHAPES}


def owned(shard_map: ShardMap, peer_id: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {n for s in shard_map.shards_of(peer_id) for n in s.names}
    return {n: values[n] for n in names}


async def fake_swarm(
    num_clusters: int, config: RingConfig, *, epoch: int = 1
) -> tuple[FakeNetwork, ShardMap, dict[str, RingAllReduce], dict[str, int]]:
    """Ring servers for every stage owner; returns (network, map, peer → server, peer → cluster)."""
    clusters = make_clusters(num_clusters)
    shard_map = build_shard_map(clusters, epoch=epoch)
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    servers, cluster_of = {}, {}
    for c, stages in enumerate(clusters):
        for peer_id, _ in stages:
            endpoint = RpcEndpoint(net.create(peer_id), "run")
            servers[peer_id] = RingAllReduce(endpoint, config, streams=hub.streams(peer_id))
            await servers[peer_id].start()
            cluster_of[peer_id] = c
    return net, shard_map, servers, cluster_of
