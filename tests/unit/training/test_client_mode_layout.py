"""`RunClient.publish_job` lays out a sync_backup job without assignment, and `wait_for_job` follows it."""

from __future__ import annotations

import pytest

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.modes import SyncBackupConfig
from ravnest_p2p.types import PeerState

from ._fakes import FakeClientDHT

pytestmark = pytest.mark.timeout(30)

JOB = JobSpec(
    job_id="sb",
    model="mlp",
    model_params={"in_features": 64, "hidden_features": [32], "out_features": 10},
    mode="sync_backup",
    sync_backup=SyncBackupConfig(num_required=2, num_backup=1),
)


def record(peer: str, gflops: float) -> PeerRecord:
    return PeerRecord.model_construct(
        peer_id=peer,
        flops=gflops * 1e9,
        free_memory_bytes=2**30,
        upload_mbps=100.0,
        download_mbps=100.0,
        state=PeerState.READY,
        updated_at=1.0,
        client_mode=False,
    )


def client_on(dht: FakeClientDHT, records: list[PeerRecord]) -> RunClient:
    client = RunClient.__new__(RunClient)
    client.dht = dht  # type: ignore[assignment]
    client._placed = {}
    dht.max_ttl_s = lambda name: None  # type: ignore[attr-defined]

    async def peers() -> list[PeerRecord]:
        return records

    client.peers = peers  # type: ignore[method-assign]
    return client


def done_metrics(peer: str, cluster: int) -> StageMetrics:
    return StageMetrics(
        epoch=0, job_id="sb", peer_id=peer, cluster=cluster, stage=0, num_stages=1, step=9, optimizer_steps=9,
        done=True, updated_at=1.0, mode="sync_backup",
    )  # fmt: skip


async def test_publish_fills_the_layout_and_a_fresh_client_waits_on_it() -> None:
    records = [record("a", 1), record("b", 4), record("c", 3), record("d", 2)]
    dht = FakeClientDHT("owner")
    published = await client_on(dht, records).publish_job(JOB)
    assert published.assignment is not None
    assert [c[0].peer_id for c in published.assignment] == ["b", "c", "d"]
    assert published.sync_backup.owners == ("b", "c")
    # another client, given the job as written (no assignment), finds the layout in the published job
    other = client_on(dht.as_signer("owner"), records)  # type: ignore[arg-type]
    for cluster, peer in enumerate("bca"):  # workers b and c (clusters 0 and 1) done; a is no worker
        await dht.as_signer(peer).store_own(
            METRICS_KEY, done_metrics(peer, cluster).model_dump(mode="json"), ttl_s=60
        )
    metrics, done = await other._poll_job(JOB)
    assert done
    assert {m.peer_id for m in metrics} == {"b", "c"}  # "a" is no worker of the layout: not counted
    assert await other._poll_job(published) == (metrics, True)


async def test_plan_lays_out_a_mode_job_with_its_own_rule() -> None:
    records = [record("a", 1), record("b", 4), record("c", 3)]
    client = client_on(FakeClientDHT("owner"), records)
    placed = client.plan(records, JOB)
    assert placed.assignment is not None
    assert [c[0].peer_id for c in placed.assignment] == ["b", "c", "a"]
