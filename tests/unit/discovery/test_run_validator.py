"""The run's record validator in hivemind's chain, fed records built exactly as hivemind builds them."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer

from ravnest_p2p.discovery import (
    MAX_CLOCK_SKEW_S,
    KeyRegistry,
    RunRecordValidator,
    discovery_keys,
    is_fresh,
    run_key,
)
from ravnest_p2p.training.run_keys import run_keys
from ravnest_p2p.transport import load_or_create_identity

NOW = 1_000_000.0
RUN = "r1"


@pytest.fixture(scope="module")
def ids():
    return [load_or_create_identity(None) for _ in range(3)]


def chain(identity, *, run_owner=None, keys: KeyRegistry | None = None):
    rsa = RSASignatureValidator(identity.private_key)
    run = RunRecordValidator(RUN, keys or run_keys(), run_owner=run_owner, clock=lambda: NOW)
    return rsa, run, CompositeValidator([rsa, run])


def record(identity, name, value, *, ttl_s=30.0, subkey=None, run_id=RUN, owner=None):
    """A signed record of `value` under `identity`'s subkey, as `DHTNode.store` makes it."""
    rsa, _, composite = chain(identity, run_owner=owner)
    sub = rsa.local_public_key if subkey is None else subkey
    rec = DHTRecord(
        DHTID.generate(source=run_key(run_id, name)).to_bytes(),
        MSGPackSerializer.dumps(sub),
        MSGPackSerializer.dumps(value),
        NOW + ttl_s,
    )
    return dataclasses.replace(rec, value=composite.sign_value(rec))


def peer_value(identity, **over):
    return {
        "schema_version": 1,
        "peer_id": identity.peer_id,
        "flops": 1e9,
        "free_memory_bytes": 2**30,
        "state": "ready",
        "updated_at": NOW,
    } | over


def test_a_signed_valid_record_passes(ids):
    _, run, composite = chain(ids[1])
    assert composite.validate(record(ids[0], "peers", peer_value(ids[0])))
    assert not run.refused


def test_plain_and_unprotected_values_are_refused(ids):
    _, run, composite = chain(ids[1])
    key = DHTID.generate(source=run_key(RUN, "peers")).to_bytes()
    plain = DHTRecord(key, DHTProtocol.IS_REGULAR_VALUE, MSGPackSerializer.dumps({"x": 1}), NOW + 10)
    assert not composite.validate(plain)
    unprotected = DHTRecord(
        key, MSGPackSerializer.dumps(b"me"), MSGPackSerializer.dumps(peer_value(ids[0])), NOW
    )
    assert not composite.validate(unprotected)
    assert run.refused["unsigned"] == 2


@pytest.mark.parametrize(
    ("name", "value", "ttl_s", "reason"),
    [
        ("peers", [1, 2, 3], 30, "not a map"),
        ("peers", "a string", 30, "not a map"),
        ("job", {"job_id": "j"}, 30, "no schema version"),
        ("peers", {"schema_version": 1, "pad": "x" * 20_000}, 30, "oversized"),
        ("peers", "PEER", 1e9, "expiry beyond the key's TTL"),
        ("peers", "PEER", 600 + MAX_CLOCK_SKEW_S + 1, "expiry beyond the key's TTL"),
        ("peers", "PEER_FUTURE", 30, "updated_at in the future or past the TTL"),
        ("peers", "PEER_OLD", 30, "updated_at in the future or past the TTL"),
        ("peers", "PEER_OTHER", 30, "schema"),
        ("peers", "PEER_ABSURD", 30, "schema"),
        ("metrics", {"schema_version": 1, "job_id": "j", "updated_at": NOW}, 30, "schema"),
        ("plan", {"schema_version": 1, "epoch": 1, "digest": "zz", "updated_at": NOW}, 30, "schema"),
        ("job", {"schema_version": 1, "job_id": "bad id!"}, 30, "schema"),
        ("owners", {"schema_version": 1, "owner": "Qm" + "a" * 40, "updated_at": NOW}, 30, "schema"),
    ],
)
def test_bad_values_are_refused_with_a_reason(ids, name, value, ttl_s, reason):
    writer, other = ids[0], ids[1]
    if value == "PEER":
        value = peer_value(writer)
    elif value == "PEER_FUTURE":
        value = peer_value(writer, updated_at=NOW + 3600)
    elif value == "PEER_OLD":
        value = peer_value(writer, updated_at=NOW - 10_000)
    elif value == "PEER_OTHER":
        value = peer_value(other)  # a record about someone else, under the writer's subkey
    elif value == "PEER_ABSURD":
        value = peer_value(writer, flops=1e18)
    _, run, composite = chain(ids[2])
    assert not composite.validate(record(writer, name, value, ttl_s=ttl_s))
    assert run.refused == {reason: 1}


def test_expiry_may_not_run_past_updated_at_plus_the_ttl(ids):
    _, run, composite = chain(ids[1])
    # updated 500 s ago with a TTL of 599 s from now: 1099 s after it was written, the cap is 600
    rec = record(ids[0], "peers", peer_value(ids[0], updated_at=NOW - 500), ttl_s=599)
    assert not composite.validate(rec)
    assert run.refused == {"expiry beyond the TTL after updated_at": 1}


def test_a_tampered_value_fails_the_signature(ids):
    _, _run, composite = chain(ids[1])
    rec = record(ids[0], "peers", peer_value(ids[0]))
    forged = dataclasses.replace(rec, value=rec.value.replace(b"ready", b"drain"))
    assert not composite.validate(forged)


def test_owners_is_writable_by_the_run_owner_only(ids):
    owner, stranger = ids[0], ids[1]
    _, run, composite = chain(ids[2], run_owner=owner.peer_id)
    good = {"schema_version": 1, "owner": owner.peer_id, "keys": [stranger.peer_id], "updated_at": NOW}
    assert composite.validate(record(owner, "owners", good))
    bad = good | {"owner": stranger.peer_id}
    assert not composite.validate(record(stranger, "owners", bad))
    assert run.refused == {"not the owner": 1}
    # an open run's validator lets anyone write it (readers ignore it: no owner, no delegates)
    _, _, open_chain = chain(ids[2])
    assert open_chain.validate(record(stranger, "owners", bad))


def test_keys_outside_the_registry_or_run_pass_untouched(ids):
    _, run, composite = chain(ids[1])
    assert composite.validate(record(ids[0], "pinned/1", [1, 2]))
    assert composite.validate(record(ids[0], "peers", [1, 2], run_id="another-run"))
    assert not run.refused


def test_discovery_keys_alone_check_shape_but_not_upper_schemas(ids):
    _, _run, composite = chain(ids[1], keys=discovery_keys())
    assert composite.validate(record(ids[0], "job", {"schema_version": 1, "job_id": "bad id!"}))
    assert not composite.validate(record(ids[0], "job", {"schema_version": 1}, ttl_s=1e6))


@pytest.mark.parametrize(
    ("value", "fresh"),
    [
        ({"updated_at": NOW}, True),
        ({"updated_at": NOW + MAX_CLOCK_SKEW_S + 1}, False),
        ({"updated_at": NOW - 100 - MAX_CLOCK_SKEW_S - 1}, False),
        ({"updated_at": float("nan")}, False),
        ({"updated_at": "soon"}, False),
        ({"updated_at": True}, False),
        ({"other": 1}, True),
        ([1], True),
    ],
)
def test_is_fresh(value, fresh):
    assert is_fresh(value, 100.0, NOW) is fresh


def test_registry_is_immutable_and_names_are_fixed():
    keys = discovery_keys()
    assert {"peers", "job", "owners", "plan", "metrics", "progress", "checkpoints", "suspects"} <= set(keys)
    with pytest.raises(KeyError):
        keys.with_schema("nope", lambda v, s: v)
    assert keys["job"].schema is None
    assert run_keys()["job"].schema is not None
