"""RunClient follows a job across plans: done by the progress record or the CURRENT plan's first stages."""

from __future__ import annotations

from typing import Any

import pytest

from ravnest_p2p.client import RunClient, current_plan_done, live_clusters_done
from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.errors import RavnestError
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import METRICS_KEY, StageMetrics
from ravnest_p2p.training.progress import JobProgress, merge_progress, publish_progress, read_progress
from ravnest_p2p.types import PeerState

from ._fakes import FakeClientDHT, FakeDHT

pytestmark = pytest.mark.timeout(30)

JOB = JobSpec(job_id="j")


def record(peer: str, *, epoch: int, cluster: int | None, stage: int | None) -> PeerRecord:
    return PeerRecord.model_construct(
        peer_id=peer,
        flops=1e9,
        free_memory_bytes=1,
        state=PeerState.TRAINING,
        epoch=epoch,
        cluster=cluster,
        stage=stage,
        updated_at=1.0,
        client_mode=False,
    )


def metrics(peer: str, *, epoch: int, cluster: int, stage: int, done: bool) -> StageMetrics:
    return StageMetrics(
        epoch=epoch,
        job_id="j",
        peer_id=peer,
        cluster=cluster,
        stage=stage,
        num_stages=2,
        step=5,
        optimizer_steps=5,
        done=done,
        updated_at=1.0,
    )


async def put_metrics(dht: FakeDHT, m: StageMetrics) -> None:
    await dht.as_signer(m.peer_id).store_own(METRICS_KEY, m.model_dump(mode="json"), ttl_s=60)


def client_on(dht: FakeClientDHT, records: list[PeerRecord]) -> RunClient:
    client = RunClient.__new__(RunClient)
    client.dht = dht  # type: ignore[assignment]

    async def peers() -> list[PeerRecord]:
        return records

    client.peers = peers  # type: ignore[method-assign]
    return client


def test_current_plan_done_ignores_dead_peers_and_old_epochs():
    old = [
        metrics("a", epoch=1, cluster=0, stage=0, done=True),
        metrics("dead", epoch=1, cluster=1, stage=0, done=False),
    ]
    live = [record("a", epoch=1, cluster=0, stage=0), record("b", epoch=1, cluster=0, stage=1)]
    assert current_plan_done(old, live)  # the dead first stage has no live record: not waited on
    moved = [record("a", epoch=2, cluster=0, stage=0)]
    assert not current_plan_done(old, moved)  # epoch 1's done does not say epoch 2 finished
    assert current_plan_done([*old, metrics("a", epoch=2, cluster=0, stage=0, done=True)], moved)
    assert not current_plan_done(old, [record("x", epoch=0, cluster=None, stage=None)])


async def test_wait_for_job_returns_on_the_progress_record_after_the_swarm_moved_on():
    """The bug: two survivors finished, a dead copy showed done=False, then [] on the next epoch."""
    dht = FakeClientDHT("client")
    await put_metrics(dht, metrics("a", epoch=1, cluster=0, stage=0, done=True))
    await put_metrics(dht, metrics("c", epoch=1, cluster=1, stage=0, done=True))
    await put_metrics(dht, metrics("dead", epoch=1, cluster=2, stage=0, done=False))
    records = [record("a", epoch=2, cluster=0, stage=0), record("c", epoch=2, cluster=0, stage=1)]
    client = client_on(dht, records)
    with pytest.raises(TimeoutError):  # no progress record yet, and epoch 2 never ran the job
        await client.wait_for_job(JOB, timeout_s=0.2, poll_s=0.05)
    await publish_progress(
        dht.as_signer("a"),
        JobProgress(job_id="j", peer_id="a", epoch=1, cluster=0, micro_batches=9, done=True),
    )
    final = await client.wait_for_job(JOB, timeout_s=5, poll_s=0.05)
    assert {m.peer_id for m in final} == {"a", "c", "dead"}  # what the newest epoch left, for the notebook


def test_one_cluster_done_waits_for_the_other_live_clusters_of_its_epoch():
    def view(*done_clusters: int):
        records = {
            f"p{c}": JobProgress(job_id="j", peer_id=f"p{c}", epoch=1, cluster=c, num_clusters=3, done=True)
            for c in done_clusters
        }
        found = merge_progress(records, job_id="j", owner_peer_id=None)
        assert found is not None
        assert found.done
        return found

    live = [record(f"p{c}", epoch=1, cluster=c, stage=0) for c in range(3)]
    assert not live_clusters_done(view(0), live)  # clusters 1 and 2 still train
    assert not live_clusters_done(view(0, 2), live)
    assert live_clusters_done(view(0, 1, 2), live)
    assert live_clusters_done(view(0, 2), [live[0], live[2]])  # cluster 1's first stage is gone
    moved = [record(f"p{c}", epoch=2, cluster=c, stage=0) for c in range(3)]
    assert live_clusters_done(view(0), moved)  # a plan agreed after the job ended never runs it


async def test_wait_for_job_waits_for_every_live_cluster_not_the_first_one_done():
    dht = FakeClientDHT("client")
    records = [record("a", epoch=1, cluster=0, stage=0), record("c", epoch=1, cluster=1, stage=0)]
    client = client_on(dht, records)
    await put_metrics(dht, metrics("a", epoch=1, cluster=0, stage=0, done=True))
    await put_metrics(dht, metrics("c", epoch=1, cluster=1, stage=0, done=False))
    await publish_progress(
        dht.as_signer("a"),
        JobProgress(job_id="j", peer_id="a", epoch=1, cluster=0, num_clusters=2, micro_batches=9, done=True),
    )
    with pytest.raises(TimeoutError):  # cluster 1 trains on
        await client.wait_for_job(JOB, timeout_s=0.3, poll_s=0.05)
    await put_metrics(dht, metrics("c", epoch=1, cluster=1, stage=0, done=True))
    await publish_progress(
        dht.as_signer("c"),
        JobProgress(job_id="j", peer_id="c", epoch=1, cluster=1, num_clusters=2, micro_batches=9, done=True),
    )
    final = await client.wait_for_job(JOB, timeout_s=5, poll_s=0.05)
    assert {(m.peer_id, m.done) for m in final} == {("a", True), ("c", True)}


async def test_a_failed_job_raises_a_stopped_one_waits_for_done_and_stop_job_is_signed_by_the_client():
    dht = FakeClientDHT("client")
    await dht.store_own("job", JOB.to_wire(), ttl_s=60)  # this client published the job
    client = client_on(dht, [])
    await client.stop_job("j")
    view = await read_progress(dht, "j", owner_peer_id="client")
    assert view is not None
    assert view.stopped
    assert (await client.progress("j")) == view
    with pytest.raises(TimeoutError):  # stopped, but no cluster has finished yet
        await client.wait_for_job(JOB, timeout_s=0.2, poll_s=0.05)
    # someone else's stop does not count
    other = FakeClientDHT("other")
    await client_on(other, []).stop_job("j")
    assert (await read_progress(FakeDHT("x", other.store), "j", owner_peer_id="client")) is None
    # a job that ended without being done (a stage of a fixed assignment failed) raises
    failed = FakeClientDHT("client2")
    await publish_progress(
        failed.as_signer("a"),
        JobProgress(job_id="j", peer_id="a", cluster=0, ended=True, reason="stage 1 failed"),
    )
    with pytest.raises(RavnestError, match="stage 1 failed"):
        await client_on(failed, []).wait_for_job(JOB, timeout_s=2, poll_s=0.05)


async def test_a_done_job_with_a_stop_is_done_not_failed():
    dht = FakeClientDHT("client")
    await dht.store_own("job", JOB.to_wire(), ttl_s=60)
    await publish_progress(
        dht.as_signer("a"), JobProgress(job_id="j", peer_id="a", cluster=0, done=True, ended=True)
    )
    await client_on(dht, []).stop_job("j")
    final: Any = await client_on(dht, []).wait_for_job(JOB, timeout_s=2, poll_s=0.05)
    assert final == []
