"""A sweep of forged and malformed values across every run key name, sent raw to real peers.

Each variant goes as its own store request to each honest peer (a stock hivemind `DHTNode` with the
attacker's own key: it signs what it is told to and checks nothing). Every one must be refused, the
peers must keep working (announce, answer reads), and no reader may see anything the attacker sent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import MSGPackSerializer

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import dht_time, discovery_keys
from ravnest_p2p.membership import DhtPlanBoard
from ravnest_p2p.training.runner import read_job
from tests.security._dht_attack import NAMES, Attacker, announces, attacker, peer_value, swarm


def variants(evil: Attacker, name: str, victim_id: str) -> list[tuple[str, bytes, float, Any]]:
    """(label, value bytes, expiry, subkey) of every forged or malformed value of `name`."""
    now = dht_time()
    spec = discovery_keys()[name]
    ok_ttl = now + min(60.0, spec.max_ttl_s / 2)
    far = now + 1e9

    def signed(value: Any, expiry: float = ok_ttl) -> tuple[bytes, float, Any]:
        return evil.signed(name, value, expiry), expiry, evil.subkey

    def plain(value: Any, expiry: float = far) -> tuple[bytes, float, Any]:
        return MSGPackSerializer.dumps(value), expiry, None

    unsigned_dict = DictionaryDHTValue()
    unsigned_dict.store(b"x", MSGPackSerializer.dumps({"schema_version": 1}), ok_ttl)
    base = {"schema_version": 1, "updated_at": now}
    tampered = bytearray(evil.signed(name, base | {"pad": "a" * 40}, ok_ttl))
    tampered[5] ^= 0xFF
    cases: dict[str, tuple[bytes, float, Any]] = {
        "plain map, far expiry": plain(base),
        "plain map, near expiry": plain(base, ok_ttl),
        "plain string": plain("hello"),
        "plain peer record of the victim": plain(peer_value(victim_id)),
        "unprotected subkey": (MSGPackSerializer.dumps(base), ok_ttl, b"not-an-owner-key"),
        "string subkey with a key pattern": (MSGPackSerializer.dumps(base), ok_ttl, "[owner:ssh-rsa AAAA]"),
        "signed list": signed([1, 2, 3]),
        "signed string": signed("x"),
        "signed int": signed(7),
        "signed nil": signed(None),
        "signed bytes": signed(b"\x00" * 10),
        "map without schema_version": signed({"updated_at": now}),
        "schema_version a string": signed({"schema_version": "1", "updated_at": now}),
        "schema_version a bool": signed({"schema_version": True, "updated_at": now}),
        "oversized": signed(base | {"pad": "x" * (spec.max_value_bytes + 1)}),
        "expiry 10^9 s ahead": signed(base, far),
        "expiry just past the TTL": signed(base, now + spec.max_ttl_s + 120),
        "updated_at in the future": signed(base | {"updated_at": now + 3600}),
        "updated_at ancient": signed(base | {"updated_at": now - spec.max_ttl_s - 3600}),
        "updated_at NaN": signed(base | {"updated_at": float("nan")}),
        "updated_at a string": signed(base | {"updated_at": "now"}),
        "tampered signature": (bytes(tampered), ok_ttl, evil.subkey),
        "not msgpack": (b"\xc1\xc1\xc1" + evil.signed(name, base, ok_ttl)[-300:], ok_ttl, evil.subkey),
        "dictionary of unsigned entries": (unsigned_dict, ok_ttl, None),  # type: ignore[dict-item]
        "nested deep map": signed(base | {"x": _deep(200)}),
    }
    if name in ("peers", "job", "owners", "plan", "metrics"):  # names with a registered schema
        cases["schema garbage"] = signed(base | {"epoch": -1, "digest": 5, "job_id": "!", "peer_id": 3})
        cases["the victim's identity"] = signed(
            peer_value(victim_id) | {"owner": victim_id, "job_id": "j", "cluster": 0, "stage": 0}
        )
    return [(label, *case) for label, case in cases.items()]


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"x": value}
    return value


async def test_every_forged_or_malformed_value_under_every_run_key_is_refused(hostile):
    hostile.surface = "dht:sweep"
    run_id = "sweep"
    async with swarm(2, run_id, job_poll_s=3600.0) as peers, attacker(peers[0].maddrs, run_id) as evil:
        accepted: list[str] = []
        for name in NAMES:
            for peer in peers:
                for label, value, expiry, subkey in variants(evil, name, peers[1].peer_id):
                    hostile.sent += 1
                    try:
                        stored = await evil.send(peer.peer_id, name, value, expiry, subkey=subkey)
                    except Exception:  # the request itself could not be made: not a message sent
                        hostile.sent -= 1
                        continue
                    if stored:
                        accepted.append(f"{name}: {label}")
                    else:
                        hostile.refused += 1
        hostile.forged_accepted += len(accepted)
        # the peers still work, and readers see only the peers' own records
        for peer in peers:
            hostile.crashes += not await announces(peer)
        async with await RunClient.connect(peers[0].maddrs, run_id) as client:
            honest = {p.peer_id for p in peers}
            records = await client.peers()
            hostile.forged_accepted += sum(r.peer_id not in honest for r in records)
            # every honest record stays readable (re-read under a deadline: on a busy host one read
            # can miss a replica; a record that stays missing fails the test)
            deadline = time.monotonic() + 60
            while {r.peer_id for r in records} != honest and time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                records = await client.peers()
                hostile.forged_accepted += sum(r.peer_id not in honest for r in records)
            assert {r.peer_id for r in records} == honest, records
            hostile.forged_accepted += len(await client.metrics())
        hostile.forged_accepted += (await read_job(peers[1].dht)) is not None
        # the peers' own membership publishes their plan records once they agree (within the test on a
        # busy host): only a record signed by anyone else is forged
        boards = await DhtPlanBoard(peers[1].dht).read_all()
        hostile.forged_accepted += sum(signer not in honest for signer in boards)
        for peer in peers:
            storage = peer.dht.node.protocol.storage
            for name in NAMES:
                stored = storage.get(evil.key_id(name))
                if stored is None:
                    continue
                if not isinstance(stored.value, DictionaryDHTValue):
                    hostile.state_changes += 1
                    continue
                hostile.state_changes += sum(1 for subkey, _ in stored.value.items() if subkey == evil.subkey)
    assert accepted == []
    assert hostile.sent >= 400
    assert hostile.refused == hostile.sent
    assert hostile.forged_accepted == hostile.crashes == hostile.state_changes == 0
