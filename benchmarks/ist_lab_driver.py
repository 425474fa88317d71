"""The researcher of `bench_ist_lab`, inside a lab namespace: publish IST / data parallel / local SGD jobs.

Run as ``python -m benchmarks.ist_lab_driver --initial-peers M.. --run-id R --workers ID.. --job JSON
--runs ist dp local ... --ifaces NS:DEV .. --out FILE`` from the repository root. Each run is one job on
the same n workers (the job's `assignment`: one single-stage cluster per worker):

- ``ist``: mode ist, n workers, K = the job's `ist.local_steps`;
- ``dp``: mode sync_backup, N = n, b = 0 (synchronous data-parallel SGD, one exchange per step);
- ``local``: mode sync_backup, N = n, b = 0, `local_steps` = K (model averaging every K steps).

The library deals the sync_backup jobs' shards one per worker (`strategies.sync_layout`).

Around each job the driver reads the byte counters of every worker's lab interface (``ip -n NS -s -j
link show dev DEV``: everything the worker's namespace sent and received, TCP/IP and libp2p framing
included). Writes one JSON file: per run the job id, wall clock, counters before/after, final metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient
from ravnest_p2p.models import build_model
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.modes import IstConfig, SyncBackupConfig


def counters(ifaces: list[str]) -> list[dict[str, int]]:
    """rx/tx bytes of each ``ns:dev``."""
    out = []
    for spec in ifaces:
        ns, dev = spec.split(":")
        shown = subprocess.run(
            ["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        )
        stats = json.loads(shown.stdout)[0]["stats64"]
        out.append({"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"])})
    return out


def job_for(run: str, base: JobSpec, workers: list[str], index: int) -> JobSpec:
    n, k = len(workers), base.ist.local_steps
    end = len(build_model(base.model, base.model_params, seed=base.seed))
    update: dict[str, Any] = {
        "job_id": f"{base.job_id}-{run}-{index}",
        "assignment": tuple((StagePlacement(peer_id=w, first_layer=0, end_layer=end),) for w in workers),
    }
    if run == "ist":
        update |= {"mode": "ist", "ist": base.ist.model_copy(update={"num_workers": n})}
    else:
        sync = SyncBackupConfig(
            num_required=n,
            num_backup=0,
            local_steps=k if run == "local" else 1,
            step_timeout_s=600,
            owner_ping_timeout_s=60,
        )
        update |= {"mode": "sync_backup", "sync_backup": sync, "ist": IstConfig()}
    return base.model_copy(update=update)


async def all_done(
    client: RunClient, job: JobSpec, num: int, final: list[StageMetrics]
) -> list[StageMetrics]:
    """Wait (at most 60 s) until all `num` workers report done: an IST job is done at the first one, and
    the others' final gathers must not leak into the next job's byte counters."""
    deadline = time.monotonic() + 60
    metrics = final
    while sum(m.done for m in metrics) < num and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # polling the DHT, bounded by the deadline
        metrics = await client.metrics(job_id=job.job_id)
    return metrics


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = JobSpec.model_validate_json(args.job)
    results = []
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(len(args.workers), timeout_s=180, measured=False)
        idle_before = counters(args.ifaces)
        idle_began = time.time()
        await asyncio.sleep(args.idle_s)  # the swarm's background traffic (DHT, membership) per second
        idle = {"seconds": time.time() - idle_began, "before": idle_before, "after": counters(args.ifaces)}
        for index, name in enumerate(args.runs):
            job = job_for(name, base, args.workers, index)
            before = counters(args.ifaces)
            began = time.time()
            await client.publish_job(job)
            snapshot = await client.wait_for_job(job, timeout_s=args.timeout_s, poll_s=0.5)
            ended = time.time()
            final = await all_done(client, job, len(args.workers), list(snapshot))
            results.append(
                {
                    "run": name,
                    "job_id": job.job_id,
                    "began": began,
                    "ended": ended,
                    "counters_before": before,
                    "counters_after": counters(args.ifaces),
                    "idle": idle,
                    "metrics": [m.model_dump(mode="json") for m in final],
                }
            )
            print(json.dumps({"finished": name, "job_id": job.job_id, "s": ended - began}), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--workers", nargs="+", required=True, help="peer ids in lab order")
    parser.add_argument("--job", required=True, help="JobSpec JSON (model, data, optimizer, ist section)")
    parser.add_argument("--runs", nargs="+", required=True, choices=("ist", "dp", "local"))
    parser.add_argument("--ifaces", nargs="+", required=True, help="ns:dev of every worker")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
