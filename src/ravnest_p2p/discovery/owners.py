"""Who may publish jobs in a run: its owner, and the keys the owner lists in an owner-signed record.

A run is bound to its owner's peer id (derived from the owner's RSA public key, see
`transport.identity`). The owner may delegate: it stores an `OwnersRecord` under the run's ``owners``
key, signed with its own subkey, naming extra peer ids allowed to publish jobs. A delegate's say-so
lasts only as long as that record: `authorized_signers` gives each allowed signer the latest expiry its
jobs may have (the owner: unbounded; a delegate: the owners record's expiry).

An open run (no owner configured) trains anyone's job, as before this record existed: it stays for
backwards compatibility and local experiments, and the peer logs a warning when it starts one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError

from ravnest_p2p.discovery.records import PeerIdStr
from ravnest_p2p.errors import InvalidRecord
from ravnest_p2p.types import WireModel

__all__ = ["OWNERS_KEY", "OwnersRecord", "authorized_signers", "parse_owners"]

OWNERS_KEY = "owners"
MAX_DELEGATES = 64


class OwnersRecord(WireModel):
    """The owner's list of extra peer ids whose jobs the run trains."""

    schema_version: int = Field(default=1, ge=1, le=1)
    owner: PeerIdStr
    keys: tuple[PeerIdStr, ...] = Field(default=(), max_length=MAX_DELEGATES)
    updated_at: float = Field(ge=0)


def parse_owners(value: Any, signer_peer_id: str) -> OwnersRecord:
    """Validate an untrusted owners value; it must name its signer as the owner."""
    if not isinstance(value, dict):
        raise InvalidRecord(f"owners record is a {type(value).__name__}, not a map")
    try:
        record = OwnersRecord.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRecord(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    if record.owner != signer_peer_id:
        raise InvalidRecord(f"owners record names {record.owner} but is signed by {signer_peer_id}")
    return record


def authorized_signers(run_owner: str, owners: Mapping[str, tuple[Any, float]]) -> dict[str, float]:
    """Who may publish jobs, each with the latest expiry its jobs may have.

    Args:
        run_owner: the run owner's peer id.
        owners: what `RunDHT.get_signed("owners")` returned ({signer: (value, expiry)}); only the
            owner's own value counts, anything else (or a malformed value) is ignored.
    """
    allowed = {run_owner: math.inf}
    entry = owners.get(run_owner)
    if entry is None:
        return allowed
    value, expiry = entry
    try:
        record = parse_owners(value, run_owner)
    except InvalidRecord:
        return allowed
    for key in record.keys:
        if key != run_owner:
            allowed[key] = expiry
    return allowed
