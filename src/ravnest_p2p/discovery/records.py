"""The signed, expiring record each peer publishes about itself, and how untrusted copies are checked.

A record arrives from the DHT as msgpack under a subkey holding its owner's RSA public key; hivemind's
`RSASignatureValidator` has already checked the signature. We then (1) validate the value as a
`PeerRecord` with strict ranges (no NaN/inf; physically absurd figures such as 10^18 FLOP/s are refused
so a liar cannot distort the plan), (2) check that the peer id it claims is the one derived from the
signing key, and (3) check the schema's major version. Anything failing is dropped, never repaired.

Links. A record carries at most `MAX_LINKS` of its owner's measured links to other peers (rates and
round trip, as measured by the owner's probes): the planner's pairwise matrix is built from these, so
every peer plans with the same figures. They are validated like the rest (ranges, well-formed and
distinct peer ids, never the owner itself); a record with a bad link is refused whole. The field is
optional and older readers ignore it, so it needs no new schema version. Worst case (16 maximal
addresses, `MAX_LINKS` maximal links, `MAX_PLUGINS` maximal plugin names of each kind and a full
``unfit_reason``) the record stays below the ``peers`` key's 16 KiB cap (a unit test pins it).

Plugins. A peer lists the names of the *plugin* models and data sets it can serve (built-ins go without
saying), so a planner leaves out a peer that lacks a job's plugin before that peer even read the job
(`Serving.met_by`); a peer that read the job and cannot serve it says which job and why (``unfit_job``,
``unfit_reason``), for planners and for `status`. Both are optional fields, like the links.

Placement. A peer running a stage of an agreed plan says which layers it holds and for which workload
(``placement``; the plan's epoch, cluster and stage are the record's ``epoch``/``cluster``/``stage``),
so every planner, newcomers included, reads the previous plan's clusters from the same signed records
and keeps those still whole (`planning.replan`). Optional, like the links.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any

from pydantic import Field, StringConstraints, ValidationError, model_validator

from ravnest_p2p.errors import InvalidRecord
from ravnest_p2p.types import PeerState, WireModel

__all__ = [
    "MAX_BANDWIDTH_MBPS",
    "MAX_FLOPS",
    "MAX_LINKS",
    "MAX_PLUGINS",
    "SCHEMA_VERSION",
    "LinkRecord",
    "PeerIdStr",
    "PeerRecord",
    "PlacementRecord",
    "Serving",
    "owner_public_key",
    "parse_peer_record",
]

SCHEMA_VERSION = 1
# Bounds on what one volunteer machine can be: a few of today's largest accelerators' dense throughput,
# a large host's memory, a datacenter NIC. Anything beyond is a bug or a lie.
MAX_FLOPS = 5e15
MAX_MEMORY_BYTES = 4 * 2**40
MAX_BANDWIDTH_MBPS = 400_000.0
MAX_RTT_MS = 60_000.0
MAX_LINKS = 32
MAX_PLUGINS = 8  # of each kind: the record stays under its key's cap (see the module docstring)

_PUBLIC_KEY_RE = re.compile(rb"\[owner:(.+?)\]")

PeerIdStr = Annotated[
    str, StringConstraints(min_length=10, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")
]
Maddr = Annotated[str, StringConstraints(min_length=4, max_length=512)]
ShortStr = Annotated[str, StringConstraints(max_length=64)]
PluginName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_.-]{0,47}$")]
JobIdStr = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class LinkRecord(WireModel):
    """The owner's measured link to ``peer_id``: rates both ways and the round trip."""

    peer_id: PeerIdStr
    up_mbps: float = Field(gt=0, le=MAX_BANDWIDTH_MBPS, description="owner -> peer_id")
    down_mbps: float = Field(gt=0, le=MAX_BANDWIDTH_MBPS, description="peer_id -> owner")
    rtt_ms: float = Field(ge=0, le=MAX_RTT_MS)


class PlacementRecord(WireModel):
    """The owner's stage in the agreed plan it runs (that plan's epoch, cluster and stage are the record's
    own fields): its layer range and the workload (job) the plan was made for. A re-plan keeps a previous
    cluster whose members all still announce it whole (`planning.replan`)."""

    workload: JobIdStr
    first_layer: int = Field(ge=0, le=1_000_000)
    last_layer_exclusive: int = Field(ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _non_empty(self) -> PlacementRecord:
        if self.last_layer_exclusive <= self.first_layer:
            raise ValueError("a stage holds at least one layer")
        return self


class PeerRecord(WireModel):
    """What a peer says about itself. Units are in the field names; every number is range-checked."""

    schema_version: int = Field(default=SCHEMA_VERSION, ge=1, le=1000)
    peer_id: PeerIdStr
    maddrs: tuple[Maddr, ...] = Field(default=(), max_length=16)
    software_version: ShortStr = ""
    device: ShortStr = "cpu"
    flops: float = Field(ge=0, le=MAX_FLOPS, description="measured matmul FLOP/s in the training dtype")
    free_memory_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    upload_mbps: float = Field(default=0.0, ge=0, le=MAX_BANDWIDTH_MBPS)
    download_mbps: float = Field(default=0.0, ge=0, le=MAX_BANDWIDTH_MBPS)
    rtt_ms: float | None = Field(default=None, ge=0, le=MAX_RTT_MS)
    state: PeerState = PeerState.JOINING
    client_mode: bool = False
    epoch: int = Field(default=0, ge=0, le=2**62)
    cluster: int | None = Field(default=None, ge=0, le=100_000)
    stage: int | None = Field(default=None, ge=0, le=100_000)
    run_owner: PeerIdStr | None = Field(default=None, description="the run owner this peer obeys; None: open")
    updated_at: float = Field(ge=0, description="DHT time of publication")
    links: tuple[LinkRecord, ...] = Field(default=(), max_length=MAX_LINKS)
    plugin_models: tuple[PluginName, ...] = Field(default=(), max_length=MAX_PLUGINS)
    plugin_datasets: tuple[PluginName, ...] = Field(default=(), max_length=MAX_PLUGINS)
    unfit_job: JobIdStr | None = Field(default=None, description="a job this peer cannot serve")
    unfit_reason: str | None = Field(default=None, max_length=200)
    placement: PlacementRecord | None = Field(default=None, description="layers held on the active plan")

    @model_validator(mode="after")
    def _links_name_others_once(self) -> PeerRecord:
        named = [link.peer_id for link in self.links]
        if len(set(named)) != len(named):
            raise ValueError("a peer appears twice in links")
        if self.peer_id in named:
            raise ValueError("a record cannot report a link to its own peer")
        return self


@dataclasses.dataclass(frozen=True)
class Serving:
    """What a job needs of a peer beyond the software: the plugin models/data sets it names.

    A planner keeps a record only if it lists every needed plugin and does not say it is unfit for the
    job. Every peer derives the same `Serving` from the same job and judges the same signed records, so
    planners agree on who is left out.
    """

    job_id: str
    plugin_models: frozenset[str] = frozenset()
    plugin_datasets: frozenset[str] = frozenset()

    def met_by(self, record: PeerRecord) -> bool:
        if record.unfit_job == self.job_id:
            return False
        return self.plugin_models <= set(record.plugin_models) and self.plugin_datasets <= set(
            record.plugin_datasets
        )


def owner_public_key(subkey: Any) -> bytes | None:
    """The OpenSSH public key embedded in a protected subkey, or None for an unprotected one."""
    if not isinstance(subkey, bytes):
        return None
    match = _PUBLIC_KEY_RE.search(subkey)
    return match.group(1) if match else None


def parse_peer_record(value: Any, *, signer_peer_id: str | None) -> PeerRecord:
    """Validate an untrusted record value; raise `InvalidRecord` with the reason.

    Args:
        value: the decoded msgpack value from the DHT.
        signer_peer_id: the peer id derived from the subkey's signing key; None if the subkey carried no
            key (never acceptable for peer records).
    """
    if signer_peer_id is None:
        raise InvalidRecord("record is not signed by an owner key")
    if not isinstance(value, dict):
        raise InvalidRecord(f"record is a {type(value).__name__}, not a map")
    version = value.get("schema_version")
    if not isinstance(version, int) or version != SCHEMA_VERSION:
        raise InvalidRecord(f"unsupported schema version {version!r}")
    try:
        record = PeerRecord.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRecord(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if record.peer_id != signer_peer_id:
        raise InvalidRecord(f"record claims peer {record.peer_id} but is signed by {signer_peer_id}")
    return record
