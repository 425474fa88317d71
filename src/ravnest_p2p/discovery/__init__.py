"""Finding peers: run-scoped DHT, signed peer records, the announcer and the live directory."""

from ravnest_p2p.discovery.announcer import PEERS_KEY, Announcer
from ravnest_p2p.discovery.dht import RunDHT, dht_time
from ravnest_p2p.discovery.directory import PeerDirectory
from ravnest_p2p.discovery.records import SCHEMA_VERSION, PeerRecord, parse_peer_record

__all__ = [
    "PEERS_KEY",
    "SCHEMA_VERSION",
    "Announcer",
    "PeerDirectory",
    "PeerRecord",
    "RunDHT",
    "dht_time",
    "parse_peer_record",
]
