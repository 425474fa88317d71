"""Our adapter over hivemind's in-loop `DHTNode`: run-scoped keys, owner-signed subkeys, typed errors.

Every peer signs with its identity key (`RSASignatureValidator(identity.private_key)`): hivemind's
default is one process-wide key, which would make all peers in one test process the same owner.

Reachability: hivemind's DHT messages name nodes by peer id only, and the p2p daemon cannot route to a
peer it has never been connected to ("routing: not found"; its own peer routing found nobody in the lab,
not even with the bootstrap in DHT-server mode). A node that others dial learns their addresses from
those connections, but a DHT *client* (the status tool, a researcher's notebook) is dialled by nobody:
it reaches its initial peers and no one else, and it read nothing whenever the initial peers were not
among the replicas of a key (seen: `status` finding 0 of 8 lab peers for minutes). Two things fix it:
a record stored with ``pin_to_initial_peers`` also goes straight to our initial peers (the bootstrap
every client starts from holds every peer record), and a client dials the peers those records name
(`PeerDirectory(dial_new_peers=True)`), after which the whole DHT is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import P2PDaemonError, PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from ravnest_p2p.discovery.keys import KeyRegistry, is_fresh
from ravnest_p2p.discovery.records import owner_public_key
from ravnest_p2p.discovery.validator import RunRecordValidator, discovery_keys, run_key
from ravnest_p2p.errors import DiscoveryError
from ravnest_p2p.transport.identity import load_or_create_identity, peer_id_from_public_key
from ravnest_p2p.transport.p2p import HostConfig, P2PTransport

__all__ = ["RunDHT", "dht_time"]

logger = logging.getLogger(__name__)

_FIND_AT_TIMEOUT_S = 5.0  # a direct read at one initial peer
# Joining: hivemind pings the initial peers once, each under its 3 s RPC deadline. On a busy host (or a
# slow link) every first ping can miss that deadline while the peers are up: the join then pings them
# again, backing off, for this long before it gives up.
_BOOTSTRAP_PATIENCE_S = 60.0


async def _bootstrapped(node: DHTNode, initial_ids: Sequence[str], *, patience_s: float) -> bool:
    """Whether `node` reached one of `initial_ids` (already, or by pinging them again within `patience_s`);
    after a late answer its routing table is filled by a lookup of its own id, as hivemind's join does."""
    routing = node.protocol.routing_table
    if routing.uid_to_peer_id:
        return True
    peers = [PeerID.from_base58(i) for i in initial_ids]
    deadline, pause = time.monotonic() + patience_s, 1.0
    while time.monotonic() < deadline:
        logger.info("no initial peer answered yet; pinging %d of them again", len(peers))
        answers = await asyncio.gather(
            *(node.protocol.call_ping(peer, validate=True, strict=False) for peer in peers),
            return_exceptions=True,
        )
        if any(a is not None and not isinstance(a, BaseException) for a in answers) or routing.uid_to_peer_id:
            with contextlib.suppress(Exception):
                await node.find_nearest_nodes([node.node_id])
            return True
        await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, 8.0)
    return False


def _peer_id_of(maddr: str) -> str | None:
    """The ``/p2p/<id>`` part of a multiaddr, if any."""
    parts = maddr.rstrip("/").split("/")
    return parts[parts.index("p2p") + 1] if "p2p" in parts[:-1] else None


def dht_time() -> float:
    """The DHT's clock (wall time; records expire by it)."""
    return float(get_dht_time())


class RunDHT:
    """The DHT as seen by one run: keys are ``ravnest/<run_id>/<name>``; our subkey is our public key.

    Records under the run's fixed names (`keys`) pass a `RunRecordValidator` on every store and read;
    `run_owner` (a peer id) is the run's owner, None for an open run.
    """

    def __init__(
        self,
        node: DHTNode,
        validator: RSASignatureValidator,
        run_id: str,
        *,
        transport: P2PTransport | None = None,
        initial_peer_ids: Sequence[str] = (),
        run_validator: RunRecordValidator | None = None,
    ) -> None:
        self._node = node
        self._validator = validator
        self.run_validator = run_validator or RunRecordValidator(run_id, discovery_keys())
        self._chain = CompositeValidator([validator, self.run_validator])
        self.run_id = run_id
        self.transport = transport
        self.initial_peer_ids = tuple(initial_peer_ids)
        self._owned_transport: P2PTransport | None = None

    @classmethod
    async def join_as_client(
        cls,
        initial_peers: Sequence[str],
        *,
        run_id: str,
        timeout_s: float = 20.0,
        identity_path: str | Path | None = None,
        keys: KeyRegistry | None = None,
        run_owner: str | None = None,
    ) -> RunDHT:
        """Join the run as a DHT client; `aclose` also stops its p2p daemon.

        With `identity_path` the client keeps one identity (peer id, signing key) across sessions, so
        a researcher stays the owner of the runs it started; without, it gets a fresh one.
        """
        transport = await P2PTransport.create(
            HostConfig(initial_peers=tuple(initial_peers), client_mode=True, startup_timeout_s=timeout_s),
            load_or_create_identity(Path(identity_path) if identity_path is not None else None),
        )
        try:
            dht = await cls.create(
                transport,
                run_id=run_id,
                initial_peers=initial_peers,
                client_mode=True,
                keys=keys,
                run_owner=run_owner,
            )
        except BaseException:
            await transport.aclose()
            raise
        dht._owned_transport = transport
        return dht

    @classmethod
    async def create(
        cls,
        transport: P2PTransport,
        *,
        run_id: str,
        initial_peers: Sequence[str] = (),
        client_mode: bool = False,
        bootstrap_timeout_s: float = 15.0,
        keys: KeyRegistry | None = None,
        run_owner: str | None = None,
    ) -> RunDHT:
        """Join the DHT over `transport`; `keys` (default: `discovery_keys()`) are the run's checked names."""
        validator = RSASignatureValidator(transport.identity.private_key)
        run_validator = RunRecordValidator(run_id, keys or discovery_keys(), run_owner=run_owner)
        try:
            node = await DHTNode.create(
                p2p=transport.p2p,
                initial_peers=list(initial_peers) or None,
                record_validator=CompositeValidator([validator, run_validator]),
                client_mode=client_mode,
                bootstrap_timeout=bootstrap_timeout_s,
                ensure_bootstrap_success=False,  # checked below, with retries
                cache_locally=False,  # a stale local cache would hide records that others have withdrawn
                cache_nearest=0,
            )
        except (P2PDaemonError, RuntimeError, TimeoutError) as exc:
            raise DiscoveryError(f"cannot join the DHT through {list(initial_peers)}: {exc}") from None
        own = transport.peer_id
        initial_ids = [i for i in dict.fromkeys(_peer_id_of(m) for m in initial_peers) if i and i != own]
        if initial_ids and not await _bootstrapped(node, initial_ids, patience_s=_BOOTSTRAP_PATIENCE_S):
            with contextlib.suppress(Exception):
                await node.shutdown()
            raise DiscoveryError(
                f"cannot join the DHT through {list(initial_peers)}: none of them answered a ping "
                f"within {_BOOTSTRAP_PATIENCE_S:.0f}s"
            )
        return cls(
            node,
            validator,
            run_id,
            transport=transport,
            initial_peer_ids=initial_ids,
            run_validator=run_validator,
        )

    @property
    def keys(self) -> KeyRegistry:
        return self.run_validator.keys

    @property
    def run_owner(self) -> str | None:
        return self.run_validator.run_owner

    @property
    def peer_id(self) -> str | None:
        """Our own peer id (the signer of our subkey), if we have a transport."""
        return self.transport.peer_id if self.transport is not None else None

    @property
    def own_subkey(self) -> bytes:
        key: bytes = self._validator.local_public_key
        return key

    def key(self, name: str) -> str:
        return run_key(self.run_id, name)

    def max_ttl_s(self, name: str) -> float | None:
        """The longest TTL a value of `name` may have (None: a name outside the registry)."""
        spec = self.keys.get(name)
        return spec.max_ttl_s if spec is not None else None

    async def store_own(
        self, name: str, value: Any, *, ttl_s: float, pin_to_initial_peers: bool = False
    ) -> bool:
        """Store `value` under our own signed subkey of `name`; True if at least one replica took it.

        With `pin_to_initial_peers` the initial peers also get a copy, whether or not they are among the
        key's nearest nodes (see the module docstring). A TTL beyond the key's maximum is cut to it
        (validators would refuse it).
        """
        max_ttl_s = self.max_ttl_s(name)
        if max_ttl_s is not None and ttl_s > max_ttl_s:
            logger.debug("TTL of %s cut from %.0f s to %.0f s", name, ttl_s, max_ttl_s)
            ttl_s = max_ttl_s
        expiration = dht_time() + ttl_s
        ok = bool(await self._node.store(self.key(name), value, expiration, subkey=self.own_subkey))
        if not ok:
            # hivemind reports the status of whichever replica answered last: one replica that refuses
            # (e.g. a hostile node holding a plain value under the key) failed the whole store. Ask each
            # replica again, with an expiry a hair later: a replica keeps a subkey only if it is newer
            ok = await self._store_at_nearest(name, value, expiration + 1e-3)
        if pin_to_initial_peers and self.initial_peer_ids:
            pinned = await asyncio.gather(
                *(self._store_at(peer_id, name, value, expiration) for peer_id in self.initial_peer_ids)
            )
            ok = ok or any(pinned)
        return ok

    def _signed_record(self, name: str, value: Any, expiration: float) -> DHTRecord:
        protocol = self._node.protocol
        record = DHTRecord(
            DHTID.generate(source=self.key(name)).to_bytes(),
            protocol.serializer.dumps(self.own_subkey),
            protocol.serializer.dumps(value),
            expiration,
        )
        return DHTRecord(record.key, record.subkey, self._chain.sign_value(record), expiration)

    async def _store_at(self, peer_id: str | PeerID, name: str, value: Any, expiration: float) -> bool:
        """Store one signed subkey value at one given node (as `DHTNode.store` does at each replica)."""
        protocol = self._node.protocol
        key_id = DHTID.generate(source=self.key(name))
        signed = self._signed_record(name, value, expiration).value
        peer = PeerID.from_base58(peer_id) if isinstance(peer_id, str) else peer_id
        result = await protocol.call_store(peer, [key_id], [signed], expiration, subkeys=[self.own_subkey])
        return bool(result and result[0])

    async def _store_at_nearest(self, name: str, value: Any, expiration: float) -> bool:
        """Store at each of the key's nearest nodes (ourselves included); True if any of them took it."""
        key_id = DHTID.generate(source=self.key(name))
        nearest = await self._node.find_nearest_nodes([key_id], k_nearest=self._node.num_replicas)
        stored = []
        for node_id, peer in nearest.get(key_id, {}).items():
            if node_id == self._node.node_id:
                record = self._signed_record(name, value, expiration)
                if self._chain.validate(record):
                    storage = self._node.protocol.storage
                    stored.append(storage.store(key_id, record.value, expiration, subkey=self.own_subkey))
            else:
                stored.append(await self._store_at(peer, name, value, expiration))
        return any(stored)

    async def get_signed(
        self, name: str, *, from_initial_peers: bool = False
    ) -> dict[str, tuple[Any, float]]:
        """Live subkey values of `name` that name an owner key, as {signer peer id: (value, expiry)}.

        hivemind's validator already dropped records whose signature does not match their subkey's key.
        Values whose ``updated_at`` lies in the future or past the key's TTL are dropped (see
        `discovery.keys`). With `from_initial_peers`, the initial peers are also asked directly (where
        `store_own` pins values) and, per signer, the value that expires last wins: a client polling a
        key for minutes was seen reading a stale value through the DHT search while a fresh client read
        the new one.
        """
        found = await self._node.get(self.key(name), latest=True)
        items: dict[Any, tuple[Any, float]] = {}
        if found is not None and isinstance(found.value, dict):
            # a plain value that is itself a map (validators refuse those under run keys) is not a
            # dictionary of subkeys: its items are not `ValueWithExpiration`s
            items = {
                k: (v.value, float(v.expiration_time))
                for k, v in found.value.items()
                if isinstance(v, ValueWithExpiration)
            }
        if from_initial_peers and self.initial_peer_ids:
            pinned = await asyncio.gather(*(self._find_at(p, name) for p in self.initial_peer_ids))
            for direct in pinned:
                for subkey, (value, expiration) in direct.items():
                    if subkey not in items or expiration > items[subkey][1]:
                        items[subkey] = (value, expiration)
        out: dict[str, tuple[Any, float]] = {}
        now = dht_time()
        max_ttl_s = self.max_ttl_s(name)
        for subkey, (value, expiration) in items.items():
            public_key = owner_public_key(subkey)
            if public_key is None or expiration < now:
                continue
            if max_ttl_s is not None and not is_fresh(value, max_ttl_s, now):
                continue
            try:
                signer = peer_id_from_public_key(public_key)
            except ValueError:
                continue
            out[signer] = (value, expiration)
        return out

    async def _find_at(self, peer_id: str, name: str) -> dict[Any, tuple[Any, float]]:
        """The subkey values of `name` at one given node (signatures checked); {} if none or no answer."""
        protocol = self._node.protocol
        key_id = DHTID.generate(source=self.key(name))
        try:
            async with asyncio.timeout(_FIND_AT_TIMEOUT_S):
                response = await protocol.call_find(PeerID.from_base58(peer_id), [key_id])
        except (TimeoutError, P2PDaemonError, ValueError) as exc:
            logger.debug("direct read of %s at %s failed: %r", name, peer_id, exc)
            return {}
        if not response or key_id not in response:
            return {}
        found, _ = response[key_id]
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            return {}
        out: dict[Any, tuple[Any, float]] = {}
        serializer = protocol.serializer
        for subkey, (value_bytes, expiration) in found.value.items():
            record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), value_bytes, expiration)
            try:
                out[subkey] = (serializer.loads(self._chain.strip_value(record)), float(expiration))
            except Exception as exc:  # a malformed value from the network: skip it, keep the rest
                logger.debug("undecodable value of %s at %s: %r", name, peer_id, exc)
        return out

    @property
    def node(self) -> DHTNode:
        return self._node

    async def aclose(self) -> None:
        await self._node.shutdown()
        if self._owned_transport is not None:
            await self._owned_transport.aclose()
