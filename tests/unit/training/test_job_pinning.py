"""A job, its owners and its progress outlive a restart of every peer: they are pinned at the initial peers.

The DHT keeps a value at the key's nearest nodes, which may all be the run's peers. When every one of them
restarts, a value that lived only there is gone: restarted peers found no job and sat idle (the full-restart
e2e test failed 2 runs in 5 that way, and a direct read showed the job record on no node). So the owner's
records and, every `_PIN_PROGRESS_S`, a first stage's progress are also stored at the initial peers, and
readers ask them directly.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from ravnest_p2p.training.jobs import JOB_KEY, read_job_signed
from ravnest_p2p.training.progress import publish_progress
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.runner import StageRunner
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from ._fakes import FakeDHT
from .test_supervisor_runner import BASE

pytestmark = pytest.mark.timeout(60)


class _OnlyAtInitialPeers(FakeDHT):
    """A DHT whose search finds nothing: the values live only at the initial peers (asked directly)."""

    async def get_signed(
        self, name: str, *, from_initial_peers: bool = False
    ) -> dict[str, tuple[Any, float]]:
        return await super().get_signed(name) if from_initial_peers else {}


async def test_a_job_held_only_at_the_initial_peers_is_read():
    dht = _OnlyAtInitialPeers("owner")
    await dht.store_own(JOB_KEY, BASE.to_wire(), ttl_s=60, pin_to_initial_peers=True)
    found = await read_job_signed(_OnlyAtInitialPeers("peer", dht.store))
    assert found is not None
    assert found == ("owner", BASE)


async def test_progress_is_pinned_when_final_or_asked():
    dht = FakeDHT("p0")
    role = role_for(BASE, None, "p0")
    assert role is not None
    runner = StageRunner(RpcEndpoint(FakeNetwork().create("p0"), "t"), dht, BASE, role)
    record = runner.progress()
    await publish_progress(dht, record)
    assert dht.pins == []
    await publish_progress(dht, record, final=True)
    await publish_progress(dht, record, pin=True)
    assert dht.pins == [("p0", "progress"), ("p0", "progress")]


async def test_a_first_stage_pins_its_progress_at_most_every_period(monkeypatch):
    dht = FakeDHT("p0")
    role = role_for(BASE, None, "p0")
    assert role is not None
    assert role.is_first
    runner = StageRunner(RpcEndpoint(FakeNetwork().create("p0"), "t"), dht, BASE, role)
    now = [time.monotonic()]
    monkeypatch.setattr("ravnest_p2p.training.runner.time.monotonic", lambda: now[0])
    monkeypatch.setattr(runner, "metrics", lambda: SimpleNamespace(model_dump=lambda mode: {}))  # no service
    await runner.publish_metrics()  # the first publication is pinned
    now[0] += 10.0
    await runner.publish_metrics()  # within the period: the DHT replicas only
    assert dht.pins.count(("p0", "progress")) == 1
    now[0] += 25.0
    await runner.publish_metrics()
    assert dht.pins.count(("p0", "progress")) == 2
    assert dht.writes.count(("p0", "progress")) == 3
