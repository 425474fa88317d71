"""Discovery over real daemons: everyone finds everyone, forgeries are refused, the dead disappear."""

from __future__ import annotations

import pytest
from hivemind.dht import DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import OWNERS_KEY, PEERS_KEY, PeerDirectory, dht_time
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.jobs import JOB_KEY
from ravnest_p2p.transport import HostConfig, P2PTransport, load_or_create_identity
from ravnest_p2p.types import PeerState
from ravnest_p2p.utils import wait_until

pytestmark = pytest.mark.timeout(240)


async def test_eight_peers_each_see_seven_valid_records(make_swarm):
    peers = await make_swarm(8, run_id="eight")
    ids = {p.peer_id for p in peers}
    assert len(ids) == 8

    def everyone_sees_everyone() -> bool:
        return all(set(p.directory.active(exclude=p.peer_id)) == ids - {p.peer_id} for p in peers)

    await wait_until(everyone_sees_everyone, timeout_s=90, message="8 peers to see 7 records each")
    for peer in peers:
        records = peer.directory.active(exclude=peer.peer_id)
        assert len(records) == 7
        for pid, record in records.items():
            assert record.peer_id == pid
            assert record.flops > 0
            assert record.maddrs
            assert all(pid in m for m in record.maddrs)


async def test_record_under_another_peers_subkey_is_rejected(make_swarm):
    victim, other = await make_swarm(2, run_id="forge")
    await wait_until(lambda: len(victim.directory.active()) == 2, timeout_s=60, message="2 peers")

    # an attacker with its own key joins the DHT and tries to overwrite the victim's subkey
    attacker_id = load_or_create_identity(None)
    transport = await P2PTransport.create(HostConfig(initial_peers=tuple(victim.maddrs)), attacker_id)
    try:
        node = await DHTNode.create(
            p2p=transport.p2p,
            initial_peers=victim.maddrs,
            record_validator=RSASignatureValidator(attacker_id.private_key),
        )
        try:
            forged = victim._make_record().model_dump(mode="json") | {"flops": 1.0, "state": "draining"}
            key = victim.dht.key(PEERS_KEY)
            ok = await node.store(key, forged, dht_time() + 30, subkey=victim.dht.own_subkey)
            assert not ok, "the DHT accepted a record written under someone else's subkey"
            # a record under the attacker's own subkey that claims to be the victim: the run's validator
            # refuses it at every replica (and readers would drop it: see test_records)
            ok = await node.store(
                key,
                forged,
                dht_time() + 30,
                subkey=RSASignatureValidator(attacker_id.private_key).local_public_key,
            )
            assert not ok
            directory = PeerDirectory(other.dht)
            seen = await directory.refresh()
            assert seen[victim.peer_id].flops == victim.flops
            assert seen[victim.peer_id].state != PeerState.DRAINING
            assert attacker_id.peer_id not in seen
        finally:
            await node.shutdown()
    finally:
        await transport.aclose()


async def test_stopped_peer_disappears_after_its_ttl(make_swarm):
    peers = await make_swarm(3, run_id="ttl", record_ttl_s=4.0)
    watcher, leaver = peers[0], peers[2]
    await wait_until(
        lambda: leaver.peer_id in watcher.directory.peers, timeout_s=60, message="leaver visible"
    )
    await leaver.aclose(drain=False)  # as if it crashed: no draining record
    await wait_until(
        lambda: leaver.peer_id not in watcher.directory.peers, timeout_s=30, message="leaver to expire"
    )
    assert peers[1].peer_id in watcher.directory.peers


async def test_draining_peer_is_marked_then_gone(make_swarm):
    peers = await make_swarm(2, run_id="drain")
    watcher, leaver = peers
    await wait_until(lambda: leaver.peer_id in watcher.directory.active(), timeout_s=60, message="visible")
    await leaver.aclose()
    await wait_until(
        lambda: leaver.peer_id not in watcher.directory.active(), timeout_s=30, message="inactive"
    )


async def test_pinned_records_reach_the_bootstrap_and_a_client_dials_the_peers_it_reads(make_swarm):
    """A DHT client reaches only its initial peers until it dials others (the daemon cannot route to a
    peer it never connected to), so the bootstrap must hold every pinned record, replica or not."""
    peers = await make_swarm(8, run_id="pin")
    bootstrap, others = peers[0], peers[1:]
    names = [f"pinned/{i}" for i in range(6)]  # the bootstrap is one of 5 replicas of 8 for all six: ~6 %
    for peer in others:
        for name in names:
            assert await peer.dht.store_own(name, {"from": peer.peer_id}, ttl_s=60, pin_to_initial_peers=True)
    storage = bootstrap.dht.node.protocol.storage  # its own copy, not a traversal
    for name in names:
        stored = storage.get(DHTID.generate(source=bootstrap.dht.key(name)))
        assert stored is not None, name
        assert len(stored.value) == len(others), name

    client = await RunClient.connect(bootstrap.maddrs, run_id="pin")
    try:
        seen = await client.peers()
        assert {r.peer_id for r in seen} == {p.peer_id for p in peers}
        assert client._directory.num_dialled == len(peers)
    finally:
        await client.aclose()


async def test_a_value_held_only_at_the_initial_peer_is_read_directly_and_the_newest_wins(make_swarm):
    """`get_signed(from_initial_peers=True)` asks the initial peers themselves: a newer value pinned there
    wins over an older one that the DHT search finds."""
    peers = await make_swarm(4, run_id="direct")
    bootstrap, writer = peers[0], peers[1]
    client = await RunClient.connect(bootstrap.maddrs, run_id="direct")
    try:
        assert await writer.dht.store_own("flag", {"done": False}, ttl_s=60)
        now = dht_time()
        # the newer value goes to the bootstrap only (as the pin does), not to the key's replicas
        assert await writer.dht._store_at(bootstrap.peer_id, "flag", {"done": True}, now + 120)
        direct = await client.dht.get_signed("flag", from_initial_peers=True)
        assert direct[writer.peer_id][0] == {"done": True}
        assert direct[writer.peer_id][1] == pytest.approx(now + 120)
        assert set(direct) == {writer.peer_id}
    finally:
        await client.aclose()


async def test_the_job_and_owners_records_are_pinned_at_the_bootstrap(make_swarm):
    """The owner's records must outlive a restart of every peer (which may be all of the key's replicas):
    the bootstrap keeps its own copy, replica or not (the job key has 5 replicas among 8 nodes here)."""
    peers = await make_swarm(8, run_id="jobpin")
    bootstrap = peers[0]
    client = await RunClient.connect(bootstrap.maddrs, run_id="jobpin")
    try:
        await client.publish_job(JobSpec(job_id="pinned", model="digits_cnn", dataset="digits"))
        await client.publish_owners([peers[1].peer_id])
        storage = bootstrap.dht.node.protocol.storage  # its own copy, not a traversal
        for name in (JOB_KEY, OWNERS_KEY):
            stored = storage.get(DHTID.generate(source=bootstrap.dht.key(name)))
            assert stored is not None, name
            assert len(stored.value) == 1, name
    finally:
        await client.aclose()
