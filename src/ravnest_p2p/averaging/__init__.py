"""Multi-ring all-reduce across clusters: shard map, rings, delayed averaging, outer optimizer."""

from ravnest_p2p.averaging.base import RingConfig, RingMetrics, RoundMetrics
from ravnest_p2p.averaging.outer import OuterOptimizer, OuterOptimizerConfig
from ravnest_p2p.averaging.outer_averager import OuterAverager
from ravnest_p2p.averaging.overlap import Averager, AveragerConfig, delayed_average, wait_for_period_boundary
from ravnest_p2p.averaging.pseudograd import DeltaCompression
from ravnest_p2p.averaging.ring import RingAllReduce
from ravnest_p2p.averaging.shards import (
    Shard,
    ShardMap,
    StageEntries,
    build_shard_map,
    floating_entries,
    layer_order_key,
)

__all__ = [
    "Averager",
    "AveragerConfig",
    "DeltaCompression",
    "OuterAverager",
    "OuterOptimizer",
    "OuterOptimizerConfig",
    "RingAllReduce",
    "RingConfig",
    "RingMetrics",
    "RoundMetrics",
    "Shard",
    "ShardMap",
    "StageEntries",
    "build_shard_map",
    "delayed_average",
    "floating_entries",
    "layer_order_key",
    "wait_for_period_boundary",
]
