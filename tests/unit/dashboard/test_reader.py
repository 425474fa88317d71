"""The dashboard's DHT reader against a fake client: one snapshot per read, errors shown, not raised."""

from __future__ import annotations

import asyncio

from ravnest_p2p.dashboard import reader as reader_module
from ravnest_p2p.dashboard.reader import SwarmReader
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import ProgressView
from tests.unit.dashboard._fakes import peer, stage


class FakeClient:
    def __init__(self) -> None:
        self.dht = object()
        self.fail: Exception | None = None
        self.step = 10

    async def peers(self):
        if self.fail is not None:
            raise self.fail
        return [peer(i, cluster=0, stage=i) for i in range(2)]

    async def progress(self, job_id):
        return ProgressView(job_id=job_id, epoch=3, micro_batches=self.step)

    async def metrics(self, *, job_id):
        # an older epoch's leftover is dropped: only the newest epoch counts
        old = stage(0, 0, step=1, loss=None, rounds=0).model_copy(update={"epoch": 1})
        first = stage(0, 0, step=self.step, loss=None, rounds=1)
        return [old, first, stage(0, 1, step=self.step, loss=1.5, rounds=1)]

    async def member_metrics(self, job, metrics):
        return list(metrics)


class FakeBoard:
    def __init__(self, dht) -> None:
        pass

    async def read(self, epoch):
        return {"a": "f" * 64, "b": "f" * 64}


async def _job(dht):
    return JobSpec(job_id="j1")


async def test_reads_a_snapshot_and_grows_the_history(monkeypatch):
    monkeypatch.setattr(reader_module, "read_job", _job)
    monkeypatch.setattr(reader_module, "DhtPlanBoard", FakeBoard)
    client = FakeClient()
    reader = SwarmReader(client, run_id="r")  # type: ignore[arg-type]
    assert reader.snapshot()["loading"] is True
    await reader.read_once()
    client.step = 20
    state = await reader.read_once()
    assert state["job"]["job_id"] == "j1"
    assert state["job"]["micro_batches"] == 20
    assert state["plan"]["agree"] == 2
    assert [len(c["stages"]) for c in state["plan"]["clusters"]] == [2]
    assert len(state["stages"]) == 2
    assert [p["step"] for p in state["history"]["0"]] == [10, 20]
    assert reader.snapshot()["reads"] == 2


async def test_a_failed_read_is_reported_and_retried(monkeypatch):
    monkeypatch.setattr(reader_module, "read_job", _job)
    monkeypatch.setattr(reader_module, "DhtPlanBoard", FakeBoard)
    client = FakeClient()
    client.fail = RuntimeError("dht down")
    reader = SwarmReader(client, run_id="r", refresh_s=0.01)  # type: ignore[arg-type]
    reads: list[str | None] = []

    async def on_read() -> None:
        reads.append(reader.error)
        client.fail = None  # the swarm comes back

    task = asyncio.create_task(reader.run(on_read=on_read))
    try:
        async with asyncio.timeout(5):
            while len(reads) < 2:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert reads[:2] == ["RuntimeError: dht down", None]
    assert reader.snapshot()["error"] is None
    assert reader.snapshot()["job"]["job_id"] == "j1"
