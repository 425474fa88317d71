"""The dashboard's one DHT reader: polls the run every few seconds and keeps the newest snapshot.

HTTP requests only ever read the cached snapshot: however many browsers poll the page, the swarm sees
one client's reads every `refresh_s`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.dashboard.state import History, build_state
from ravnest_p2p.discovery import dht_time
from ravnest_p2p.membership import DhtPlanBoard
from ravnest_p2p.training.jobs import read_job

__all__ = ["SwarmReader"]

logger = logging.getLogger(__name__)

_READ_TIMEOUT_S = 20.0


class SwarmReader:
    """Reads peers, plan, job, progress and metrics through `client`; `state` is the newest snapshot."""

    def __init__(self, client: RunClient, *, run_id: str, refresh_s: float = 2.0) -> None:
        self.client = client
        self.run_id = run_id
        self.refresh_s = refresh_s
        self.history = History()
        self.state: dict[str, Any] = {"run_id": run_id, "peers": [], "job": None, "loading": True}
        self.error: str | None = None
        self.num_reads = 0

    async def read_once(self) -> dict[str, Any]:
        """One read of the run; returns (and keeps) the snapshot."""
        client = self.client
        records = await client.peers()
        epoch = max((r.epoch for r in records), default=0)
        digests = await DhtPlanBoard(client.dht).read(epoch)
        job = await read_job(client.dht)
        progress = metrics = None
        if job is not None:
            progress = await client.progress(job.job_id)
            signed = await client.metrics(job_id=job.job_id)
            metrics = newest_epoch(await client.member_metrics(job, signed) or signed)
            self.history.add(job.job_id, metrics)
        self.state = build_state(
            run_id=self.run_id,
            now=dht_time(),
            records=records,
            epoch=epoch,
            digests=digests,
            job=job,
            progress=progress,
            metrics=metrics or [],
            history=self.history,
        )
        self.num_reads += 1
        return self.state

    async def run(self, *, on_read: Callable[[], Awaitable[None]] | None = None) -> None:
        """Read forever, every `refresh_s`; a failed or slow read is reported in the snapshot, not raised."""
        while True:
            try:
                async with asyncio.timeout(_READ_TIMEOUT_S):
                    await self.read_once()
                self.error = None
            except TimeoutError:
                self.error = f"reading the run took over {_READ_TIMEOUT_S:.0f} s"
            except Exception as exc:  # a peer boundary: the page says so and the next read retries
                logger.warning("dashboard read failed: %s", exc)
                self.error = f"{type(exc).__name__}: {exc}"[:300]
            if on_read is not None:
                await on_read()
            await asyncio.sleep(self.refresh_s)

    def snapshot(self) -> dict[str, Any]:
        return {**self.state, "error": self.error, "reads": self.num_reads}
