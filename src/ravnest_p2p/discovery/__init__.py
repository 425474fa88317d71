"""Finding peers: run-scoped DHT, signed peer records, the announcer and the live directory."""

from ravnest_p2p.discovery.announcer import PEERS_KEY, Announcer
from ravnest_p2p.discovery.dht import RunDHT, dht_time
from ravnest_p2p.discovery.directory import PeerDirectory
from ravnest_p2p.discovery.keys import DEFAULT_KEYS, MAX_CLOCK_SKEW_S, KeyRegistry, KeySpec, is_fresh
from ravnest_p2p.discovery.owners import OWNERS_KEY, OwnersRecord, authorized_signers, parse_owners
from ravnest_p2p.discovery.records import MAX_LINKS, SCHEMA_VERSION, LinkRecord, PeerRecord, parse_peer_record
from ravnest_p2p.discovery.validator import RunRecordValidator, discovery_keys, run_key

__all__ = [
    "DEFAULT_KEYS",
    "MAX_CLOCK_SKEW_S",
    "MAX_LINKS",
    "OWNERS_KEY",
    "PEERS_KEY",
    "SCHEMA_VERSION",
    "Announcer",
    "KeyRegistry",
    "KeySpec",
    "LinkRecord",
    "OwnersRecord",
    "PeerDirectory",
    "PeerRecord",
    "RunDHT",
    "RunRecordValidator",
    "authorized_signers",
    "dht_time",
    "discovery_keys",
    "is_fresh",
    "parse_owners",
    "parse_peer_record",
    "run_key",
]
