"""Launch a local swarm of real peer processes (loopback), for the demo, notebooks, tests and benchmarks.

Each peer is a `python -m ravnest_p2p.peer` subprocess in its own process group, so that stopping it
also stops its p2p daemon even if the peer itself was killed hard (the daemon does not notice its parent
dying). The bootstrap can be one of our peers or a stock `hivemind-dht`.

Network-namespace swarms with shaped links build on `ravnest_p2p.lab` (see the lab issue); this module
is the loopback form.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["LocalSwarm", "PeerProcess", "poll_until"]

_JOIN_RE = re.compile(r"--initial[-_]peers (/\S+/p2p/\S+)")
_PEER_ID_RE = re.compile(r"ravnest_p2p peer (\S+) ")


def poll_until(
    predicate: Callable[[], bool], timeout_s: float, *, what: str, interval_s: float = 0.1
) -> None:
    """Poll `predicate` until true; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
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
        bootstrap: str = "peer",
        peer_args: Sequence[str] = (),
        per_peer_args: Sequence[Sequence[str]] | None = None,
        workdir: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if bootstrap not in ("peer", "hivemind-dht"):
            raise ValueError("bootstrap must be 'peer' or 'hivemind-dht'")
        if per_peer_args is not None and len(per_peer_args) != num_peers:
            raise ValueError("per_peer_args needs one entry per peer")
        self.num_peers = num_peers
        self.run_id = run_id
        self.bootstrap_kind = bootstrap
        self.peer_args = list(peer_args)
        self.per_peer_args = (
            [list(a) for a in per_peer_args] if per_peer_args else [[] for _ in range(num_peers)]
        )
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ravnest-swarm-"))
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.bootstrap: PeerProcess | None = None
        self.peers: list[PeerProcess] = []

    @property
    def initial_peers(self) -> list[str]:
        assert self.bootstrap is not None, "swarm not started"
        return self.bootstrap.maddrs

    def _spawn(self, name: str, argv: list[str]) -> PeerProcess:
        log_path = self.workdir / f"{name}.log"
        log = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.workdir,
                start_new_session=True,
            )
        finally:
            log.close()
        return PeerProcess(name=name, popen=popen, log_path=log_path)

    def _peer_argv(self, extra: Sequence[str]) -> list[str]:
        argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", self.run_id, *self.peer_args, *extra]
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
                self.peers.append(self._spawn(f"peer{i}", self._peer_argv(self.per_peer_args[i])))
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
