"""`make demo`: a bootstrap and three peers on loopback find each other, measure themselves, and shut down.

Later issues turn this into training; for now it shows the foundation working end to end.
"""

from __future__ import annotations

import asyncio
import sys

from ravnest_p2p.status import fetch_peers, format_table
from ravnest_p2p.swarm import LocalSwarm

NUM_PEERS = 3


async def _wait_for_membership(initial_peers: list[str], run_id: str, timeout_s: float = 90.0) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        records = await fetch_peers(initial_peers, run_id)
        ready = [r for r in records if r.flops > 0 and r.upload_mbps > 0 and r.download_mbps > 0]
        if len(ready) >= NUM_PEERS + 1:
            return format_table(records)
        if loop.time() > deadline:
            raise TimeoutError(f"only {len(ready)} of {NUM_PEERS + 1} peers measured themselves in time")
        print(f"  {len(records)} peers visible, {len(ready)} measured; waiting...", flush=True)
        await asyncio.sleep(2.0)


def main() -> int:
    print(f"starting a bootstrap peer and {NUM_PEERS} peers on 127.0.0.1 ...", flush=True)
    with LocalSwarm(NUM_PEERS, run_id="demo") as swarm:
        print(f"bootstrap: {swarm.initial_peers[0]}", flush=True)
        table = asyncio.run(_wait_for_membership(swarm.initial_peers, "demo"))
        print("\nmembership (measured by each peer):\n" + table, flush=True)
        codes = swarm.stop()
    print(f"\nshut down; exit codes: {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
