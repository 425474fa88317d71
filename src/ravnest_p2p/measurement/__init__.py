"""Self-measurement: compute (matmul FLOP/s), free memory, and network (RTT, bandwidth) probes."""

from ravnest_p2p.measurement.compute import measure_matmul_flops, remeasure_matmul_flops
from ravnest_p2p.measurement.links import LinkPublisher, PublishedLink
from ravnest_p2p.measurement.memory import (
    framework_overhead_bytes,
    free_memory_bytes,
    memory_snapshot,
    peak_rss_bytes,
    release_free_memory,
    steady_memory_bytes,
)
from ravnest_p2p.measurement.network import LinkEstimate, NetworkMeter, ProbeConfig

__all__ = [
    "LinkEstimate",
    "LinkPublisher",
    "NetworkMeter",
    "ProbeConfig",
    "PublishedLink",
    "framework_overhead_bytes",
    "free_memory_bytes",
    "measure_matmul_flops",
    "memory_snapshot",
    "peak_rss_bytes",
    "release_free_memory",
    "remeasure_matmul_flops",
    "steady_memory_bytes",
]
