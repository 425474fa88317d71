"""Compute throttling holds: a CPU-bound loop under slowdown k does 1/k of the unthrottled work (±20%).

What "unthrottled work" means depends on the mechanism, because the two cap different things:

- cgroup quotas are absolute (1/k of one CPU), so the ratio is the loop's wall time over the CPU time it
  got. Iteration counts would be biased whenever other processes share the two cores: an unthrottled
  run then gets less than a CPU, and even iterations per CPU-second drop when a sibling hyperthread is
  busy (seen: 3.84 for k = 3 in a full test run, from counts).
- the sigstop duty cycle is relative (1/k of whatever CPU the process would get), so the reference is
  the wall-clock count of unthrottled runs made just before and after.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time

import pytest

from ravnest_p2p.lab.netns import NetnsLab
from ravnest_p2p.lab.profiles import parse_profile
from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, detect_backend
from tests.integration.lab._support import requires_netns, unique_prefix

LOOP_S = 1.5
# Counts loop iterations for LOOP_S of wall-clock time, timed by the child itself so start-up is excluded;
# prints the count and the CPU time the loop used.
LOOP = (
    f"import time\nn = 0\ncpu = time.process_time()\nend = time.monotonic() + {LOOP_S!r}\n"
    "while time.monotonic() < end:\n    n += 1\nprint(n, time.process_time() - cpu)"
)
TOLERANCE = 0.20


def _work(throttle: ComputeThrottle | None) -> tuple[int, float]:
    argv = [sys.executable, "-c", LOOP]
    if throttle is not None:
        argv = throttle.wrap_argv(argv)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    if throttle is not None and throttle.backend is ThrottleBackend.SIGSTOP:
        throttle.attach(proc.pid)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    return _parse(out)


def _parse(out: bytes) -> tuple[int, float]:
    count, cpu_s = out.split()
    return int(count), float(cpu_s)


def _slowdown(
    throttled: tuple[int, float], baselines: list[tuple[int, float]], backend: ThrottleBackend
) -> float:
    """How much the throttle slowed the loop down (see the module docstring)."""
    if backend is ThrottleBackend.SIGSTOP:
        return sum(n for n, _ in baselines) / len(baselines) / throttled[0]
    return LOOP_S / throttled[1]


def _name() -> str:
    return "rvt" + secrets.token_hex(3)


def test_cpu_slowdown_ratio() -> None:
    """The mechanism the lab uses on this host (see `test_sigstop_driver_stops_and_releases` too)."""
    backend = None
    slowdowns = (2.0, 4.0)
    baselines = [_work(None)]
    throttled = []
    for slowdown in slowdowns:
        with ComputeThrottle(name=_name(), slowdown=slowdown, backend=backend) as throttle:
            throttled.append(_work(throttle))
        baselines.append(_work(None))
    for run, slowdown in zip(throttled, slowdowns, strict=True):
        ratio = _slowdown(run, baselines, backend or detect_backend())
        assert ratio == pytest.approx(slowdown, rel=TOLERANCE), (slowdown, ratio, baselines, throttled)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_for_state(pid: int, wanted: set[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _state(pid) in wanted:
            return True
        time.sleep(0.002)  # polling interval, bounded by the deadline
    return False


def test_sigstop_driver_stops_and_releases() -> None:
    """The fallback's mechanics, independent of host load.

    Its work ratio is not asserted here: the duty cycle is relative to the CPU the process would get
    anyway, so on this shared 2-core host other load moves it past ±20% (quiet host: 1.98-2.00 for
    k = 2, 3.82-3.99 for k = 4; under load 2-3: 2.4-3.1 and 3.2-5.3).
    """
    spin = [sys.executable, "-c", "while True: pass"]
    with ComputeThrottle(name=_name(), slowdown=4.0, backend=ThrottleBackend.SIGSTOP) as throttle:
        proc = subprocess.Popen(throttle.wrap_argv(spin), start_new_session=True)
        try:
            assert _wait_for_state(proc.pid, {"T"}, 5.0)  # starts stopped
            throttle.attach(proc.pid)
            assert _wait_for_state(proc.pid, {"R", "S"}, 5.0)  # released by the driver ...
            assert _wait_for_state(proc.pid, {"T"}, 5.0)  # ... and stopped again on the cycle
            throttle.close()
            assert _wait_for_state(proc.pid, {"R", "S"}, 5.0)  # left running after close
            time.sleep(0.3)  # two would-be duty cycles: check nobody stops it any more
            assert _state(proc.pid) in {"R", "S"}
        finally:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.skipif(detect_backend() is ThrottleBackend.SIGSTOP, reason="memory caps need writable cgroups")
def test_memory_cap_kills_a_greedy_process() -> None:
    with ComputeThrottle(name=_name(), slowdown=1.0, memory_gb=0.1) as throttle:
        greedy = throttle.wrap_argv([sys.executable, "-c", "b = b'x' * 400_000_000"])
        assert subprocess.run(greedy, check=False, timeout=30).returncode != 0
        modest = throttle.wrap_argv([sys.executable, "-c", "b = b'x' * 10_000_000"])
        assert subprocess.run(modest, check=False, timeout=30).returncode == 0


@pytest.mark.parametrize("_", [0], ids=["in-namespace"])
@requires_netns[0]
@requires_netns[1]
def test_throttle_applies_inside_namespace(_: int) -> None:
    profile = parse_profile({"run_id": "thr", "peers": [{"name": "a"}]})
    with NetnsLab(profile, prefix=unique_prefix()) as netlab:

        def work(throttle: ComputeThrottle | None) -> tuple[int, float]:
            argv = [sys.executable, "-c", LOOP]
            proc = netlab.run_in_ns(0, argv, throttle=throttle, stdout=subprocess.PIPE)
            out, _ = proc.communicate(timeout=30)
            return _parse(out)

        base = work(None)
        with ComputeThrottle(name=_name(), slowdown=3.0) as throttle:
            slow = work(throttle)
            backend = throttle.backend
        assert _slowdown(slow, [base], backend) == pytest.approx(3.0, rel=TOLERANCE), (base, slow)
