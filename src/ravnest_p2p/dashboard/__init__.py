"""The swarm dashboard: `python -m ravnest_p2p.status --serve 127.0.0.1:8080` (see docs/dashboard.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from ravnest_p2p.dashboard.server import DashboardServer, check_bind, parse_bind

__all__ = ["DashboardServer", "check_bind", "parse_bind", "serve_dashboard"]


async def serve_dashboard(
    initial_peers: Sequence[str],
    run_id: str,
    *,
    host: str,
    port: int,
    run_owner: str | None = None,
    refresh_s: float = 2.0,
) -> int:
    """Join the run as a client, read it every `refresh_s` and serve the page until SIGINT/SIGTERM."""
    from ravnest_p2p.client import RunClient  # the DHT client stack: only when serving
    from ravnest_p2p.dashboard.reader import SwarmReader

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with RunClient.connect(initial_peers, run_id, run_owner=run_owner) as client:
        reader = SwarmReader(client, run_id=run_id, refresh_s=refresh_s)
        async with DashboardServer(reader.snapshot, host, port) as server, asyncio.TaskGroup() as tasks:
            reading = tasks.create_task(reader.run())
            print(f"dashboard of run '{run_id}' on {server.url}", flush=True)
            await stop.wait()
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
    print("dashboard stopped", file=sys.stderr, flush=True)
    return 0
