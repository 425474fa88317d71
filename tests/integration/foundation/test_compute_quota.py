"""A CPU-capped peer must measure (and so advertise) less compute: the probe is sustained, not a burst."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, detect_backend, thread_env

PROBE = (
    "import torch; torch.set_num_threads(1);"
    "from ravnest_p2p.measurement.compute import measure_matmul_flops as m;"
    "print(m(use_cache=False))"
)


def measure(argv_prefix: list[str]) -> float:
    proc = subprocess.run(
        [*argv_prefix, sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **thread_env(1)},
        check=True,
    )
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a cgroup")
def test_quarter_cpu_quota_measures_about_a_quarter_of_the_flops():
    if detect_backend() not in (ThrottleBackend.CGROUP1, ThrottleBackend.CGROUP2):
        pytest.skip("no writable cgroup CPU controller here")
    full = measure([])
    with ComputeThrottle(name=f"rvq{os.getpid()}", slowdown=4.0, base_cpus=1.0) as throttle:
        capped = measure(throttle.wrap_argv([]))
    ratio = capped / full
    # 1/4 of a CPU; the machine is shared, so only a wide band is meaningful here
    assert 0.12 < ratio < 0.45, (full, capped)
