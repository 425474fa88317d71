"""The researcher inside a lab namespace: publish one job, wait for it, write every stage's final metrics.

Run as ``python -m tests.integration.lab._job_driver --initial-peers M --run-id R --job JSON --out FILE``
(from the repository root); exits non-zero if the job fails or times out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from ravnest_p2p.client import RunClient
from ravnest_p2p.training.job import JobSpec


async def run(args: argparse.Namespace) -> list[dict]:
    job = JobSpec.model_validate_json(args.job)
    num_peers = sum(len(cluster) for cluster in job.assignment or ())
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(num_peers, timeout_s=args.timeout_s, measured=False)
        await client.publish_job(job)
        final = await client.wait_for_job(job, timeout_s=args.timeout_s, poll_s=1.0)

        def everyone_done() -> bool:
            return len(final) == num_peers and all(m.done for m in final)

        # the first stages finish last in the pipeline, but each stage publishes its own final record
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not everyone_done() and loop.time() < deadline:
            await asyncio.sleep(1.0)
            final = await client.metrics(job_id=job.job_id)
    return [m.model_dump(mode="json") for m in final]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--job", required=True, help="JobSpec JSON with an assignment")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
