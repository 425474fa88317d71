"""Run N processes in a namespaced lab with given link rates: for benchmarks that need real shaped links.

Usage::

    with LabRun([100, 100, 25, 200]) as lab:        # Mbit/s, both directions; None = unshaped
        argv = [sys.executable, "-m", "benchmarks.probe_peer", "serve", "--host", lab.addresses[0]]
        proc = lab.start(0, argv)
        line = lab.wait_json(0, "peer_id", timeout_s=60)   # first JSON line of its stdout with that key

Each process runs in namespace ``<prefix>-<i>`` at ``lab.addresses[i]`` (198.18.0.0/15), stdout and
stderr go to ``<workdir>/<i>.log``; leaving the block kills every process and removes the lab, including
after an exception. Needs root. Shared with the averaging benchmarks (our ring vs hivemind's averager).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.throttle import ComputeThrottle, thread_env
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.transport import Identity

__all__ = ["LabRun", "run_driver", "start_lab_peers"]

REPO = Path(__file__).resolve().parents[1]


class LabRun:
    """A lab of ``len(rates_mbps)`` namespaces with symmetric shaped links, and the processes in it."""

    def __init__(
        self, rates_mbps: Sequence[float | None], *, prefix: str | None = None, run_owner: str | None = None
    ) -> None:
        peers: list[dict[str, Any]] = []
        for i, rate in enumerate(rates_mbps):
            peer: dict[str, Any] = {"name": f"n{i}"}
            if rate is not None:
                peer.update(upload_mbps=rate, download_mbps=rate)
            peers.append(peer)
        self.rates_mbps = list(rates_mbps)
        self.run_owner = run_owner  # the owner's peer id for the peers a benchmark starts (`owner_args`)
        self.lab = NetnsLab(
            parse_profile({"run_id": "labrun", "peers": peers}), prefix=prefix or f"rvb{secrets.token_hex(2)}"
        )
        self.addresses = [self.lab.address_of(i) for i in range(len(peers))]
        self.workdir = Path(tempfile.mkdtemp(prefix="ravnest-labrun-"))
        self.procs: dict[int, list[subprocess.Popen[bytes]]] = {}

    def owner_args(self) -> list[str]:
        """``--run-owner <id>`` for a peer's argv, or nothing for an open run."""
        return ["--run-owner", self.run_owner] if self.run_owner is not None else []

    def log_path(self, index: int) -> Path:
        return self.workdir / f"{index}.log"

    def start(
        self, index: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in namespace ``index``; output appended to `log_path`."""
        proc = self.lab.run_in_ns(
            index,
            list(argv),
            env={"PYTHONUNBUFFERED": "1", **(env or {})},
            log_path=self.log_path(index),
            stdin=subprocess.DEVNULL,
        )
        self.procs.setdefault(index, []).append(proc)
        return proc

    def json_lines(self, index: int) -> list[dict[str, Any]]:
        """Every JSON object printed so far by the processes of namespace ``index``."""
        out = []
        try:
            text = self.log_path(index).read_text(errors="replace")
        except OSError:
            return []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def wait_json(self, index: int, key: str, *, timeout_s: float, count: int = 1) -> list[dict[str, Any]]:
        """Wait until namespace ``index`` printed ``count`` JSON lines holding ``key``; return them."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.json_lines(index) if key in line]
            if len(found) >= count:
                return found
            for proc in self.procs.get(index, []):
                if proc.poll() is not None and proc.returncode != 0:
                    raise RuntimeError(f"process in ns {index} exited {proc.returncode}: {self.tail(index)}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ns {index}: no {count} lines with {key!r} in {timeout_s}s: {self.tail(index)}"
                )
            time.sleep(0.2)  # polling a log file, bounded by the deadline

    def tail(self, index: int, num_chars: int = 1500) -> str:
        try:
            return self.log_path(index).read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def __enter__(self) -> LabRun:
        self.lab.up()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.lab.down()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_dir(prefix: str, keep: str | None) -> contextlib.AbstractContextManager[str]:
    """A lab run's work directory: kept under `keep` (its logs stay for a reader), else a temporary one."""
    if keep is not None:
        return contextlib.nullcontext(tempfile.mkdtemp(prefix=prefix, dir=keep))
    return tempfile.TemporaryDirectory(prefix=prefix)


def start_lab_peers(
    lab: NetnsLab,
    identities: Sequence[Identity],
    *,
    run_id: str,
    port: int,
    base_cpus: float,
    workdir: Path,
    config_path: Path | None = None,
    throttles: list[ComputeThrottle],
    ready_timeout_s: float = 120,
    cpu_period_us: int | None = None,
) -> list[str]:
    """Start ``python -m ravnest_p2p.peer`` i in lab namespace i (CPU-capped, one compute thread).

    Peer 0 bootstraps the run (we wait until its log says it joined), the others join through it.
    Every throttle created is appended to `throttles` at once, so the caller closes them even when a
    later start fails. Logs go to ``workdir/peer<i>.log``; ``cpu_period_us`` is the cgroups' CFS period
    (None: 100 ms). Returns the peers' multiaddrs.
    """
    maddrs = [
        f"/ip4/{lab.address_of(i)}/tcp/{port}/p2p/{identity.peer_id}" for i, identity in enumerate(identities)
    ]
    for i, identity in enumerate(identities):
        throttle = lab.throttle_for(i, base_cpus=base_cpus, period_us=cpu_period_us)
        throttle.create()
        throttles.append(throttle)
        addr = f"/ip4/{lab.address_of(i)}/tcp/{port}"
        argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", run_id]
        argv += ["--config", str(config_path)] if config_path is not None else []
        argv += ["--identity-path", str(identity.path), "--host-maddrs", addr, "--announce-maddrs", addr]
        argv += ["--initial-peers", maddrs[0]] if i > 0 else []
        log = workdir / f"peer{i}.log"
        lab.run_in_ns(i, argv, env=thread_env(1), log_path=log, throttle=throttle)
        if i == 0:
            joined = lambda path=log: "join with" in path.read_text(errors="replace")  # noqa: E731
            poll_until(joined, ready_timeout_s, what="peer 0")
    return maddrs


def run_driver(
    lab: NetnsLab, index: int, argv: Sequence[str], *, workdir: Path, timeout_s: float = 3600
) -> list[float]:
    """Run a benchmark's driver in lab namespace `index` to its end; the host's load sampled meanwhile.

    The driver runs from the repository root with one compute thread, its output in
    ``workdir/driver.log``. The 1-minute load average is sampled every 10 s until the driver exits (at
    most `timeout_s`); the samples are returned.

    Raises:
        RuntimeError: the driver failed or is still running at `timeout_s` (with the log's tail).
    """
    log = workdir / "driver.log"
    driver = lab.run_in_ns(index, list(argv), env=thread_env(1), log_path=log, cwd=REPO)
    loadavg: list[float] = []
    deadline = time.monotonic() + timeout_s
    while driver.poll() is None and time.monotonic() < deadline:
        loadavg.append(os.getloadavg()[0])
        with contextlib.suppress(TimeoutError):  # a load sample every 10 s until the driver ends
            poll_until(lambda: driver.poll() is not None, 10, what="the driver", interval_s=1)
    if driver.returncode != 0:
        raise RuntimeError(log.read_text(errors="replace")[-3000:])
    return loadavg
