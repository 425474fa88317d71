"""A CPU-capped peer must measure (and so advertise) less compute: the probe is sustained, not a burst.

The shared host's load changes what an uncapped probe gets, so the checks use the CPU share each probe
really got (process CPU seconds / wall seconds), measured beside its FLOP/s.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, detect_backend, thread_env

PROBE = (
    "import torch; torch.set_num_threads(1);"
    "from ravnest_p2p.measurement.compute import take_reading as r;"
    "x = r(); print(x.flops, x.cpu_share)"
)


def measure(argv_prefix: list[str]) -> tuple[float, float]:
    """(FLOP/s, CPU share the probe got) of one sustained probe in a fresh process."""
    proc = subprocess.run(
        [*argv_prefix, sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **thread_env(1)},
        check=True,
    )
    flops, share = proc.stdout.strip().splitlines()[-1].split()
    return float(flops), float(share)


@pytest.mark.netns
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a cgroup")
def test_quarter_cpu_quota_measures_about_a_quarter_of_the_flops():
    if detect_backend() not in (ThrottleBackend.CGROUP1, ThrottleBackend.CGROUP2):
        pytest.skip("no writable cgroup CPU controller here")
    full_flops, full_share = measure([])
    with ComputeThrottle(name=f"rvq{os.getpid()}", slowdown=4.0, base_cpus=1.0) as throttle:
        capped_flops, capped_share = measure(throttle.wrap_argv([]))
    figures = {"full": (full_flops, full_share), "capped": (capped_flops, capped_share)}
    # the quota holds over the whole probe (a burst inside one quota period would show a share near 1)
    assert capped_share < 0.32, figures
    # the figure follows the CPU the probe really got: FLOP/s = speed per CPU-second x share. Both sides
    # of this are taken in the same run, so a busy host (which lowers both shares) does not break it.
    per_cpu_s = full_flops / full_share
    assert 0.6 < capped_flops / (per_cpu_s * capped_share) < 1.5, figures
    if full_share > 0.8:  # an uncontended full-speed reading: the plain ratio is about a quarter too
        assert 0.12 < capped_flops / full_flops < 0.45, figures
