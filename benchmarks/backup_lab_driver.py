"""The researcher of `bench_backup_lab`, inside a lab namespace: publish sync_backup jobs, collect metrics.

Run as ``python -m benchmarks.backup_lab_driver --initial-peers M.. --run-id R --workers ID.. --straggler ID
--job JSON --runs b1 b0 async ... --out FILE`` from the repository root. The workers are the peer ids in
lab order; the straggler is one of them. Each run is one job on the same peers:

- ``b1``: N = 4, b = 1: every worker, the straggler included (5 workers);
- ``b0``: N = 4, b = 0: the straggler and the first three others (4 workers);
- ``async``: the apply-on-arrival baseline on all 5 workers (as many gradients applied as ``b1``).

With ``--straggler-owns no`` (the default) the jobs name the fast workers as the only owner candidates
(``sync_backup.owners``: an owner on a slow peer slows every step); with ``yes`` every worker may own.
The library deals one shard to each owner candidate (`strategies.sync_layout`), so with ``yes`` the
straggler owns one. Writes one JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.training.job import JobSpec, StagePlacement


def run_workers(run: str, workers: list[str], straggler: str) -> list[str]:
    if run == "b0":
        return [*[w for w in workers if w != straggler][:3], straggler]
    return list(workers)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = JobSpec.model_validate_json(args.job)
    end = len(build_model(base.model, base.model_params, seed=base.seed))
    results = []
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(len(args.workers), timeout_s=180, measured=False)
        for index, name in enumerate(args.runs):
            workers = run_workers(name, args.workers, args.straggler)
            fast = tuple(w for w in workers if w != args.straggler)
            sync = base.sync_backup.model_copy(
                update={
                    "num_required": 4,
                    "num_backup": len(workers) - 4,
                    "aggregation": "async" if name == "async" else "sync",
                    "owners": fast if args.straggler_owns == "no" else None,
                }
            )
            job_id = f"{base.job_id}-{name}-{index}"
            job = base.model_copy(
                update={
                    "job_id": job_id,
                    "sync_backup": sync,
                    "assignment": tuple(
                        (StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers
                    ),
                }
            )
            began = time.time()
            await client.publish_job(job)
            final = await client.wait_for_job(job, timeout_s=args.timeout_s, poll_s=1.0)
            results.append(
                {
                    "run": name,
                    "job_id": job_id,
                    "workers": workers,
                    "began": began,
                    "ended": time.time(),
                    "metrics": [m.model_dump(mode="json") for m in final],
                }
            )
            print(json.dumps({"finished": name, "job_id": job_id}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--workers", nargs="+", required=True, help="peer ids in lab order")
    parser.add_argument("--straggler", required=True)
    parser.add_argument("--job", required=True, help="JobSpec JSON (mode sync_backup, without assignment)")
    parser.add_argument("--runs", nargs="+", required=True, choices=("b1", "b0", "async"))
    parser.add_argument("--straggler-owns", choices=("yes", "no"), default="no")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
