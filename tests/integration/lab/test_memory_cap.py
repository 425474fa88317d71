"""The lab's memory cap is enforced: a peer process is in its memory cgroup and going past the cap is an
OOM kill (SIGKILL from the kernel), not a `MemoryError` or a silent success (issue 17, part 2)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ravnest_p2p.lab.netns import NetnsLab
from ravnest_p2p.lab.profiles import parse_profile
from ravnest_p2p.lab.throttle import ComputeThrottle, ThrottleBackend, detect_backend
from tests.integration.lab._support import requires_netns, unique_prefix

pytestmark = pytest.mark.skipif(
    detect_backend() is ThrottleBackend.SIGSTOP, reason="memory caps need writable cgroups"
)

# prints the process's cgroups, then touches `size` bytes one page at a time (so the kernel, not malloc,
# decides: with overcommit an allocation succeeds and the page faults are what the cgroup charges)
GREEDY = (
    "import sys\nprint(open('/proc/self/cgroup').read(), flush=True)\n"
    "b = bytearray(int(sys.argv[1]))\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint('survived')\n"
)
CAP_GB = 0.15


def _memory_group_line(cgroups: str) -> str:
    lines = [line for line in cgroups.splitlines() if ":memory:" in line or line.startswith("0::")]
    return "\n".join(lines)


def _oom_kills(throttle: ComputeThrottle) -> int | None:
    """The group's OOM-kill count (v1 ``memory.oom_control``, v2 ``memory.events``), None if not exposed."""
    for group in throttle._groups:
        for name in ("memory.oom_control", "memory.events"):
            path = Path(group) / name
            if path.exists():
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
    return None


def _check(throttle: ComputeThrottle, run: subprocess.CompletedProcess[bytes] | None, size: int) -> None:
    assert run is not None
    out = run.stdout.decode()
    assert f"ravnest-{throttle.name}" in _memory_group_line(out), out
    if size > CAP_GB * 1e9:
        assert run.returncode == -signal.SIGKILL, (run.returncode, out)
        assert "survived" not in out
        kills = _oom_kills(throttle)
        assert kills is None or kills >= 1
    else:
        assert run.returncode == 0, out
        assert "survived" in out


@pytest.mark.parametrize("size", [int(3 * CAP_GB * 1e9), int(0.3 * CAP_GB * 1e9)], ids=["past", "under"])
def test_past_the_cap_is_an_oom_kill(size: int) -> None:
    with ComputeThrottle(name="rvm" + secrets.token_hex(3), slowdown=1.0, memory_gb=CAP_GB) as throttle:
        argv = throttle.wrap_argv([sys.executable, "-c", GREEDY, str(size)])
        run = subprocess.run(argv, capture_output=True, check=False, timeout=60)
        _check(throttle, run, size)


@requires_netns[0]
@requires_netns[1]
def test_a_lab_peer_is_in_its_memory_group_and_killed_past_its_cap() -> None:
    profile = parse_profile({"run_id": "mem", "peers": [{"name": "a", "memory_gb": CAP_GB}]})
    size = int(3 * CAP_GB * 1e9)
    with NetnsLab(profile, prefix=unique_prefix()) as netlab:
        throttle = netlab.throttle_for(0, base_cpus=1.0)
        throttle.create()
        try:
            proc = netlab.run_in_ns(
                0, [sys.executable, "-c", GREEDY, str(size)], throttle=throttle, stdout=subprocess.PIPE
            )
            out, _ = proc.communicate(timeout=60)
            _check(throttle, subprocess.CompletedProcess(proc.args, proc.returncode, out, b""), size)
        finally:
            throttle.close()
