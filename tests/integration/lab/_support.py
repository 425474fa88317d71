"""Helpers for the lab's integration tests: skip rules, unique prefixes, transfers, leftover checks."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import psutil
import pytest

from ravnest_p2p.lab.netns import NetnsLab

_missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
_reason = (
    "needs root to build network namespaces"
    if os.geteuid() != 0
    else f"needs iproute2 tools: {', '.join(_missing)} not found"
)
requires_netns = [pytest.mark.netns, pytest.mark.skipif(os.geteuid() != 0 or bool(_missing), reason=_reason)]

TRANSFER_TIMEOUT_S = 15.0


def unique_prefix() -> str:
    """A fresh lab prefix, so concurrent test sessions never collide.

    ``RAVNEST_LAB_STEM`` (at most 6 lowercase letters or digits) replaces the stem ``rvt``, so sessions
    sharing a host can tell their labs apart (e.g. ``stable`` -> ``stable3f``).
    """
    stem = os.environ.get("RAVNEST_LAB_STEM", "rvt")[:6]
    return stem + secrets.token_hex(4)[: 8 - len(stem)]


def run_tag() -> str:
    """``RAVNEST_RUN_TAG`` (default empty): appended to lab run ids, like the stem to prefixes."""
    return os.environ.get("RAVNEST_RUN_TAG", "")


def measure_mbps(
    netlab: NetnsLab, src: int, dst: int, *, expected_mbps: float, seconds: float = 3.0
) -> float:
    """Send ~``seconds`` worth of bytes at ``expected_mbps`` from peer src to dst; the receiver's rate."""
    num_bytes = int(expected_mbps * 1e6 / 8 * seconds)
    tool = [sys.executable, "-m", "ravnest_p2p.lab.rawtransfer"]
    host = netlab.address_of(dst)
    server = netlab.run_in_ns(
        dst,
        [
            *tool,
            "serve",
            "--host",
            host,
            "--max-bytes",
            str(num_bytes),
            "--timeout-s",
            str(TRANSFER_TIMEOUT_S),
        ],
        stdout=subprocess.PIPE,
    )
    assert server.stdout is not None
    port = json.loads(server.stdout.readline())["listening"]
    client = netlab.run_in_ns(
        src,
        [*tool, "send", "--host", host, "--port", str(port), "--bytes", str(num_bytes)],
        stdout=subprocess.DEVNULL,
    )
    out, _ = server.communicate(timeout=TRANSFER_TIMEOUT_S + 5)
    assert client.wait(timeout=TRANSFER_TIMEOUT_S + 5) == 0
    result = json.loads(out)
    assert result["num_bytes"] >= num_bytes * 0.9, result
    return float(result["mbps"])


def assert_no_leftovers(prefix: str, pids: list[int]) -> None:
    """No namespace, root-namespace link or started process of the lab remains."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in namespaces.splitlines() if line.startswith(f"{prefix}-")], namespaces
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert prefix not in links
    for pid in pids:
        if psutil.pid_exists(pid):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
