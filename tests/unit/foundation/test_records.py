import math

import pytest

from ravnest_p2p.discovery.records import (
    MAX_FLOPS,
    SCHEMA_VERSION,
    PeerRecord,
    owner_public_key,
    parse_peer_record,
)
from ravnest_p2p.errors import InvalidRecord

PEER = "QmVRjtfVd4D7oN4Ca6PPG8GoxuGoYwp47sEk9yYknEHqAj"


def good(**overrides):
    value = {
        "schema_version": SCHEMA_VERSION,
        "peer_id": PEER,
        "maddrs": [f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}"],
        "flops": 1e11,
        "free_memory_bytes": 8 * 2**30,
        "upload_mbps": 100.0,
        "download_mbps": 200.0,
        "rtt_ms": 3.5,
        "state": "ready",
        "updated_at": 1.7e9,
    }
    value.update(overrides)
    return value


def test_valid_record_parses_and_round_trips():
    record = parse_peer_record(good(), signer_peer_id=PEER)
    assert record.flops == 1e11
    assert PeerRecord.model_validate(record.model_dump(mode="json")) == record


def test_unknown_fields_from_the_wire_are_ignored():
    record = parse_peer_record(good(some_future_field=[1, 2, 3]), signer_peer_id=PEER)
    assert not hasattr(record, "some_future_field")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("flops", math.nan),
        ("flops", math.inf),
        ("flops", 1e18),
        ("flops", -1.0),
        ("free_memory_bytes", -5),
        ("upload_mbps", math.nan),
        ("download_mbps", 1e12),
        ("rtt_ms", -0.1),
        ("state", "dancing"),
        ("maddrs", ["x"] * 100),
        ("peer_id", "not base58 0OIl!"),
        ("updated_at", math.inf),
    ],
)
def test_out_of_range_values_are_rejected(field, value):
    with pytest.raises(InvalidRecord):
        parse_peer_record(good(**{field: value}), signer_peer_id=PEER)


def test_absurd_compute_claim_is_just_over_the_cap():
    parse_peer_record(good(flops=MAX_FLOPS), signer_peer_id=PEER)
    with pytest.raises(InvalidRecord, match="flops"):
        parse_peer_record(good(flops=MAX_FLOPS * 1.01), signer_peer_id=PEER)


@pytest.mark.parametrize("version", [0, 2, 99, "1", None])
def test_foreign_schema_versions_are_rejected(version):
    with pytest.raises(InvalidRecord, match="schema version"):
        parse_peer_record(good(schema_version=version), signer_peer_id=PEER)


def test_record_must_be_signed_by_the_peer_it_claims():
    with pytest.raises(InvalidRecord, match="signed by"):
        parse_peer_record(good(), signer_peer_id="QmSomeoneElse1111111111111111111111111111111")
    with pytest.raises(InvalidRecord, match="not signed"):
        parse_peer_record(good(), signer_peer_id=None)


@pytest.mark.parametrize("value", [None, 42, "text", [1, 2], b"bytes"])
def test_non_map_values_are_rejected(value):
    with pytest.raises(InvalidRecord):
        parse_peer_record(value, signer_peer_id=PEER)


def test_owner_public_key_extraction():
    assert owner_public_key(b"[owner:ssh-rsa AAAA]") == b"ssh-rsa AAAA"
    assert owner_public_key(b"plain") is None
    assert owner_public_key("not bytes") is None
