"""Helpers of the Docker test: the daemon (ours or one already running) and one compose swarm.

Everything is found and removed by what this test created: the dockerd it started (by pid), and the
compose project it named (a fresh name per run), whose containers, network and volumes it records by id.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
# the flags of a daemon this test starts: its default bridge and every pool network inside 198.18.0.0/15
DOCKERD_FLAGS = ("--bip", "198.18.100.1/24", "--default-address-pool", "base=198.19.0.0/16,size=24")


def docker(*args: str, timeout: float = 120.0, check: bool = True, env: dict | None = None) -> str:
    proc = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def daemon_running() -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class Daemon:
    """Use a running Docker daemon, or start one (root) with `DOCKERD_FLAGS` and stop it afterwards."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.popen: subprocess.Popen[bytes] | None = None
        self.made_bridge = False  # docker0 did not exist before our daemon: remove it afterwards
        self.host_net: HostNetState | None = None

    def ensure(self, timeout_s: float = 60.0) -> None:
        if daemon_running():
            return
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise RuntimeError("no Docker daemon is running and dockerd is not installed")
        self.made_bridge = not Path("/sys/class/net/docker0").exists()
        self.host_net = HostNetState()
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                [dockerd, *DOCKERD_FLAGS], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not daemon_running():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dockerd did not come up: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.5)

    @property
    def started(self) -> bool:
        return self.popen is not None

    def stop(self) -> None:
        """Stop the daemon this object started (SIGTERM, then SIGKILL), remove the docker0 bridge it made
        and undo its iptables and forwarding changes; a daemon that was already running is left alone."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        if self.made_bridge and Path("/sys/class/net/docker0").exists():
            subprocess.run(["ip", "link", "delete", "docker0"], capture_output=True, check=False)
        if self.host_net is not None:
            self.host_net.restore()


def _iptables(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["iptables", *args], capture_output=True, text=True, check=False)


class HostNetState:
    """What a dockerd changes in the host's network stack and leaves when it stops: IPv4 forwarding on,
    the FORWARD policy DROP (when it had to turn forwarding on), and its iptables chains. Recorded before
    our daemon starts, restored after it stops; only rules that name docker0 or a DOCKER chain go."""

    def __init__(self) -> None:
        self.ip_forward = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
        policy = [line for line in _iptables("-S", "FORWARD").stdout.splitlines() if line.startswith("-P")]
        self.forward_policy = policy[0].split()[-1] if policy else "ACCEPT"

    def restore(self) -> None:
        for table in ("nat", "filter"):
            rules = _iptables("-t", table, "-S").stdout.splitlines()
            for rule in rules:
                if rule.startswith("-A ") and ("DOCKER" in rule or "docker0" in rule):
                    _iptables("-t", table, "-D", *rule.split()[1:])
            for rule in rules:
                if rule.startswith("-N DOCKER"):
                    _iptables("-t", table, "-X", rule.split()[1])
        _iptables("-P", "FORWARD", self.forward_policy)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self.ip_forward)


def compose_command() -> list[str]:
    """`docker compose` (the v2 plugin) if present, else the standalone `docker-compose` (v1)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise RuntimeError("neither `docker compose` nor `docker-compose` is installed")


def used_subnets() -> list[ipaddress.IPv4Network]:
    subnets = []
    ids = docker("network", "ls", "-q").split()
    for net in json.loads(docker("network", "inspect", *ids)) if ids else []:
        for config in (net.get("IPAM") or {}).get("Config") or []:
            if "Subnet" in config and ":" not in config["Subnet"]:
                subnets.append(ipaddress.ip_network(config["Subnet"]))
    return subnets


def free_net_prefix() -> str:
    """The first three octets of a /24 in 198.18.101.0 to 198.18.199.0 that no Docker network uses."""
    used = used_subnets()
    for third in range(101, 200):
        candidate = ipaddress.ip_network(f"198.18.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return f"198.18.{third}"
    raise RuntimeError("no free /24 in 198.18.101.0-198.18.199.0")


class ComposeSwarm:
    """docker/compose.yaml under a fresh project name: a bootstrap peer and two volunteers."""

    def __init__(self, *, image: str, run_id: str, run_owner: str, log_dir: Path) -> None:
        self.project = f"rvdocker{uuid.uuid4().hex[:10]}"
        self.net_prefix = free_net_prefix()
        self.log_dir = log_dir
        self.base = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", self.project]
        self.env = {
            **os.environ,
            "RAVNEST_IMAGE": image,
            "RAVNEST_NET": self.net_prefix,
            "RAVNEST_RUN_ID": run_id,
            "RAVNEST_RUN_OWNER": run_owner,
        }
        self.bootstrap_id = ""
        self.container_ids: set[str] = set()
        self.network_ids: set[str] = set()
        self.volumes: set[str] = set()

    def compose(self, *args: str, timeout: float = 300.0) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, env=self.env, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
        return proc.stdout

    @property
    def initial_peers(self) -> list[str]:
        return [f"/ip4/{self.net_prefix}.10/tcp/31337/p2p/{self.bootstrap_id}"]

    def _record(self) -> None:
        """Remember the ids of what the project has made so far (by its unique project label)."""
        label = f"label=com.docker.compose.project={self.project}"
        self.container_ids |= set(docker("ps", "-aq", "--no-trunc", "--filter", label).split())
        self.network_ids |= set(docker("network", "ls", "-q", "--no-trunc", "--filter", label).split())
        self.volumes |= set(docker("volume", "ls", "-q", "--filter", label).split())

    def up(self) -> None:
        """Make the bootstrap's key on its volume, read its peer id, then start the three peers."""
        try:
            out = self.compose("run", "--rm", "--no-deps", "-T", "bootstrap", "peer-id")
            self.bootstrap_id = out.strip().splitlines()[-1]
            self.env["RAVNEST_BOOTSTRAP_ID"] = self.bootstrap_id
            self.compose("up", "-d")
        finally:
            self._record()

    def addresses(self) -> dict[str, list[str]]:
        """Container name -> its IPv4 addresses."""
        self._record()
        out = {}
        for info in json.loads(docker("inspect", *sorted(self.container_ids))):
            nets = info["NetworkSettings"]["Networks"].values()
            out[info["Name"].lstrip("/")] = [n["IPAddress"] for n in nets if n.get("IPAddress")]
        return out

    def subnets(self) -> list[str]:
        self._record()
        infos = json.loads(docker("network", "inspect", *sorted(self.network_ids)))
        return [c["Subnet"] for info in infos for c in info["IPAM"]["Config"]]

    def save_logs(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for cid in sorted(self.container_ids):
            proc = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, check=False)
            (self.log_dir / f"{cid[:12]}.log").write_text(proc.stdout + proc.stderr)

    def down(self) -> list[str]:
        """Compose down (containers, network, volumes), then remove by id whatever is left; what failed."""
        errors: list[str] = []
        try:
            self._record()
            self.save_logs()
            self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180)
        except Exception as exc:
            errors.append(str(exc))
        leftovers: Sequence[tuple[str, set[str]]] = (
            ("rm -f", self.container_ids),
            ("network rm", self.network_ids),
            ("volume rm -f", self.volumes),
        )
        for command, ids in leftovers:
            for ident in sorted(ids):
                proc = subprocess.run(
                    ["docker", *command.split(), ident], capture_output=True, text=True, check=False
                )
                if proc.returncode != 0 and "No such" not in proc.stderr and "not found" not in proc.stderr:
                    errors.append(f"docker {command} {ident}: {proc.stderr.strip()}")
        return errors

    def remaining(self) -> list[str]:
        """What of this swarm still exists (should be nothing after `down`)."""
        label = f"label=com.docker.compose.project={self.project}"
        return (
            docker("ps", "-aq", "--filter", label).split()
            + docker("network", "ls", "-q", "--filter", label).split()
            + docker("volume", "ls", "-q", "--filter", label).split()
        )
