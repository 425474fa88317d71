"""The researcher of `bench_backup_lab`, inside a lab namespace: publish sync_backup jobs, collect metrics.

Run as ``python -m benchmarks.backup_lab_driver --initial-peers M.. --run-id R --workers ID.. --straggler ID
--job JSON --runs b1 b0 async ... --out FILE`` from the repository root. The workers are the peer ids in
lab order; the straggler is one of them. Each run is one job on the same peers:

- ``b1``: N = 4, b = 1: every worker, the straggler included (5 workers);
- ``b0``: N = 4, b = 0: the straggler and the first three others (4 workers);
- ``async``: the apply-on-arrival baseline on all 5 workers (as many gradients applied as ``b1``).

With ``--straggler-owns no`` (the default) the jobs name the fast workers as the only owner candidates
(``sync_backup.owners``: an owner on a slow peer slows every step); with ``yes`` every worker may own, and
the job id gets a suffix whose layout gives the straggler a shard. With ``--balanced yes`` (and the
straggler kept off ownership) a job has one shard per owner candidate and an id whose layout gives
each candidate exactly one (the owner hash alone gives some owner two shards for most ids, and that
owner's link then carries twice its share every step). Writes one JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.strategies.sync_layout import SyncLayout
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.sync_compute import piece_views


def run_workers(run: str, workers: list[str], straggler: str) -> list[str]:
    if run == "b0":
        return [*[w for w in workers if w != straggler][:3], straggler]
    return list(workers)


def pick_job_id(base: JobSpec, job_id: str, workers: list[str], wanted: Callable[[SyncLayout], bool]) -> str:
    """`job_id` plus the first suffix whose layout is `wanted`."""
    model = nn.Sequential(*build_model(base.model, base.model_params, seed=base.seed))
    sync = base.sync_backup
    num_shards = sync.num_shards or len(workers)
    pieces = piece_views(dict(model.named_parameters()), num_shards)  # as the runner cuts them
    sizes = {name: p.numel() * p.element_size() for name, p in pieces.items()}
    for suffix in range(10_000):
        candidate = f"{job_id}-{suffix}"
        if wanted(SyncLayout.build(candidate, workers, sizes, num_shards, sync.owners)):
            return candidate
    raise RuntimeError("no job id gives the wanted layout")


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
            if args.balanced == "yes" and fast:  # one shard per owner candidate, each owning one
                sync = sync.model_copy(update={"num_shards": len(sync.owners or workers)})
            job_id = f"{base.job_id}-{name}-{index}"
            spec = base.model_copy(update={"sync_backup": sync})
            if args.straggler_owns == "yes":
                job_id = pick_job_id(
                    spec, job_id, workers, lambda layout: bool(layout.shards_of(args.straggler))
                )
            elif args.balanced == "yes":
                owners = sorted(sync.owners or workers)
                job_id = pick_job_id(
                    spec, job_id, workers, lambda layout, owners=owners: sorted(layout.owners()) == owners
                )
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
    parser.add_argument("--balanced", choices=("yes", "no"), default="no", help="one shard per owner")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
