"""Our adapter over hivemind's in-loop `DHTNode`: run-scoped keys, owner-signed subkeys, typed errors.

Every peer signs with its identity key (`RSASignatureValidator(identity.private_key)`): hivemind's
default is one process-wide key, which would make all peers in one test process the same owner.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2PDaemonError
from hivemind.utils import get_dht_time

from ravnest_p2p.discovery.records import owner_public_key
from ravnest_p2p.errors import DiscoveryError
from ravnest_p2p.transport.identity import load_or_create_identity, peer_id_from_public_key
from ravnest_p2p.transport.p2p import HostConfig, P2PTransport

__all__ = ["RunDHT", "dht_time"]

logger = logging.getLogger(__name__)


def dht_time() -> float:
    """The DHT's clock (wall time; records expire by it)."""
    return float(get_dht_time())


class RunDHT:
    """The DHT as seen by one run: keys are ``ravnest/<run_id>/<name>``; our subkey is our public key."""

    def __init__(self, node: DHTNode, validator: RSASignatureValidator, run_id: str) -> None:
        self._node = node
        self._validator = validator
        self.run_id = run_id
        self._owned_transport: P2PTransport | None = None

    @classmethod
    async def join_as_client(
        cls, initial_peers: Sequence[str], *, run_id: str, timeout_s: float = 20.0
    ) -> RunDHT:
        """Join the run as a DHT client with a fresh identity; `aclose` also stops its p2p daemon."""
        transport = await P2PTransport.create(
            HostConfig(initial_peers=tuple(initial_peers), client_mode=True, startup_timeout_s=timeout_s),
            load_or_create_identity(None),
        )
        try:
            dht = await cls.create(transport, run_id=run_id, initial_peers=initial_peers, client_mode=True)
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
    ) -> RunDHT:
        validator = RSASignatureValidator(transport.identity.private_key)
        try:
            node = await DHTNode.create(
                p2p=transport.p2p,
                initial_peers=list(initial_peers) or None,
                record_validator=validator,
                client_mode=client_mode,
                bootstrap_timeout=bootstrap_timeout_s,
                ensure_bootstrap_success=bool(initial_peers),
                cache_locally=False,  # a stale local cache would hide records that others have withdrawn
                cache_nearest=0,
            )
        except (P2PDaemonError, RuntimeError, TimeoutError) as exc:
            raise DiscoveryError(f"cannot join the DHT through {list(initial_peers)}: {exc}") from None
        return cls(node, validator, run_id)

    @property
    def own_subkey(self) -> bytes:
        key: bytes = self._validator.local_public_key
        return key

    def key(self, name: str) -> str:
        return f"ravnest/{self.run_id}/{name}"

    async def store_own(self, name: str, value: Any, *, ttl_s: float) -> bool:
        """Store `value` under our own signed subkey of `name`; True if at least one replica took it."""
        ok = await self._node.store(self.key(name), value, dht_time() + ttl_s, subkey=self.own_subkey)
        return bool(ok)

    async def get_signed(self, name: str) -> dict[str, tuple[Any, float]]:
        """Live subkey values of `name` that name an owner key, as {signer peer id: (value, expiry)}.

        hivemind's validator already dropped records whose signature does not match their subkey's key.
        """
        found = await self._node.get(self.key(name), latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out: dict[str, tuple[Any, float]] = {}
        for subkey, item in found.value.items():
            public_key = owner_public_key(subkey)
            if public_key is None:
                continue
            try:
                signer = peer_id_from_public_key(public_key)
            except ValueError:
                continue
            out[signer] = (item.value, float(item.expiration_time))
        return out

    @property
    def node(self) -> DHTNode:
        return self._node

    async def aclose(self) -> None:
        await self._node.shutdown()
        if self._owned_transport is not None:
            await self._owned_transport.aclose()
