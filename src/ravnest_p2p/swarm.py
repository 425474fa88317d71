"""Launch a local swarm of real peer processes, for the demo, notebooks, tests and benchmarks.

Each peer is a `python -m ravnest_p2p.peer` subprocess in its own process group, so that stopping it
also stops its p2p daemon even if the peer itself was killed hard (the daemon does not notice its parent
dying). The bootstrap can be one of our peers or a stock `hivemind-dht`.

Two forms: `LocalSwarm` (N identical peers on loopback, owned by the calling process) and `Swarm`
(`ravnest_p2p.lab.launcher`: a `peers/*.toml` profile, CPU-throttled, optionally one network namespace
per peer with shaped links). The CLI drives the second and leaves it running between commands::

    python -m ravnest_p2p.swarm up --profile peers/hetero8.toml [--netns] [--prefix P] [--config FILE]
    python -m ravnest_p2p.swarm status [--prefix P] [--json]
    python -m ravnest_p2p.swarm down [--prefix P]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ravnest_p2p.lab.launcher import Swarm, SwarmState, load_state, stop_swarm
from ravnest_p2p.utils import StretchedDeadline

__all__ = ["LocalSwarm", "PeerProcess", "Swarm", "main", "poll_until", "swarm_status"]

_JOIN_RE = re.compile(r"--initial[-_]peers (/\S+/p2p/\S+)")
_PEER_ID_RE = re.compile(r"ravnest_p2p peer (\S+) ")


def poll_until(
    predicate: Callable[[], bool], timeout_s: float, *, what: str, interval_s: float = 0.1
) -> None:
    """Poll `predicate` until true; TimeoutError naming `what` after `timeout_s`, stretched by the host's
    load (`utils.StretchedDeadline`: peers start slowly on a busy host)."""
    deadline = StretchedDeadline(timeout_s)
    while not predicate():
        if deadline.expired():
            raise TimeoutError(f"timed out after {deadline.describe()} waiting for {what}")
        time.sleep(interval_s)


@dataclass
class PeerProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    maddrs: list[str] = field(default_factory=list)
    peer_id: str | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _scan(self) -> bool:
        text = self.log()
        self.maddrs = _JOIN_RE.findall(text)
        match = _PEER_ID_RE.search(text)
        if match:
            self.peer_id = match.group(1)
        return bool(self.maddrs)

    def wait_ready(self, timeout_s: float) -> None:
        def ready() -> bool:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log()[-2000:]}")
            return self._scan()

        poll_until(ready, timeout_s, what=f"{self.name} to print its multiaddrs")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait; then SIGKILL the whole process group (peer + its daemon). Returns the exit code."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        code = self.popen.wait(10)
        return code


class LocalSwarm:
    """A bootstrap plus `num_peers` peers on 127.0.0.1; a context manager that always cleans up."""

    def __init__(
        self,
        num_peers: int,
        *,
        run_id: str = "default",
        run_owner: str | None = None,
        bootstrap: str = "peer",
        peer_args: Sequence[str] = (),
        per_peer_args: Sequence[Sequence[str]] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        per_peer_env: Sequence[dict[str, str]] | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if bootstrap not in ("peer", "hivemind-dht"):
            raise ValueError("bootstrap must be 'peer' or 'hivemind-dht'")
        if per_peer_args is not None and len(per_peer_args) != num_peers:
            raise ValueError("per_peer_args needs one entry per peer")
        if per_peer_env is not None and len(per_peer_env) != num_peers:
            raise ValueError("per_peer_env needs one entry per peer")
        self.num_peers = num_peers
        self.run_id = run_id
        self.run_owner = run_owner
        self.bootstrap_kind = bootstrap
        self.peer_args = list(peer_args)
        self.per_peer_args = (
            [list(a) for a in per_peer_args] if per_peer_args else [[] for _ in range(num_peers)]
        )
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ravnest-swarm-"))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # e.g. a PYTHONPATH with a plugin package for some peers only
        self.per_peer_env = (
            [dict(e) for e in per_peer_env] if per_peer_env else [{} for _ in range(num_peers)]
        )
        self.startup_timeout_s = startup_timeout_s
        self.bootstrap: PeerProcess | None = None
        self.peers: list[PeerProcess] = []

    @property
    def initial_peers(self) -> list[str]:
        assert self.bootstrap is not None, "swarm not started"
        return self.bootstrap.maddrs

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> PeerProcess:
        log_path = self.workdir / f"{name}.log"
        log = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, **(env or {})},
                cwd=self.workdir,
                start_new_session=True,
            )
        finally:
            log.close()
        return PeerProcess(name=name, popen=popen, log_path=log_path)

    def _peer_argv(self, extra: Sequence[str]) -> list[str]:
        argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", self.run_id, *self.peer_args, *extra]
        if self.run_owner is not None:
            argv += ["--run-owner", self.run_owner]
        if self.bootstrap is not None:
            argv += ["--initial-peers", *self.initial_peers]
        return argv

    def start(self) -> LocalSwarm:
        try:
            if self.bootstrap_kind == "hivemind-dht":
                exe = shutil.which("hivemind-dht", path=os.path.dirname(sys.executable)) or "hivemind-dht"
                self.bootstrap = self._spawn("bootstrap", [exe, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"])
            else:
                self.bootstrap = self._spawn("bootstrap", self._peer_argv([]))
            self.bootstrap.wait_ready(self.startup_timeout_s)
            for i in range(self.num_peers):
                argv = self._peer_argv(self.per_peer_args[i])
                self.peers.append(self._spawn(f"peer{i}", argv, self.per_peer_env[i]))
            for peer in self.peers:
                peer.wait_ready(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def all_processes(self) -> list[PeerProcess]:
        return ([self.bootstrap] if self.bootstrap else []) + self.peers

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        """Stop peers first, bootstrap last; return each process's exit code."""
        codes = {p.name: p.terminate(timeout_s) for p in reversed(self.all_processes())}
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return codes

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _status_json(state: SwarmState, timeout_s: float) -> dict[str, Any]:
    """Run the status tool next to the bootstrap (inside its namespace in netns mode)."""
    argv = [sys.executable, "-m", "ravnest_p2p.status", "--initial-peers", *state.bootstrap.maddrs]
    argv += ["--run-id", state.run_id, "--json"]
    if state.run_owner is not None:
        argv += ["--run-owner", state.run_owner]
    if state.bootstrap.namespace is not None:
        argv = ["ip", "netns", "exec", state.bootstrap.namespace, *argv]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the tool and its p2p daemon
        proc.communicate()
        raise TimeoutError(f"status tool took over {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"status tool failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}")
    result: dict[str, Any] = json.loads(out)
    return result


def swarm_status(state: SwarmState, *, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """One row per profile peer, in profile order: name, peer id, configured and measured figures.

    A peer without a live record in the DHT has ``found = False`` and no measured figures.
    """
    records = {r["peer_id"]: r for r in _status_json(state, timeout_s)["peers"]}
    rows = []
    for member in state.peers:
        spec = member.profile
        record = records.get(member.peer_id or "")
        row: dict[str, Any] = {
            "name": member.name,
            "peer_id": member.peer_id,
            "found": record is not None,
            "configured_upload_mbps": spec.upload_mbps if spec else None,
            "configured_download_mbps": spec.download_mbps if spec else None,
            "compute_slowdown": spec.compute_slowdown if spec else 1.0,
        }
        for key in ("upload_mbps", "download_mbps", "flops", "rtt_ms", "state", "free_memory_bytes"):
            row[key] = record.get(key) if record else None
        rows.append(row)
    return rows


def _format_rows(rows: Sequence[dict[str, Any]]) -> str:
    def num(value: Any, scale: float = 1.0) -> str:
        return "-" if value is None else f"{value / scale:.1f}"

    lines = [
        f"{'name':<14} {'peer':<14} {'state':<9} {'up cfg':>7} {'up':>7} {'down cfg':>8} {'down':>7} "
        f"{'slow':>5} {'GFLOP/s':>8} {'rtt ms':>7}"
    ]
    for r in rows:
        peer = f"…{r['peer_id'][-12:]}" if r["peer_id"] else "-"
        lines.append(
            f"{r['name']:<14} {peer:<14} {r['state'] or 'missing':<9} {num(r['configured_upload_mbps']):>7} "
            f"{num(r['upload_mbps']):>7} {num(r['configured_download_mbps']):>8} "
            f"{num(r['download_mbps']):>7} "
            f"{r['compute_slowdown']:>5.1f} {num(r['flops'], 1e9):>8} {num(r['rtt_ms']):>7}"
        )
    lines.append(f"{sum(r['found'] for r in rows)} of {len(rows)} peers live (Mbit/s; cfg = profile)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``up``, ``status``, ``down`` of a profile-driven swarm (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m ravnest_p2p.swarm", description="Run an emulated swarm.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the swarm and leave it running")
    up.add_argument("--profile", required=True, help="a peers/*.toml swarm profile")
    up.add_argument("--netns", action="store_true", help="one network namespace per peer, shaped (root)")
    up.add_argument("--config", help="TOML of PeerConfig fields passed to every peer (e.g. [probe])")
    up.add_argument("--run-id", help="run id of the peers (default: the profile's)")
    up.add_argument("--run-owner", metavar="PEER_ID", help="the run owner's peer id (default: an open run)")
    up.add_argument("--bootstrap", choices=["hivemind-dht", "peer"], default="hivemind-dht")
    up.add_argument("--port", type=int, default=31337, help="every peer's port in netns mode")
    up.add_argument("--timeout-s", type=float, default=120.0, help="startup deadline per process")
    st = sub.add_parser("status", help="print the swarm's peers with their measured figures")
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout-s", type=float, default=60.0)
    sub.add_parser("down", help="stop everything the swarm started, by state file and by prefix")
    for command in (up, st, sub.choices["down"]):
        command.add_argument("--prefix", default="rvswarm", help="names of namespaces/cgroups (<= 8 chars)")
    args = parser.parse_args(argv)

    if args.command == "up":
        swarm = Swarm.from_profile(
            args.profile,
            netns=args.netns,
            prefix=args.prefix,
            run_id=args.run_id,
            run_owner=args.run_owner,
            peer_config=args.config,
            port=args.port,
            bootstrap=args.bootstrap,
            startup_timeout_s=args.timeout_s,
        )
        try:
            swarm.start()
        except (RuntimeError, TimeoutError, ValueError) as exc:
            print(f"swarm up failed: {exc}", file=sys.stderr)
            return 1
        print(
            f"swarm {args.prefix} up: {len(swarm.peers)} peers, run {swarm.run_id!r}, logs in {swarm.workdir}"
        )
        print(f"  bootstrap: --initial-peers {' '.join(swarm.initial_peers)}")
        return 0
    if args.command == "down":
        stop_swarm(args.prefix)
        print(f"swarm {args.prefix} down")
        return 0
    state = load_state(args.prefix)
    if state is None:
        print(f"no swarm with prefix {args.prefix!r} is up", file=sys.stderr)
        return 1
    try:
        rows = swarm_status(state, timeout_s=args.timeout_s)
    except (RuntimeError, TimeoutError) as exc:
        print(f"swarm status failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(
            json.dumps({"prefix": state.prefix, "run_id": state.run_id, "netns": state.netns, "peers": rows})
        )
    else:
        print(_format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
