"""Pure planning: clustering, stage partition and ordering, DT-FM placement (no I/O, no asyncio)."""

from ravnest_p2p.planning.clustering import cluster_peers, homogeneity, peer_features
from ravnest_p2p.planning.dtfm import (
    CostModel,
    Placement,
    Workload,
    bottleneck_matching,
    open_loop_tsp,
    random_placement,
)
from ravnest_p2p.planning.dtfm_search import SearchConfig, SearchResult, hybrid_search
from ravnest_p2p.planning.links import DEFAULT_LATENCY_S, LinkMatrix, LinkReport
from ravnest_p2p.planning.ordering import order_stages
from ravnest_p2p.planning.partition import (
    evaluate_partition,
    layer_memory_bytes,
    model_memory_bytes,
    partition_layers,
)
from ravnest_p2p.planning.plan import make_plan
from ravnest_p2p.planning.types import (
    ClusterPlan,
    InfeasiblePlan,
    JobParams,
    PeerCapacity,
    PeerLinkRate,
    PlacedStage,
    Plan,
    StageAssignment,
)

__all__ = [
    "DEFAULT_LATENCY_S",
    "ClusterPlan",
    "CostModel",
    "InfeasiblePlan",
    "JobParams",
    "LinkMatrix",
    "LinkReport",
    "PeerCapacity",
    "PeerLinkRate",
    "PlacedStage",
    "Placement",
    "Plan",
    "SearchConfig",
    "SearchResult",
    "StageAssignment",
    "Workload",
    "bottleneck_matching",
    "cluster_peers",
    "evaluate_partition",
    "homogeneity",
    "hybrid_search",
    "layer_memory_bytes",
    "make_plan",
    "model_memory_bytes",
    "open_loop_tsp",
    "order_stages",
    "partition_layers",
    "peer_features",
    "random_placement",
]
