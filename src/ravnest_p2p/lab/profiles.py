"""Swarm profiles: who is in an emulated swarm and how fast each peer's links and CPU are.

A profile is a TOML file in ``peers/``, read by `load_profile`. Top-level keys are swarm options, each
``[[peers]]`` table one peer::

    run_id = "lab4"
    shaping = "htb"            # or "tbf" (one rate per direction, no per-destination matrix)

    [[peers]]
    name = "p0"
    upload_mbps = 20           # omit for an unshaped link
    download_mbps = 20
    compute_slowdown = 2.0     # 1.0 = full speed; 2.0 = half the work per second
    memory_gb = 4              # omit for no cap

    [peers.upload_to_mbps]     # optional per-destination egress rates (htb only)
    p1 = 5

An optional ``[workload]`` table carries message sizes for benchmarks that replay a scaled scenario
(``scenario_*.toml``): bandwidths and message sizes there are scaled by the same ``scale`` factor so that
transfer times keep their proportions.

Bad input raises `ConfigError` (a `ValueError`) whose message names the file and the offending field.
"""

from __future__ import annotations

import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ravnest_p2p.errors import ConfigError

__all__ = [
    "PeerProfile",
    "ShapingMode",
    "SwarmProfile",
    "WorkloadProfile",
    "load_profile",
    "parse_profile",
]

PeerName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")]
Mbps = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class ShapingMode(StrEnum):
    """Which Linux qdisc shapes the links.

    ``htb`` supports a per-destination matrix (one class per destination); ``tbf`` is a single token
    bucket per direction — simpler, but it cannot tell destinations apart.
    """

    HTB = "htb"
    TBF = "tbf"


class PeerProfile(BaseModel):
    """One emulated peer.

    Attributes:
        name: unique within the swarm; used as the key of other peers' ``upload_to_mbps``.
        upload_mbps: egress cap in Mbit/s (10**6 bit/s); None = unshaped.
        download_mbps: ingress cap in Mbit/s; None = unshaped.
        upload_to_mbps: per-destination egress caps (peer name -> Mbit/s), each also bounded by
            ``upload_mbps``; destinations not listed get ``upload_mbps``.
        compute_slowdown: 1.0 = full speed, k = 1/k of the work per second.
        memory_gb: memory cap in GB (10**9 bytes); None = no cap.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: PeerName
    upload_mbps: Mbps | None = None
    download_mbps: Mbps | None = None
    upload_to_mbps: dict[PeerName, Mbps] = Field(default_factory=dict)
    compute_slowdown: Annotated[float, Field(ge=1.0, le=1000.0, allow_inf_nan=False)] = 1.0
    memory_gb: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None

    @model_validator(mode="after")
    def _no_self_destination(self) -> PeerProfile:
        if self.name in self.upload_to_mbps:
            raise ValueError(f"upload_to_mbps of peer {self.name!r} names the peer itself")
        return self


class WorkloadProfile(BaseModel):
    """Message sizes of a (scaled) benchmark workload.

    Attributes:
        dp_message_bytes: bytes one stage all-reduces per step (data-parallel traffic).
        pp_message_bytes: bytes of activations per micro-batch between stages (pipeline traffic).
        num_stages: pipeline stages the scenario assumes.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp_message_bytes: Annotated[int, Field(gt=0)]
    pp_message_bytes: Annotated[int, Field(gt=0)]
    num_stages: Annotated[int, Field(gt=0)] = 1


class SwarmProfile(BaseModel):
    """A whole emulated swarm.

    Attributes:
        run_id: label for logs and results.
        shaping: qdisc used for every shaped link.
        scale: factor applied to a real scenario's bandwidths and message sizes (1.0 = not scaled).
        peers: the peers, in index order (index i gets the i-th lab address).
        workload: optional message sizes for benchmarks.
        tcp_congestion_control: the TCP congestion control of every peer namespace; None keeps the
            host's. Default ``reno``: volunteers' machines run loss-based control (CUBIC is the Linux,
            Windows and macOS default; at the lab's sub-millisecond base RTT it behaves as Reno, and this
            host allows only ``reno`` and ``bbr`` in namespaces), whereas this host's default is ``bbr``,
            which lost 18 % of an uplink that also carried the ACKs of an incoming flow (25 Mbit/s: 19.7
            Mbit/s out with one flow in, 24.0 alone; Reno 23.9 either way), i.e. on every ring member.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    shaping: ShapingMode = ShapingMode.HTB
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    peers: Annotated[list[PeerProfile], Field(min_length=1, max_length=4096)]
    workload: WorkloadProfile | None = None
    tcp_congestion_control: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,16}$")] | None = "reno"

    @model_validator(mode="after")
    def _check_names(self) -> SwarmProfile:
        names = [p.name for p in self.peers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"peer names must be unique, repeated: {duplicates}")
        known = set(names)
        for peer in self.peers:
            unknown = sorted(set(peer.upload_to_mbps) - known)
            if unknown:
                raise ValueError(f"upload_to_mbps of peer {peer.name!r} names unknown peers {unknown}")
            if peer.upload_to_mbps and self.shaping is ShapingMode.TBF:
                raise ValueError(
                    f"peer {peer.name!r} has upload_to_mbps but shaping='tbf' cannot shape per "
                    "destination; use shaping='htb'"
                )
        return self

    def index_of(self, name: str) -> int:
        """Return the index of the peer called ``name``.

        Raises:
            KeyError: no such peer.
        """
        for i, peer in enumerate(self.peers):
            if peer.name == name:
                return i
        raise KeyError(name)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        loc = ".".join(str(x) for x in item["loc"]) or "<top level>"
        parts.append(f"{loc}: {item['msg']}")
    return "; ".join(parts)


def parse_profile(data: dict[str, Any], *, source: str = "<profile>") -> SwarmProfile:
    """Validate an already-decoded profile.

    Args:
        data: the decoded TOML (or equivalent) mapping.
        source: a name for error messages, usually the file path.

    Raises:
        ConfigError: the data is not a valid profile; the message names ``source`` and the field.
    """
    try:
        return SwarmProfile.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{source}: invalid swarm profile: {_describe(e)}") from None


def load_profile(path: str | Path) -> SwarmProfile:
    """Read and validate a swarm profile TOML file.

    Raises:
        ConfigError: unreadable file, bad TOML, or an invalid field (the message names file and field).
    """
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read swarm profile: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_profile(data, source=str(path))
