"""The strategies package's public surface (pinned so it grows on purpose)."""

from __future__ import annotations

import ravnest_p2p.strategies as strategies


def test_public_api_is_pinned():
    assert sorted(strategies.__all__) == [
        "AsyncShardOwner",
        "GradientRejected",
        "IstDeal",
        "IstTraffic",
        "ScaleRule",
        "StepUpdate",
        "Submission",
        "SyncAggregator",
        "SyncBackupOwner",
        "Verdict",
        "deal_hidden_units",
        "eval_layers",
        "extract_subnetwork",
        "hidden_sizes",
        "ist_bytes_per_worker",
        "recalibrate_batchnorm",
        "subnetwork_bytes",
        "train_ist_round",
        "write_back",
    ]
    for name in strategies.__all__:
        assert hasattr(strategies, name)


def test_the_theory_simulator_does_not_need_torch():
    import ast
    import inspect

    from ravnest_p2p.strategies import ist_theory

    tree = ast.parse(inspect.getsource(ist_theory))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "torch" not in imported
    assert imported <= {"__future__", "dataclasses", "collections", "numpy"}
