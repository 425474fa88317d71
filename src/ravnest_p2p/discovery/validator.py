"""The run's record validator, a link in hivemind's validator chain, applied on store and on read.

Problem: hivemind's `RSASignatureValidator` only protects records whose subkey embeds an owner key; an
unsigned plain value under the same key passes it, and hivemind's storage lets a plain value with a
later expiry replace the whole dictionary of signed records (seen: one such value under ``peers`` and
the status tool showed 0 peers, every announce was refused until it expired). Nothing capped sizes or
expiries either: a record stored with an expiry 10^9 s ahead was planned with long after its peer left.

What this validator does, for every name of the run's `KeyRegistry` (other keys pass untouched):
- refuses plain values and subkeys without an owner key (the RSA validator, which runs first, has
  already checked the signature of those that have one);
- refuses expiries beyond the key's maximum TTL (plus a small clock skew) and values over its size cap;
- refuses values that are not a map with an integer ``schema_version``, that nest deeper than 16
  levels, whose ``updated_at`` is in the future or older than the TTL (or older than the expiry
  allows), or that fail the key's schema;
- for ``owner_only`` keys of an owned run, refuses every signer but the owner.

hivemind runs validators by decreasing `priority` on validation: the RSA validator (10) first, then
the value is stripped of its signature and handed to us (5). Keys arrive hashed (`DHTID`), so the run's
fixed names are hashed once here. Validation runs on our node's stores and on every record another
node returns to our reads: a node that serves one bad subkey of a dictionary loses the whole answer,
and the search moves on to other replicas.

Known limits: records under another run's names (or names outside the registry) are not checked by
our node; their own readers check them. A stranger can still store well-formed signed records under
its own subkey: readers decide whom to believe (owners for jobs, plan membership for metrics).
"""

from __future__ import annotations

import functools
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time

from ravnest_p2p.discovery.keys import MAX_CLOCK_SKEW_S, KeyRegistry, KeySpec, is_fresh
from ravnest_p2p.discovery.owners import OWNERS_KEY, parse_owners
from ravnest_p2p.discovery.records import owner_public_key, parse_peer_record
from ravnest_p2p.transport.identity import peer_id_from_public_key

__all__ = ["RunRecordValidator", "discovery_keys", "run_key"]

logger = logging.getLogger(__name__)

_PRIORITY = 5  # below RSASignatureValidator's 10: we see values after their signature is checked
MAX_DEPTH = 16  # no run value nests deeper; a deeper one is a recursion bomb for readers


def _shallow(value: Any, max_depth: int) -> bool:
    """Whether `value`'s maps and lists nest at most `max_depth` levels (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else ()
        for child in children:
            if isinstance(child, dict | list | tuple):
                if depth + 1 > max_depth:
                    return False
                stack.append((child, depth + 1))
    return True


def run_key(run_id: str, name: str) -> str:
    """The DHT key of a run's fixed name."""
    return f"ravnest/{run_id}/{name}"


def discovery_keys() -> KeyRegistry:
    """The default registry with the schemas this layer knows (peer records, the owners record)."""
    return (
        KeyRegistry()
        .with_schema("peers", lambda value, signer: parse_peer_record(value, signer_peer_id=signer))
        .with_schema(OWNERS_KEY, parse_owners)
    )


@functools.lru_cache(maxsize=4096)
def _signer_of(public_key: bytes) -> str | None:
    try:
        return peer_id_from_public_key(public_key)
    except ValueError:
        return None


class RunRecordValidator(RecordValidatorBase):
    """Checks every record under one run's fixed key names; counts refusals by reason in `refused`."""

    def __init__(
        self,
        run_id: str,
        keys: KeyRegistry,
        *,
        run_owner: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.run_id = run_id
        self.keys = keys
        self.run_owner = run_owner
        self._clock = clock or (lambda: float(get_dht_time()))
        self._by_key_id = {
            DHTID.generate(source=run_key(run_id, name)).to_bytes(): spec for name, spec in keys.items()
        }
        self.refused: Counter[str] = Counter()

    @property
    def priority(self) -> int:
        return _PRIORITY

    def validate(self, record: DHTRecord) -> bool:
        spec = self._by_key_id.get(record.key)
        if spec is None:
            return True
        reason = self.check(spec, record)
        if reason is None:
            return True
        self.refused[reason] += 1
        logger.debug("refused a record under %s/%s: %s", self.run_id, spec.name, reason)
        return False

    def check(self, spec: KeySpec, record: DHTRecord) -> str | None:
        """Why `record` (its value stripped of the signature) is refused under `spec`, or None."""
        signer = self._signer(record.subkey)
        if signer is None:
            return "unsigned"
        if spec.owner_only and self.run_owner is not None and signer != self.run_owner:
            return "not the owner"
        now = self._clock()
        expiry = record.expiration_time
        if not math.isfinite(expiry) or expiry > now + spec.max_ttl_s + MAX_CLOCK_SKEW_S:
            return "expiry beyond the key's TTL"
        if len(record.value) > spec.max_value_bytes:
            return "oversized"
        try:
            value: Any = MSGPackSerializer.loads(record.value)
        except Exception:
            return "undecodable"
        if not isinstance(value, dict):
            return "not a map"
        if not _shallow(value, MAX_DEPTH):
            return "nested too deep"
        version = value.get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int):
            return "no schema version"
        if not is_fresh(value, spec.max_ttl_s, now):
            return "updated_at in the future or past the TTL"
        updated_at = value.get("updated_at")
        if updated_at is not None and expiry > updated_at + spec.max_ttl_s + MAX_CLOCK_SKEW_S:
            return "expiry beyond the TTL after updated_at"
        if spec.schema is not None:
            try:
                spec.schema(value, signer)
            except Exception as exc:
                logger.debug("schema of %s: %s", spec.name, exc)
                return "schema"
        return None

    @staticmethod
    def _signer(subkey_bytes: bytes) -> str | None:
        """The peer id of the key embedded in a serialized subkey; None for plain values and bad keys."""
        if not subkey_bytes:  # hivemind's tag for a whole dictionary; its items are validated one by one
            return None
        try:
            subkey = MSGPackSerializer.loads(subkey_bytes)
        except Exception:
            return None
        public_key = owner_public_key(subkey)
        return _signer_of(public_key) if public_key is not None else None
