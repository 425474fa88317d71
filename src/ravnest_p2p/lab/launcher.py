"""Launch a profile-driven swarm of real peer processes: on loopback, or one network namespace per peer.

Why: the algorithms (clustering, placement, averaging) must be watched on a swarm whose peers really
differ. A `SwarmProfile` says how (links, CPU, memory); this module turns it into running
``python -m ravnest_p2p.peer`` processes plus one bootstrap, and records everything it started in a
state file so that a later, separate command can inspect or stop the swarm — even after a crash.

Two forms:

- ``netns=True`` (root): `NetnsLab` builds one namespace per profile peer and one more, unshaped, for
  the bootstrap. Each peer listens and announces ``/ip4/<its lab address>/tcp/<port>`` (the same port
  everywhere: every namespace has its own stack), runs under its cgroup throttle, and is told its
  memory cap (``--max-memory-gb``).
- ``netns=False``: every process on 127.0.0.1 with port 0, the same CPU throttles, no link shaping.

CPU: every peer, full-speed ones included, gets ``base_cpus / compute_slowdown`` CPUs with ``base_cpus``
from `base_cpus_to_fit` over the host's CPUs, so the speed ratios of the profile hold together (see
`ravnest_p2p.lab.throttle`). The bootstrap runs in a throttle group too, unrestricted (slowdown 1 and the
whole host), only so that crash cleanup finds it by name. Each peer gets one compute thread.

Every cgroup is named ``ravnest-<prefix>-*`` and every namespace ``<prefix>-*``: `stop_swarm` kills what
the state file lists, then every process still inside those groups or namespaces, then removes them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from pydantic import BaseModel, ConfigDict

from ravnest_p2p.lab._procs import kill_groups
from ravnest_p2p.lab.netns import NetnsLab, remove_leftovers
from ravnest_p2p.lab.profiles import PeerProfile, SwarmProfile, load_profile
from ravnest_p2p.lab.throttle import (
    ComputeThrottle,
    ThrottleBackend,
    base_cpus_to_fit,
    remove_groups,
    thread_env,
)

__all__ = ["DEFAULT_PORT", "Swarm", "SwarmMember", "SwarmState", "load_state", "state_dir", "stop_swarm"]

logger = logging.getLogger(__name__)

DEFAULT_PORT = 31337
_JOIN_RE = re.compile(r"--initial[-_]peers (/\S+/p2p/\S+)")
_PEER_ID_RE = re.compile(r"ravnest_p2p peer (\S+) ")
_BOOTSTRAP = "bootstrap"


class SwarmMember(BaseModel):
    """One process of a launched swarm, as recorded in the state file."""

    model_config = ConfigDict(extra="ignore")

    name: str
    pid: int
    log_path: str
    namespace: str | None = None
    peer_id: str | None = None
    maddrs: list[str] = []
    profile: PeerProfile | None = None  # None for the bootstrap


class SwarmState(BaseModel):
    """What `stop_swarm` and the status command need to find a running swarm again."""

    model_config = ConfigDict(extra="ignore")

    prefix: str
    run_id: str
    run_owner: str | None = None
    profile_path: str | None
    netns: bool
    workdir: str
    bootstrap: SwarmMember
    peers: list[SwarmMember]


def state_dir(prefix: str) -> Path:
    """Directory of a swarm's state file and logs: ``/tmp/ravnest-swarm-<prefix>``."""
    return Path("/tmp") / f"ravnest-swarm-{prefix}"


def load_state(prefix: str) -> SwarmState | None:
    """The state of the swarm with this prefix, or None when no (readable) state file exists."""
    path = state_dir(prefix) / "state.json"
    try:
        return SwarmState.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def _pids_in_groups(prefix: str) -> list[int]:
    """Pids whose cgroup (any hierarchy) is one of this swarm's throttle groups."""
    marker = f"/ravnest-{prefix}-"
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                text = Path(f"/proc/{entry.name}/cgroup").read_text()
            except OSError:
                continue
            if marker in text:
                pids.append(int(entry.name))
    return pids


def stop_swarm(prefix: str) -> None:
    """Stop the swarm with this prefix: its recorded processes, then anything left by prefix; idempotent.

    Works without a state file (after a crash of ``up``): namespaces, throttle groups and the processes
    inside them are all found by prefix.
    """
    state = load_state(prefix)
    pids = [] if state is None else [m.pid for m in [state.bootstrap, *state.peers]]
    kill_groups(pids, prefix)
    kill_groups(_pids_in_groups(prefix), prefix)
    remove_leftovers(prefix)  # namespaces (and what runs inside), veths, the bridge, `<prefix>-*` groups
    remove_groups(f"{prefix}-")
    shutil.rmtree(state_dir(prefix), ignore_errors=True)


def _scan_log(path: Path) -> tuple[str | None, list[str]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None, []
    match = _PEER_ID_RE.search(text)
    return (match.group(1) if match else None), _JOIN_RE.findall(text)


class Swarm:
    """A bootstrap plus a profile's peers as real processes; a context manager that always cleans up.

    Build with `Swarm.from_profile`. `start` returns once every process printed its multiaddrs and
    writes the state file; `stop` (or `stop_swarm(prefix)` from another process) removes everything.

    Args:
        profile: the swarm to emulate; peer ``i`` is profile peer ``i``.
        netns: one namespace per peer with shaped links (root only), else loopback.
        prefix: names of namespaces, cgroups and the state directory (1-8 lowercase letters/digits).
        profile_path: recorded in the state file, for humans.
        run_id: the peers' run (default: the profile's ``run_id``).
        run_owner: the run owner's peer id passed to every peer (``--run-owner``); None: an open run.
        peer_config: a ``--config`` TOML passed to every peer (e.g. faster probes).
        port: the fixed port of every peer in netns mode.
        bootstrap: ``hivemind-dht`` (a stock DHT node, lightest) or ``peer`` (one of ours, another run).
        num_cpus: CPUs the throttles share (default: this host's).
        startup_timeout_s: how long each process may take to print its multiaddrs.
    """

    def __init__(
        self,
        profile: SwarmProfile,
        *,
        netns: bool,
        prefix: str,
        profile_path: str | None = None,
        run_id: str | None = None,
        run_owner: str | None = None,
        peer_config: str | Path | None = None,
        port: int = DEFAULT_PORT,
        bootstrap: str = "hivemind-dht",
        num_cpus: float | None = None,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if bootstrap not in ("peer", "hivemind-dht"):
            raise ValueError("bootstrap must be 'peer' or 'hivemind-dht'")
        self.profile = profile
        self.netns = netns
        self.prefix = prefix
        self.profile_path = profile_path
        self.run_id = run_id or profile.run_id
        self.run_owner = run_owner
        self.peer_config = Path(peer_config).resolve() if peer_config is not None else None
        self.port = port
        self.bootstrap_kind = bootstrap
        self.num_cpus = float(num_cpus or os.cpu_count() or 1)
        self.startup_timeout_s = startup_timeout_s
        self.workdir = state_dir(prefix)
        names = {p.name for p in profile.peers}
        self.bootstrap_name = next(
            n for n in (_BOOTSTRAP, f"{_BOOTSTRAP}-x", "swarm-bootstrap") if n not in names
        )
        self.lab: NetnsLab | None = None
        self._members: list[SwarmMember] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._throttles: list[ComputeThrottle] = []

    @classmethod
    def from_profile(
        cls, path: str | Path, *, netns: bool, prefix: str = "rvswarm", **kwargs: object
    ) -> Swarm:
        """A (not yet started) swarm of the profile TOML at ``path``; other arguments as for `Swarm`."""
        return cls(load_profile(path), netns=netns, prefix=prefix, profile_path=str(path), **kwargs)  # type: ignore[arg-type]

    @property
    def bootstrap(self) -> SwarmMember:
        """The bootstrap's record (after `start`)."""
        return self._members[0]

    @property
    def peers(self) -> list[SwarmMember]:
        """The profile's peers, in profile order (after `start`)."""
        return self._members[1:]

    @property
    def initial_peers(self) -> list[str]:
        """Multiaddrs of the bootstrap, for ``--initial-peers``."""
        return self.bootstrap.maddrs

    def state(self) -> SwarmState:
        """The state file's content for this swarm."""
        return SwarmState(
            prefix=self.prefix,
            run_id=self.run_id,
            run_owner=self.run_owner,
            profile_path=self.profile_path,
            netns=self.netns,
            workdir=str(self.workdir),
            bootstrap=self.bootstrap,
            peers=self.peers,
        )

    def _address(self, index: int) -> str:
        return self.lab.address_of(index) if self.lab is not None else "127.0.0.1"

    def _listen_args(self, index: int, *, dashes: str = "-") -> list[str]:
        if self.lab is None:
            return [f"--host{dashes}maddrs", "/ip4/127.0.0.1/tcp/0"]
        maddr = f"/ip4/{self._address(index)}/tcp/{self.port}"
        return [f"--host{dashes}maddrs", maddr, f"--announce{dashes}maddrs", maddr]

    def _bootstrap_argv(self, index: int) -> list[str]:
        if self.bootstrap_kind == "hivemind-dht":
            exe = shutil.which("hivemind-dht", path=os.path.dirname(sys.executable)) or "hivemind-dht"
            return [exe, *self._listen_args(index, dashes="_"), "--no_relay"]
        # one of our peers, in a run of its own so that it never shows up among the swarm's peers
        argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", f"{self.run_id}-bootstrap"]
        return argv + self._listen_args(index) + ["--no-use-relay"]

    def _peer_argv(self, index: int, spec: PeerProfile) -> list[str]:
        argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", self.run_id, "--no-use-relay"]
        argv += self._listen_args(index) + ["--initial-peers", *self.initial_peers]
        if spec.memory_gb is not None:
            argv += ["--max-memory-gb", str(spec.memory_gb)]
        if self.peer_config is not None:
            argv += ["--config", str(self.peer_config)]
        if self.run_owner is not None:
            argv += ["--run-owner", self.run_owner]
        return argv

    def _spawn(
        self,
        index: int,
        name: str,
        argv: list[str],
        throttle: ComputeThrottle,
        spec: PeerProfile | None = None,
    ) -> SwarmMember:
        log_path = self.workdir / f"{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **thread_env(1)}
        if self.lab is not None:
            proc = self.lab.run_in_ns(
                index, argv, env=env, log_path=log_path, throttle=throttle, stdin=subprocess.DEVNULL
            )
            namespace: str | None = self.lab.namespace_of(index)
        else:
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    throttle.wrap_argv(argv),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            if throttle.backend is ThrottleBackend.SIGSTOP:
                throttle.attach(proc.pid)
            namespace = None
        self._procs.append(proc)
        member = SwarmMember(
            name=name, pid=proc.pid, log_path=str(log_path), namespace=namespace, profile=spec
        )
        self._members.append(member)
        return member

    def _wait_ready(self, members: list[SwarmMember]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = {m.name: m for m in members}
        while pending:
            for name, member in list(pending.items()):
                proc = self._procs[self._members.index(member)]
                if proc.poll() is not None:
                    log = Path(member.log_path).read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log}")
                member.peer_id, member.maddrs = _scan_log(Path(member.log_path))
                if member.maddrs:
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{sorted(pending)} did not print their multiaddrs in {self.startup_timeout_s}s"
                )
            if pending:
                time.sleep(0.2)  # polling the logs, bounded by the deadline above

    def start(self) -> Swarm:
        """Start the bootstrap, then every peer; wait until all are up; write the state file.

        Raises:
            RuntimeError: the prefix is in use (a state file exists), or a process died while starting.
            TimeoutError: a process did not come up in time. Either way everything started is stopped.
        """
        if (self.workdir / "state.json").exists():
            raise RuntimeError(
                f"swarm {self.prefix!r} is already up; run `down` first or pick another prefix"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._launch()
            (self.workdir / "state.json").write_text(self.state().model_dump_json(indent=2))
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self) -> None:
        peers = list(self.profile.peers)
        boot_index = len(peers)
        if self.netns:
            boot = PeerProfile(name=self.bootstrap_name)
            lab_profile = self.profile.model_copy(update={"peers": [*peers, boot]})
            self.lab = NetnsLab(lab_profile, prefix=self.prefix)
            self.lab.up()
        base_cpus = base_cpus_to_fit([p.compute_slowdown for p in peers], num_cpus=self.num_cpus)
        boot_throttle = self._throttle("boot", 1.0, self.num_cpus, None)
        self._spawn(boot_index, self.bootstrap_name, self._bootstrap_argv(boot_index), boot_throttle)
        self._wait_ready([self.bootstrap])
        for i, spec in enumerate(peers):
            throttle = self._throttle(str(i), spec.compute_slowdown, base_cpus, spec.memory_gb)
            self._spawn(i, spec.name, self._peer_argv(i, spec), throttle, spec)
        self._wait_ready(self.peers)
        logger.info("swarm %s up: %d peers (netns=%s)", self.prefix, len(peers), self.netns)

    def _throttle(
        self, suffix: str, slowdown: float, base_cpus: float, memory_gb: float | None
    ) -> ComputeThrottle:
        throttle = ComputeThrottle(
            name=f"{self.prefix}-{suffix}", slowdown=slowdown, base_cpus=base_cpus, memory_gb=memory_gb
        )
        throttle.create()
        self._throttles.append(throttle)
        return throttle

    def stop(self) -> None:
        """Stop every process and remove namespaces, throttle groups and the state directory."""
        kill_groups([m.pid for m in self._members], self.prefix)  # also before a state file exists
        stop_swarm(self.prefix)
        for throttle in self._throttles:
            with contextlib.suppress(OSError):
                throttle.close()  # stops sigstop drivers; the groups are gone already
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        self._procs.clear()
        self._throttles.clear()

    def __enter__(self) -> Swarm:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
