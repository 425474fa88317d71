"""The hard-case generator of benchmarks/placement_cases.py is seeded, unequal and twin-free."""

from __future__ import annotations

import numpy as np
from benchmarks.placement_cases import make_case

from ravnest_p2p.planning.dtfm_structure import twin_classes


def test_cases_are_seeded_and_noisy() -> None:
    a, b = make_case(8, 8, 0), make_case(8, 8, 0)
    assert np.array_equal(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s)
    assert not np.array_equal(a.bandwidth_bytes_per_s, make_case(8, 8, 1).bandwidth_bytes_per_s)
    assert sum(a.city_sizes) == 64
    assert len(set(a.city_sizes)) > 2
    assert np.allclose(a.latency_s, a.latency_s.T)
    assert np.allclose(a.bandwidth_bytes_per_s, a.bandwidth_bytes_per_s.T)
    model = a.model()
    assert len(set(twin_classes(model).tolist())) == 64  # no interchangeable devices
