"""Emulating slower volunteer PCs: cap a peer process's CPU (and optionally memory).

A profile's ``compute_slowdown = k`` means the peer should do 1/k of the work per second that it would
do at full speed. Three mechanisms, best first; `detect_backend` picks the first that works here:

1. ``cgroup2``: a child cgroup with ``cpu.max = "<quota> <period>"`` (and ``memory.max``). Exact: the
   kernel's CFS bandwidth control lets the group run ``quota`` µs per ``period`` µs, summed over threads.
2. ``cgroup1``: the same with the v1 ``cpu`` hierarchy (``cpu.cfs_quota_us``/``cpu.cfs_period_us``) and
   the v1 ``memory`` hierarchy (``memory.limit_in_bytes``). This machine mounts the v1 controllers
   (its cgroup2 mount has no ``cpu`` controller), so this is what runs here.
3. ``sigstop``: a small driver process stops and continues the peer's process group on a duty cycle
   (runs ``period/k``, stopped for the rest, on an absolute schedule). The peer starts stopped and the
   driver releases it, so it never runs free. Approximate (signal latency, stops mid-syscall, no
   memory cap) — the fallback when cgroups are not writable, e.g. unprivileged containers.

The two kinds differ under load. A cgroup quota is absolute: at most ``base_cpus / k`` CPUs. A quota is
only a cap, so the group also gets 8x the default CPU weight: when other processes load the host it
still wins its full quota, so a slow peer is as slow as specified (not slower) and the load falls on the
unthrottled, fast peers. The duty cycle is relative: 1/k of whatever CPU the process would get anyway,
so its ratio to an unthrottled run drifts with the host's load.

The CPU cap is ``base_cpus / k`` CPUs, where ``base_cpus`` is the CPU share of a full-speed peer. Start
the peer with `thread_env` (e.g. 1 thread) so it cannot use much more than that anyway (fewer threads
alone would not slow down a single-threaded loop; a quota alone would let a many-threaded peer burst).
Throttle every peer of a swarm, full-speed ones too (k = 1), with ``base_cpus`` from `base_cpus_to_fit`:
then all peers have the same weight and their quotas fit the host together, so the speed ratios
between peers hold however many there are. Groups are created under the calling process's own cgroup,
named ``ravnest-<name>``, and are removed by `ComputeThrottle.close` (which first moves any survivor
back to the parent) or, after a crash, by `remove_groups`.

Usage with the lab::

    with ComputeThrottle(name="rvt1a2b-3", slowdown=4.0) as throttle:
        proc = lab.run_in_ns(3, argv, env=thread_env(1), throttle=throttle)

or without the lab::

    proc = subprocess.Popen(throttle.wrap_argv(argv), start_new_session=True)
    throttle.attach(proc.pid)   # starts the sigstop driver; harmless for cgroups (already inside)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from types import TracebackType

from ravnest_p2p.lab._procs import signal_group

__all__ = [
    "DEFAULT_PERIOD_US",
    "ComputeThrottle",
    "ThrottleBackend",
    "base_cpus_to_fit",
    "detect_backend",
    "remove_groups",
    "thread_env",
]

logger = logging.getLogger(__name__)

DEFAULT_PERIOD_US = 100_000  # the CFS bandwidth period of a throttle's cgroup
_PERIOD_US = DEFAULT_PERIOD_US
_REMOVE_TIMEOUT_S = 10.0  # waiting for killed processes to leave their groups
# 8x the default weight: see "under load" in the module docstring. Harmless to others: the quota caps
# what the weight can win.
_SHARES_V1 = 8 * 1024
_WEIGHT_V2 = 8 * 100
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")


class ThrottleBackend(StrEnum):
    """How a `ComputeThrottle` caps CPU."""

    CGROUP2 = "cgroup2"
    CGROUP1 = "cgroup1"
    SIGSTOP = "sigstop"


def thread_env(num_threads: int) -> dict[str, str]:
    """Environment that pins the usual compute thread pools (OpenMP/MKL/BLAS, hence torch) to a count."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    n = str(num_threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def base_cpus_to_fit(slowdowns: Sequence[float], *, num_cpus: float) -> float:
    """The largest full-speed CPU share per peer such that every peer's quota fits the host at once.

    Peer i gets ``base / k_i`` CPUs; the ratios between peers hold only while the sum fits in
    ``num_cpus`` (beyond that, CFS splits the host evenly and a k = 4 peer runs as fast as a k = 1 one).
    E.g. hetero8 on 2 CPUs: sum(1/k) = 2 + 3/1.5 + 3/3 = 5, so base = 0.4 CPU.

    Raises:
        ValueError: no peers, a slowdown below 1, or a non-positive CPU count.
    """
    if not slowdowns or min(slowdowns) < 1.0 or num_cpus <= 0:
        raise ValueError(f"need slowdowns >= 1 and num_cpus > 0, got {list(slowdowns)}, {num_cpus}")
    return num_cpus / sum(1.0 / k for k in slowdowns)


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            out.append((fields[1], fields[2], set(fields[3].split(","))))
    return out


def _own_cgroup(controller: str | None) -> str:
    """This process's cgroup path for a v1 controller, or the v2 path when ``controller`` is None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            return path
    raise LookupError(f"no cgroup for controller {controller!r}")


def _v2_parent() -> Path | None:
    for mount, fstype, _ in _mounts():
        if fstype != "cgroup2":
            continue
        parent = Path(mount) / _own_cgroup(None).lstrip("/")
        try:
            if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+cpu")
            return parent if os.access(parent, os.W_OK) else None
        except OSError:
            return None
    return None


def _v1_parent(controller: str) -> Path | None:
    for mount, fstype, options in _mounts():
        if fstype == "cgroup" and controller in options:
            parent = Path(mount) / _own_cgroup(controller).lstrip("/")
            return parent if os.access(parent, os.W_OK) else None
    return None


def _all_parents() -> list[Path]:
    """Every cgroup directory under which `ComputeThrottle` may have created groups (no side effects)."""
    parents = []
    for mount, fstype, options in _mounts():
        try:
            if fstype == "cgroup2":
                parents.append(Path(mount) / _own_cgroup(None).lstrip("/"))
            elif options & {"cpu", "memory"}:
                parents.append(Path(mount) / _own_cgroup("cpu" if "cpu" in options else "memory").lstrip("/"))
        except LookupError:
            continue
    return parents


def _remove_group(group: Path) -> None:
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            (group.parent / "cgroup.procs").write_text(pid)
        except OSError:
            pass  # exited meanwhile
    group.rmdir()


def remove_groups(name_prefix: str) -> None:
    """Remove the cgroups of every throttle whose name starts with ``name_prefix`` (crash cleanup).

    Processes still inside are moved to the parent group first, so this never fails on a busy group.
    """
    if not name_prefix or "/" in name_prefix or "*" in name_prefix:
        raise ValueError(f"bad throttle name prefix {name_prefix!r}")
    # A process killed a moment ago can still be listed while it exits, cannot be moved, and keeps its
    # group busy (rmdir: EBUSY): retry until it is gone (a CI run left two groups behind without this).
    deadline = time.monotonic() + _REMOVE_TIMEOUT_S
    while True:
        left = []
        for parent in _all_parents():
            for group in parent.glob(f"ravnest-{name_prefix}*"):
                if group.is_dir():
                    try:
                        _remove_group(group)
                    except OSError:
                        left.append(group)
        if not left or time.monotonic() > deadline:
            if left:
                logger.warning("cgroups still busy, not removed: %s", ", ".join(map(str, left)))
            return
        time.sleep(0.05)  # polling the kernel's view of exiting processes, bounded by the deadline


def detect_backend() -> ThrottleBackend:
    """The best CPU-throttling mechanism usable by this process (see the module docstring)."""
    if _v2_parent() is not None:
        return ThrottleBackend.CGROUP2
    if _v1_parent("cpu") is not None:
        return ThrottleBackend.CGROUP1
    return ThrottleBackend.SIGSTOP


class ComputeThrottle:
    """Caps the CPU of the processes put into it to ``base_cpus / slowdown`` CPUs.

    Args:
        name: unique label; the cgroup is ``ravnest-<name>``.
        slowdown: 1.0 = no CPU cap, k > 1 = 1/k of full speed.
        base_cpus: CPUs the peer uses at full speed (its compute thread count).
        memory_gb: memory cap (cgroup backends only; the sigstop backend ignores it with no error).
        backend: force a mechanism; default `detect_backend`.
        period_us: the CFS bandwidth period (cgroup backends; default 100 ms). A group that spends its
            quota early in a period waits for the next one: a shorter period bounds that stall (a slow
            peer's short message handling right after a compute burst waits up to period - quota).
    """

    def __init__(
        self,
        *,
        name: str,
        slowdown: float,
        base_cpus: float = 1.0,
        memory_gb: float | None = None,
        backend: ThrottleBackend | None = None,
        period_us: int = DEFAULT_PERIOD_US,
    ) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"throttle name {name!r} must match {_NAME_RE.pattern}")
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1.0, got {slowdown}")
        if not base_cpus > 0:
            raise ValueError(f"base_cpus must be > 0, got {base_cpus}")
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"period_us must lie in [1000, 1000000], got {period_us}")
        self.name = name
        self.period_us = period_us
        self.slowdown = slowdown
        self.base_cpus = base_cpus
        self.memory_gb = memory_gb
        self.backend = backend or detect_backend()
        self._groups: list[Path] = []  # cgroup dirs we created
        self._drivers: list[subprocess.Popen[bytes]] = []

    @property
    def quota_us(self) -> int:
        """CPU time the group may use per period (`period_us`), in µs."""
        return max(1000, round(self.period_us * self.base_cpus / self.slowdown))

    def create(self) -> None:
        """Create and configure the cgroup(s); a no-op for the sigstop backend."""
        group = f"ravnest-{self.name}"
        mem_bytes = None if self.memory_gb is None else str(int(self.memory_gb * 1e9))
        if self.backend is ThrottleBackend.CGROUP2:
            parent = _v2_parent()
            if parent is None:
                raise RuntimeError("cgroup v2 cpu controller is not writable here")
            path = self._mkdir(parent / group)
            (path / "cpu.max").write_text(f"{self.quota_us} {self.period_us}")
            (path / "cpu.weight").write_text(str(_WEIGHT_V2))
            if mem_bytes is not None:
                (path / "memory.max").write_text(mem_bytes)
        elif self.backend is ThrottleBackend.CGROUP1:
            cpu_parent = _v1_parent("cpu")
            if cpu_parent is None:
                raise RuntimeError("cgroup v1 cpu hierarchy is not writable here")
            path = self._mkdir(cpu_parent / group)
            (path / "cpu.cfs_period_us").write_text(str(self.period_us))
            (path / "cpu.cfs_quota_us").write_text(str(self.quota_us))
            (path / "cpu.shares").write_text(str(_SHARES_V1))
            mem_parent = _v1_parent("memory")
            if mem_bytes is not None and mem_parent is not None:
                (self._mkdir(mem_parent / group) / "memory.limit_in_bytes").write_text(mem_bytes)

    def _mkdir(self, path: Path) -> Path:
        path.mkdir(exist_ok=True)
        self._groups.append(path)
        return path

    def wrap_argv(self, argv: list[str]) -> list[str]:
        """Return a command that joins the throttle and then execs ``argv``.

        cgroups: the command joins the group(s) before exec, so the peer never runs a moment
        unthrottled and its memory is charged to the group from the start. sigstop: the command stops
        itself before exec; the driver started by `attach` continues it, so the peer does not run
        free while the driver starts. Either way the pid is that of ``argv`` once it runs.
        """
        if self.backend is ThrottleBackend.SIGSTOP:
            if self.slowdown <= 1.0:
                return list(argv)
            return ["/bin/sh", "-c", 'kill -STOP $$ && exec "$@"', "ravnest-throttle", *argv]
        if not self._groups:
            return list(argv)
        joins = " && ".join(f'echo $$ > "${i + 1}"' for i in range(len(self._groups)))
        script = f'{joins} && shift {len(self._groups)} && exec "$@"'
        procs = [str(g / "cgroup.procs") for g in self._groups]
        return ["/bin/sh", "-c", script, "ravnest-throttle", *procs, *argv]

    def attach(self, pid: int) -> None:
        """Throttle a running process: join the cgroup(s), or start a duty-cycle driver for sigstop.

        For sigstop this must be called for every process started with `wrap_argv` (it waits, stopped,
        for the driver).
        """
        for group in self._groups:
            (group / "cgroup.procs").write_text(str(pid))
        if self.backend is ThrottleBackend.SIGSTOP and self.slowdown > 1.0:
            cmd = [sys.executable, "-m", "ravnest_p2p.lab.throttle", "dutycycle", "--pid", str(pid)]
            cmd += ["--slowdown", str(self.slowdown)]
            self._drivers.append(subprocess.Popen(cmd, start_new_session=True))

    def close(self) -> None:
        """Stop drivers and remove the cgroup(s), moving any process still inside to the parent."""
        for driver in self._drivers:
            driver.terminate()  # the driver continues its target before exiting
            try:
                driver.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(timeout=5.0)
        self._drivers.clear()
        for group in reversed(self._groups):
            if group.exists():
                _remove_group(group)
        self._groups.clear()

    def __enter__(self) -> ComputeThrottle:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def duty_cycle(pid: int, slowdown: float, period_s: float = 0.1) -> None:
    """Stop/continue ``pid``'s process group so it runs ``1/slowdown`` of the time, until it exits.

    SIGTERM ends the loop; the target is always left running (SIGCONT) on the way out.
    """
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    run_s = period_s / slowdown
    # Absolute schedule: late wake-ups shift one edge, they do not accumulate into drift.
    start = time.monotonic()
    cycle = 0
    try:
        while not stop and signal_group(pid, signal.SIGCONT):
            time.sleep(max(0.0, start + cycle * period_s + run_s - time.monotonic()))
            if stop or not signal_group(pid, signal.SIGSTOP):
                break
            cycle += 1
            time.sleep(max(0.0, start + cycle * period_s - time.monotonic()))
    finally:
        signal_group(pid, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``dutycycle --pid P --slowdown K`` (the sigstop driver) or ``detect``."""
    parser = argparse.ArgumentParser(prog="python -m ravnest_p2p.lab.throttle")
    sub = parser.add_subparsers(dest="mode", required=True)
    dc = sub.add_parser("dutycycle", help="SIGSTOP/SIGCONT a process group on a duty cycle")
    dc.add_argument("--pid", type=int, required=True)
    dc.add_argument("--slowdown", type=float, required=True)
    dc.add_argument("--period-s", type=float, default=0.1)
    sub.add_parser("detect", help="print the throttling backend usable here")
    args = parser.parse_args(argv)
    if args.mode == "detect":
        print(detect_backend().value)
    else:
        duty_cycle(args.pid, args.slowdown, args.period_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
