"""A lab peer's compute figure pinned by config (`EmulationConfig.flops_per_s`): no measurement at all,
so a test's plan does not depend on how busy the host was when its peers started."""

from __future__ import annotations

import pytest

from ravnest_p2p import node
from ravnest_p2p.node import EmulationConfig

pytestmark = pytest.mark.timeout(60)


async def test_a_pinned_compute_figure_is_reported_scaled_and_never_measured(make_swarm, monkeypatch):
    def measure(*_args, **_kwargs):
        raise AssertionError("a pinned peer measured its compute")

    monkeypatch.setattr(node, "measure_matmul_flops", measure)
    monkeypatch.setattr(node, "remeasure_matmul_flops", measure)
    emulate = EmulationConfig(flops_per_s=3e9, flops_scale=2.0)
    [peer] = await make_swarm(1, "pinned-tidy", emulate=emulate, compute_refresh_s=0.01)
    assert peer.flops == 3e9
    assert peer._make_record().flops == 6e9
    assert "compute-refresh" not in {task.get_name() for task in peer._tasks._tasks}
