from __future__ import annotations

import subprocess
import sys

import ravnest_p2p.planning as planning


def test_public_api_is_pinned() -> None:
    assert sorted(planning.__all__) == [
        "ClusterPlan",
        "CostModel",
        "DEFAULT_LATENCY_S",
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
    assert all(hasattr(planning, name) for name in planning.__all__)


def test_planning_imports_no_torch_hivemind_or_asyncio() -> None:
    code = (
        "import sys, ravnest_p2p.planning; "
        "print(sorted(m for m in ('torch', 'hivemind', 'asyncio') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "[]"
