"""`RunDHT.get_signed` over a stub node: readers drop stale and future records, and plain maps."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import ValueWithExpiration

from ravnest_p2p.discovery import MAX_CLOCK_SKEW_S, RunDHT, dht_time
from ravnest_p2p.transport import load_or_create_identity


class StubNode:
    def __init__(self, value):
        self.value = value

    async def get(self, key, latest=False):
        return self.value


def subkey_of(identity) -> bytes:
    return RSASignatureValidator(identity.private_key).local_public_key


async def test_stale_and_future_records_are_dropped_by_readers():
    ids = [load_or_create_identity(None) for _ in range(4)]
    now = dht_time()
    values = {
        ids[0]: {"schema_version": 1, "updated_at": now},
        ids[1]: {"schema_version": 1, "updated_at": now + MAX_CLOCK_SKEW_S + 60},  # from the future
        ids[2]: {"schema_version": 1, "updated_at": now - 600 - MAX_CLOCK_SKEW_S - 60},  # past the TTL
        ids[3]: {"schema_version": 1},  # no updated_at: its expiry is capped instead
    }
    found = {subkey_of(i): ValueWithExpiration(v, now + 30) for i, v in values.items()}
    found[b"unsigned"] = ValueWithExpiration({"schema_version": 1}, now + 30)
    dht = RunDHT(
        StubNode(ValueWithExpiration(found, now + 30)), RSASignatureValidator(ids[0].private_key), "r"
    )
    assert set(await dht.get_signed("peers")) == {ids[0].peer_id, ids[3].peer_id}
    # names outside the registry are not checked for freshness
    assert len(await dht.get_signed("pinned/1")) == 4


async def test_a_plain_map_is_not_mistaken_for_a_dictionary_of_subkeys():
    identity = load_or_create_identity(None)
    plain = ValueWithExpiration({"schema_version": 1, "peer_id": "x"}, dht_time() + 1e9)
    dht = RunDHT(StubNode(plain), RSASignatureValidator(identity.private_key), "r")
    assert await dht.get_signed("peers") == {}


def test_ttl_caps_are_known_per_name():
    identity = load_or_create_identity(None)
    dht = RunDHT(StubNode(None), RSASignatureValidator(identity.private_key), "r")
    assert dht.max_ttl_s("peers") == 600
    assert dht.max_ttl_s("job") == 86400
    assert dht.max_ttl_s("pinned/1") is None
