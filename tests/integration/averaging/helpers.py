"""The averaging tests' real swarm: 3 clusters x 2 stages over loopback daemons, and its replicas."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ravnest_p2p.averaging import (
    AveragerConfig,
    OuterAverager,
    OuterOptimizer,
    OuterOptimizerConfig,
    RingAllReduce,
    RingConfig,
    ShardMap,
)

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

Params = dict[str, torch.Tensor]


def replica(seed: int) -> Params:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def drift(live: Mapping[str, Params], cluster_of: Mapping[str, int], round_index: int) -> None:
    """Local training between two outer steps: each cluster moves its weights its own way."""
    for peer, params in live.items():
        gen = torch.Generator().manual_seed(100 * round_index + cluster_of[peer])
        for name in sorted(params):
            params[name].add_(0.01 * torch.randn(params[name].shape, generator=gen))


def outer_averagers(
    servers: list[RingAllReduce],
    shard_map: ShardMap,
    owner_values: Mapping[str, tuple[int, Params]],
    config: OuterOptimizerConfig,
) -> tuple[dict[str, Params], dict[str, OuterAverager]]:
    """One `OuterAverager` per stage owner (outer step every round), all from `replica(0)`'s weights.

    Returns:
        ``(live, averagers)`` by peer id: the parameters each owner trains (the averagers read and
        write them in place) and its averager.
    """
    start = replica(0)  # every cluster starts from the same weights (the job's seed)
    live = {p: {n: start[n].clone() for n in named} for p, (_, named) in owner_values.items()}
    averagers = {}
    for server in servers:
        p = server.peer_id
        outer = OuterOptimizer(config)
        outer.initialise(live[p])
        averagers[p] = OuterAverager(
            AveragerConfig(period_steps=1),
            server,
            outer=outer,
            read=lambda mine=live[p]: mine,
            write=_writer(live[p]),
            shard_map=lambda: shard_map,
        )
    return live, averagers


def _writer(mine: Params) -> Callable[[Mapping[str, torch.Tensor]], None]:
    def write(named: Mapping[str, torch.Tensor]) -> None:
        for name, value in named.items():
            mine[name].copy_(value)

    return write
