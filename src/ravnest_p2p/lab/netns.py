"""An emulated swarm network on one machine: one Linux network namespace per peer, shaped links.

Why: the placement, clustering and averaging code reasons about heterogeneous links (a 20 Mbit/s home
uplink next to a 1 Gbit/s lab machine). Running every peer on loopback hides all of that. The lab gives
each peer its own network stack and a link whose rates we choose, so that benchmarks measure what the
algorithms would meet on real volunteer networks — at rates this small machine can sustain.

Topology (``P`` is a short per-swarm prefix, so concurrent labs never share a name)::

    netns P-0 [Pp0 198.18.0.1] ──veth── [Pb0]┐
    netns P-1 [Pp1 198.18.0.2] ──veth── [Pb1]┼─ br0   (netns P-br, a plain L2 bridge, no address)
    ...                                      ┘

Every veth is created directly inside its namespaces (``ip -n``), so nothing ever appears in the root
namespace and the host's routing is never touched. Because each lab has its own bridge namespace,
labs are isolated from each other at L2 and may reuse the same addresses.

Addressing: peer ``i`` gets ``198.18.<i // 250>.<i % 250 + 1>/15`` (inside 198.18.0.0/15, the RFC 2544
benchmarking range); /15 makes every peer on-link, so no routes are needed.

Shaping (rates in Mbit/s = 10**6 bit/s):

- upload: egress of the peer-side veth. With ``htb``: a root class at the peer's upload rate, one child
  class per destination listed in ``upload_to_mbps`` (selected by a ``u32`` filter on the destination
  IP), and a default child class at the upload rate for everything else. With ``tbf``: one bucket.
- download: egress of the bridge-side veth, i.e. traffic the bridge delivers to the peer. Shaping the
  far end's egress is the standard way to shape ingress without an ``ifb`` device.
- Rates are wire rates (Ethernet frames). A bulk TCP transfer's payload therefore runs at
  1448/1514 = 0.957 of the configured rate (headers of a 1500-byte MTU with TCP timestamps); measured
  here, htb and tbf alike: 19.1/20, 47.9/50, 95.7/100, 191.4/200 Mbit/s, upload- or download-bound.
- TSO/GSO stay on (changing them needs ``ethtool``, which the project does not install). Both qdiscs
  account a GSO super-packet by its full length, so long-run rates stay exact (see above); we only size
  ``burst`` to hold one such packet (64 KiB) so the bucket never stalls on it.
- TCP congestion control: each peer namespace gets the profile's ``tcp_congestion_control`` (default
  ``reno``, standing in for the CUBIC volunteers run; see `SwarmProfile`), not the host's ``bbr``.
  Only ``pfifo``/``bfifo`` queues exist under the classes here (no ``fq_codel``, ``sfq`` or ``fq``).

What the lab does NOT model: latency, jitter and loss. ``netem`` is not available in this kernel and no
other qdisc delays packets by itself; a userspace delaying proxy would distort throughput. A sound route
exists but is not taken: an eBPF ``tc`` program stamping ``skb->tstamp = now + delay`` in front of the
``fq`` qdisc, which holds packets until their departure time (the EDT model); it needs a BPF toolchain
(clang) that this image does not have. Round-trip times in the scenarios are therefore documented in the
profiles but not emulated. CPU and memory caps are separate
(`ravnest_p2p.lab.throttle`).

Cleanup is by prefix: `NetnsLab.down` kills the processes it started (their process groups), then any
process still inside a ``P-*`` namespace (``ip netns pids``) or about to enter one, then deletes the
namespaces — which destroys their veths and the bridge — and the cgroups of throttles made by
`NetnsLab.throttle_for`. It works on a fresh object after a crash and is idempotent.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from ravnest_p2p.lab._procs import entering_pids, kill_groups, run
from ravnest_p2p.lab.profiles import PeerProfile, ShapingMode, SwarmProfile
from ravnest_p2p.lab.throttle import DEFAULT_PERIOD_US, ComputeThrottle, ThrottleBackend, remove_groups

__all__ = ["NetnsLab", "lab_address", "remove_leftovers"]

logger = logging.getLogger(__name__)

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_MAX_PEERS = 9999  # keeps "<prefix>p<i>" within the 15-character interface-name limit
_GSO_BYTES = 64 * 1024
_UNSHAPED_MBPS = 10_000.0  # parent rate when only per-destination caps exist
_BRIDGE = "br0"


def lab_address(peer_index: int) -> str:
    """Return the IPv4 address (no mask) of peer ``peer_index`` in any lab.

    Raises:
        ValueError: the index is outside the supported range.
    """
    if not 0 <= peer_index < _MAX_PEERS:
        raise ValueError(f"peer index {peer_index} outside 0..{_MAX_PEERS - 1}")
    return f"198.18.{peer_index // 250}.{peer_index % 250 + 1}"


def _rate(mbps: float) -> str:
    return f"{round(mbps * 1000)}kbit"


def _burst_bytes(mbps: float) -> int:
    # 5 ms worth of tokens, at least one GSO super-packet: small enough that a 3 s transfer overshoots
    # by well under 1 %, large enough that the kernel timer granularity never starves the class.
    return max(_GSO_BYTES, int(mbps * 1e6 / 8 * 0.005))


def _htb_root(ns: str, dev: str) -> None:
    run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])


def _htb_class(ns: str, dev: str, parent: str, classid: str, mbps: float) -> None:
    # rate == ceil: a class never borrows beyond its cap. An explicit quantum keeps the kernel from
    # deriving (and warning about) a huge one from the rate; 64 KiB fits a GSO packet.
    burst = str(_burst_bytes(mbps))
    shape = ["rate", _rate(mbps), "ceil", _rate(mbps), "burst", burst, "cburst", burst, "quantum", "65536"]
    run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb", *shape])


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"lab prefix {prefix!r} must match {_PREFIX_RE.pattern} (at most 8 characters)")


def _prefix_namespaces(prefix: str) -> list[str]:
    own = re.compile(rf"^{re.escape(prefix)}-(br|\d+)$")
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip() and own.match(line.split()[0])]


def _prefix_root_links(prefix: str) -> list[str]:
    own = re.compile(rf"^{re.escape(prefix)}[pb]\d+$")
    names = []
    for line in run(["ip", "-o", "link"]).stdout.splitlines():
        fields = line.split(":", 2)
        if len(fields) >= 2:
            name = fields[1].strip().split("@")[0]
            if own.match(name):
                names.append(name)
    return names


def remove_leftovers(prefix: str, extra_pids: Sequence[int] = ()) -> None:
    """Remove every namespace, link and process of the lab with this prefix; idempotent.

    Args:
        prefix: the lab prefix.
        extra_pids: process-group leaders started by the lab (killed first, with their groups).
    """
    _check_prefix(prefix)
    namespaces = _prefix_namespaces(prefix)
    kill_groups(list(extra_pids), prefix)
    # A process moves from "entering" (running `ip netns exec`) to "inside" only, so scanning in that
    # order misses none that exist when the scan starts; repeat in case a dying process spawned more.
    for _ in range(5):
        found = entering_pids(namespaces)
        for ns in namespaces:
            found += [int(p) for p in run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not found:
            break
        kill_groups(found, prefix)
    for ns in namespaces:
        run(["ip", "netns", "delete", ns], check=False)
    for link in _prefix_root_links(prefix):
        run(["ip", "link", "delete", link], check=False)
    remove_groups(f"{prefix}-")  # throttles made by NetnsLab.throttle_for


class NetnsLab:
    """Builds and tears down the namespaced swarm network described by a `SwarmProfile`.

    Use as a context manager (``with NetnsLab(profile, prefix="rvt1a2b") as lab:``) or call `up` and
    `down`. Needs root and the ``ip``/``tc`` tools.

    Args:
        profile: the swarm; peer ``i`` of the profile becomes namespace ``<prefix>-<i>``.
        prefix: 1-8 lowercase letters/digits starting with a letter, unique among concurrent labs.
    """

    def __init__(self, profile: SwarmProfile, *, prefix: str) -> None:
        _check_prefix(prefix)
        if len(profile.peers) > _MAX_PEERS:
            raise ValueError(f"a lab holds at most {_MAX_PEERS} peers, profile has {len(profile.peers)}")
        self.profile = profile
        self.prefix = prefix
        self._pids: list[int] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def bridge_namespace(self) -> str:
        """Name of the namespace holding the bridge."""
        return f"{self.prefix}-br"

    @property
    def num_peers(self) -> int:
        """Number of peers in the lab."""
        return len(self.profile.peers)

    def namespace_of(self, peer: int | str) -> str:
        """Namespace name of a peer given by index or profile name."""
        return f"{self.prefix}-{self._index(peer)}"

    def address_of(self, peer_index: int) -> str:
        """IPv4 address (no mask) of peer ``peer_index``, reachable from every other peer."""
        return lab_address(self._index(peer_index))

    def interface_of(self, peer: int | str) -> str:
        """Name of the peer's interface inside its namespace."""
        return f"{self.prefix}p{self._index(peer)}"

    def _index(self, peer: int | str) -> int:
        i = self.profile.index_of(peer) if isinstance(peer, str) else peer
        if not 0 <= i < self.num_peers:
            raise ValueError(f"peer index {i} outside 0..{self.num_peers - 1}")
        return i

    def up(self) -> None:
        """Create the namespaces, bridge, veths, addresses and qdiscs; on failure, undo everything.

        Raises:
            RuntimeError: the prefix is already in use (nothing is touched), or an ``ip``/``tc`` command
                failed (everything created so far is removed).
        """
        if _prefix_namespaces(self.prefix):
            raise RuntimeError(f"lab prefix {self.prefix!r} is in use; call down() or pick another prefix")
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        br_ns = self.bridge_namespace
        run(["ip", "netns", "add", br_ns])
        run(["ip", "-n", br_ns, "link", "set", "lo", "up"])
        run(["ip", "-n", br_ns, "link", "add", _BRIDGE, "type", "bridge", "stp_state", "0"])
        run(["ip", "-n", br_ns, "link", "set", _BRIDGE, "up"])
        for i, peer in enumerate(self.profile.peers):
            ns, inner, outer = self.namespace_of(i), self.interface_of(i), f"{self.prefix}b{i}"
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if self.profile.tcp_congestion_control is not None:
                sysctl = f"net.ipv4.tcp_congestion_control={self.profile.tcp_congestion_control}"
                run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", sysctl])
            run(["ip", "-n", ns, "link", "add", inner, "type", "veth", "peer", "name", outer, "netns", br_ns])
            run(["ip", "-n", ns, "addr", "add", f"{lab_address(i)}/15", "dev", inner])
            run(["ip", "-n", ns, "link", "set", inner, "up"])
            run(["ip", "-n", br_ns, "link", "set", outer, "master", _BRIDGE])
            run(["ip", "-n", br_ns, "link", "set", outer, "up"])
            self._shape_upload(ns, inner, peer)
            if peer.download_mbps is not None:
                self._shape_single(br_ns, outer, peer.download_mbps)
        logger.info(
            "lab %s up: %d peers, shaping=%s, tcp=%s",
            self.prefix,
            self.num_peers,
            self.profile.shaping,
            self.profile.tcp_congestion_control or "host default",
        )

    def _shape_single(self, ns: str, dev: str, mbps: float) -> None:
        if self.profile.shaping is ShapingMode.TBF:
            burst = str(_burst_bytes(mbps))
            tbf = ["tbf", "rate", _rate(mbps), "burst", burst, "latency", "50ms"]
            run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
            return
        _htb_root(ns, dev)
        _htb_class(ns, dev, "1:", "1:10", mbps)

    def _shape_upload(self, ns: str, dev: str, peer: PeerProfile) -> None:
        if not peer.upload_to_mbps:
            if peer.upload_mbps is not None:
                self._shape_single(ns, dev, peer.upload_mbps)
            return
        # 1:1 caps the whole uplink; 1:10 carries destinations not listed; 1:<hex 100+j> is destination j.
        total = peer.upload_mbps if peer.upload_mbps is not None else _UNSHAPED_MBPS
        _htb_root(ns, dev)
        _htb_class(ns, dev, "1:", "1:1", total)
        _htb_class(ns, dev, "1:1", "1:10", total)
        for dest_name, mbps in sorted(peer.upload_to_mbps.items()):
            j = self.profile.index_of(dest_name)
            classid = f"1:{100 + j:x}"
            _htb_class(ns, dev, "1:1", classid, min(mbps, total))
            match = ["u32", "match", "ip", "dst", f"{lab_address(j)}/32", "flowid", classid]
            run(["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", *match])

    def throttle_for(
        self, peer: int | str, *, base_cpus: float, period_us: int | None = None
    ) -> ComputeThrottle:
        """A (not yet created) `ComputeThrottle` for the peer's ``compute_slowdown`` and ``memory_gb``.

        Named ``<prefix>-<index>`` so that `down` removes its cgroups even after a crash. Use it for
        every peer, full-speed ones included, with ``base_cpus`` from `base_cpus_to_fit` (see
        `ravnest_p2p.lab.throttle`).

        Args:
            peer: peer index or profile name.
            base_cpus: CPU share of a full-speed peer; this peer gets ``base_cpus / compute_slowdown``.
            period_us: the CFS period (None: the throttle's default, 100 ms).
        """
        i = self._index(peer)
        spec = self.profile.peers[i]
        name = f"{self.prefix}-{i}"
        return ComputeThrottle(
            name=name,
            slowdown=spec.compute_slowdown,
            base_cpus=base_cpus,
            memory_gb=spec.memory_gb,
            period_us=period_us if period_us is not None else DEFAULT_PERIOD_US,
        )

    def run_in_ns(
        self,
        peer: int | str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        throttle: ComputeThrottle | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the peer's namespace; `down` kills its whole process group.

        Args:
            peer: peer index or profile name.
            argv: the command, e.g. ``[sys.executable, "-m", "ravnest_p2p.peer", "--host-maddrs", ...]``.
            env: variables added to (overriding) the current environment.
            log_path: if given, stdout and stderr are appended to this file (parents created).
            throttle: a created `ComputeThrottle` to run the process under. It is joined before
                ``ip netns exec``, which remounts ``/sys`` and so hides the cgroup tree from the command.
            **popen_kwargs: passed to `subprocess.Popen` (e.g. ``stdout=subprocess.PIPE``, ``cwd``).

        Returns:
            The Popen of ``ip netns exec`` (which execs into ``argv``, so its pid is the command's).
        """
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        popen_kwargs.setdefault("env", full_env)
        popen_kwargs["start_new_session"] = True  # own process group, so down() can kill the whole tree
        cmd = ["ip", "netns", "exec", self.namespace_of(peer), *argv]
        if throttle is not None:
            cmd = throttle.wrap_argv(cmd)
        if log_path is not None:
            path = Path(log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen_kwargs)
        else:
            proc = subprocess.Popen(cmd, **popen_kwargs)
        self._pids.append(proc.pid)
        self._procs.append(proc)
        if throttle is not None and throttle.backend is ThrottleBackend.SIGSTOP:
            throttle.attach(proc.pid)
        return proc

    @property
    def pids(self) -> list[int]:
        """Pids of the processes started by `run_in_ns` (each leads its own process group)."""
        return list(self._pids)

    def down(self) -> None:
        """Kill the lab's processes and remove everything with this prefix; safe to call repeatedly."""
        remove_leftovers(self.prefix, self._pids)
        for proc in self._procs:
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                logger.warning("lab %s: pid %d did not exit", self.prefix, proc.pid)
        self._pids.clear()
        self._procs.clear()
        logger.info("lab %s down", self.prefix)

    def __enter__(self) -> NetnsLab:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()
