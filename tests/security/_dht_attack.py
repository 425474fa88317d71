"""An attacker on the DHT: its own identity and a stock hivemind `DHTNode` (no run validator), which
stores whatever it likes in its own storage and sends raw store requests straight to chosen peers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from ravnest_p2p.discovery import dht_time, run_key
from ravnest_p2p.transport import HostConfig, P2PTransport, load_or_create_identity
from ravnest_p2p.utils import wait_until
from tests.integration.foundation.conftest import close_all, start_swarm

NAMES = ("peers", "job", "owners", "plan", "metrics", "progress", "checkpoints", "suspects")


class Attacker:
    def __init__(self, transport: P2PTransport, node: DHTNode, run_id: str) -> None:
        self.transport = transport
        self.node = node
        self.run_id = run_id
        self.rsa = RSASignatureValidator(transport.identity.private_key)

    @property
    def peer_id(self) -> str:
        return self.transport.peer_id

    @property
    def subkey(self) -> bytes:
        return self.rsa.local_public_key

    def key_id(self, name: str) -> DHTID:
        return DHTID.generate(source=run_key(self.run_id, name))

    def signed(self, name: str, value: Any, expiration: float) -> bytes:
        """`value` serialized and signed under our own subkey, as `DHTNode.store` would send it."""
        record = DHTRecord(
            self.key_id(name).to_bytes(),
            MSGPackSerializer.dumps(self.subkey),
            MSGPackSerializer.dumps(value),
            expiration,
        )
        return self.rsa.sign_value(record)

    async def send(
        self, peer_id: str, name: str, value_bytes: bytes, expiration: float, *, subkey: Any = None
    ) -> bool:
        """One raw store request to one peer; True if it stored the value."""
        result = await self.node.protocol.call_store(
            PeerID.from_base58(peer_id), [self.key_id(name)], [value_bytes], expiration, subkeys=[subkey]
        )
        return bool(result and result[0])

    async def send_plain(self, peer_id: str, name: str, value: Any, expiration: float) -> bool:
        return await self.send(peer_id, name, MSGPackSerializer.dumps(value), expiration)

    async def send_signed(self, peer_id: str, name: str, value: Any, expiration: float) -> bool:
        return await self.send(
            peer_id, name, self.signed(name, value, expiration), expiration, subkey=self.subkey
        )

    def store_locally(self, name: str, value: Any, expiration: float) -> None:
        """Poison our own storage (a replica readers may ask) with a plain value."""
        self.node.protocol.storage.store(self.key_id(name), MSGPackSerializer.dumps(value), expiration)


@contextlib.asynccontextmanager
async def attacker(initial_peers: Sequence[str], run_id: str) -> AsyncIterator[Attacker]:
    identity = load_or_create_identity(None)
    transport = await P2PTransport.create(HostConfig(initial_peers=tuple(initial_peers)), identity)
    try:
        node = await DHTNode.create(
            p2p=transport.p2p,
            initial_peers=list(initial_peers),
            record_validator=RSASignatureValidator(identity.private_key),
        )
        try:
            yield Attacker(transport, node, run_id)
        finally:
            await node.shutdown()
    finally:
        await transport.aclose()


@contextlib.asynccontextmanager
async def swarm(n: int, run_id: str, **overrides: Any) -> AsyncIterator[list]:
    peers = await start_swarm(n, run_id, **overrides)
    try:
        yield peers
    finally:
        await close_all(peers)


async def announces(peer: Any, timeout_s: float = 30.0) -> bool:
    """Whether ``peer`` can still announce its record, retried under a (load-stretched) deadline.

    One announce can miss every replica's RPC deadline on a busy host (seen: one refusal in a full
    suite run beside other work); a forged value that displaced the signed records refuses every
    announce, so it still fails."""
    try:
        await wait_until(peer.announcer.publish_once, timeout_s, interval_s=1.0, message="an announce")
    except TimeoutError:
        return False
    return True


def peer_value(peer_id: str, **over: Any) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "peer_id": peer_id,
        "flops": 1e9,
        "free_memory_bytes": 2**30,
        "upload_mbps": 10.0,
        "download_mbps": 10.0,
        "state": "ready",
        "updated_at": dht_time(),
    } | over
