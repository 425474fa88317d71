"""Runs inside the lab's researcher namespace: waits for the peers and publishes the dashboard test's job.

``python -m tests.e2e._dashboard_lab_driver --initial-peers MADDR... --run-id ID --peers N --job JSON``
"""

from __future__ import annotations

import argparse
import asyncio

from ravnest_p2p.client import RunClient
from ravnest_p2p.training.job import JobSpec


async def publish(initial_peers: list[str], run_id: str, num_peers: int, job: JobSpec) -> None:
    async with RunClient.connect(initial_peers, run_id) as client:
        await client.wait_for_peers(num_peers, timeout_s=180, measured=False)
        await client.publish_job(job)
    print(f"published {job.job_id}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    asyncio.run(publish(args.initial_peers, args.run_id, args.peers, JobSpec.model_validate_json(args.job)))


if __name__ == "__main__":
    main()
