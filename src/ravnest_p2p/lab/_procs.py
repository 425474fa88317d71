"""Process helpers for the lab: run ``ip``/``tc``, find and kill processes by pid, with deadlines."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

__all__ = ["entering_pids", "kill_groups", "run"]

logger = logging.getLogger(__name__)

_KILL_TIMEOUT_S = 5.0


def run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command (``ip``, ``tc``) to completion, capturing its output.

    Raises:
        RuntimeError: with the command's stderr, when ``check`` and it exits non-zero.
    """
    logger.debug("lab: %s", " ".join(argv))
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"command failed ({result.returncode}): {' '.join(argv)}: {result.stderr.strip()}")
    return result


def _wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.02)  # polling interval, bounded by the deadline above
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Signal ``pid``'s process group (or just ``pid`` if it leads none); False if it is gone."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
    return True


def entering_pids(namespaces: Sequence[str]) -> list[int]:
    """Pids still running ``ip netns exec <ns>`` for one of ``namespaces``: started, not yet inside.

    ``ip netns pids`` cannot see them, yet they would enter the namespace (keeping it alive, nameless)
    right after we delete it.
    """
    wanted = set(namespaces)
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        for i in range(1, len(argv) - 2):  # also behind a wrapper such as the throttle's `sh -c`
            if argv[i : i + 2] == [b"netns", b"exec"] and argv[i + 2].decode(errors="replace") in wanted:
                pids.append(int(entry.name))
                break
    return pids


def kill_groups(pids: list[int], prefix: str) -> None:
    """SIGTERM the pids' process groups, SIGKILL what is left after a deadline."""
    for pid in pids:
        signal_group(pid, signal.SIGTERM)
    stubborn = _wait_gone(pids, _KILL_TIMEOUT_S)
    for pid in stubborn:
        signal_group(pid, signal.SIGKILL)
    still = _wait_gone(stubborn, _KILL_TIMEOUT_S)
    if still:
        logger.warning("lab %s: processes survived SIGKILL: %s", prefix, still)
