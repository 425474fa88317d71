"""Runs inside a lab namespace as the researcher: publishes jobs to a fixed 3-stage cluster, collects metrics.

Invoked by `bench_pipeline_throughput`; prints nothing but writes one JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import time
from pathlib import Path

from ravnest_p2p.client import RunClient
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.metrics import StageMetrics


def _trace_row(snapshot: list[StageMetrics], started: float) -> dict:
    """One poll's metrics, compact: per stage (cluster, stage, step, eval loss, averaging bytes, wall)."""
    return {
        "t": round(time.monotonic() - started, 2),
        "load": os.getloadavg()[0],
        "stages": [
            [
                m.cluster,
                m.stage,
                m.step,
                m.eval_loss,
                m.averaging_bytes_sent,
                m.averaging_rounds,
                m.train_wall_s,
            ]
            for m in snapshot
        ],
    }


def _trace_into(trace: list[dict], started: float, snapshot: list[StageMetrics]) -> None:
    trace.append(_trace_row(snapshot, started))


async def run(args: argparse.Namespace) -> list[dict]:
    base = JobSpec.model_validate_json(args.job)
    results = []
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(len(args.stage_peers), timeout_s=180, measured=False)
        split = json.loads(args.split)
        per_cluster = len(split)
        clusters = [
            args.stage_peers[i : i + per_cluster] for i in range(0, len(args.stage_peers), per_cluster)
        ]
        for index, run_spec in enumerate(args.runs):
            schedule, window, *rest = run_spec.split(":")
            period = int(rest[0]) if rest else 0
            repeat = args.runs[:index].count(run_spec)  # a repeated run is a new job
            update = {
                "job_id": f"{base.job_id}-{schedule}-{window}-{period}" + (f"-r{repeat}" if repeat else ""),
                "schedule": schedule,
                "max_in_flight": None if window == "auto" else int(window),
                "adaptive_window": window == "auto",
                "averaging_period_steps": period,
                "assignment": tuple(
                    tuple(
                        StagePlacement(peer_id=pid, first_layer=first, end_layer=end)
                        for pid, (first, end) in zip(peers, split, strict=True)
                    )
                    for peers in clusters
                ),
            }
            if schedule == "gpipe":
                update["update_every"] = int(window)  # GPipe: one optimizer step per fill-drain
            job = base.model_copy(update=update)
            if args.updates:  # validated: e.g. an outer_optimizer given as a dict
                extra = json.loads(args.updates)[index]
                job = JobSpec.model_validate({**job.model_dump(), **extra, "job_id": f"{job.job_id}-{index}"})
            await client.publish_job(job)
            trace: list[dict] = []
            started = time.monotonic()
            on_progress = functools.partial(_trace_into, trace, started) if args.trace else None
            final = await client.wait_for_job(
                job, timeout_s=args.timeout_s, poll_s=0.5 if args.trace else 1.0, on_progress=on_progress
            )
            results.append(
                {
                    "schedule": schedule,
                    "window": window,
                    "averaging_period_steps": period,
                    "metrics": [m.model_dump(mode="json") for m in final],
                    **({"trace": trace} if args.trace else {}),
                }
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--stage-peers", nargs="+", required=True, help="peer ids, cluster by cluster")
    parser.add_argument("--split", required=True, help="JSON list of [first, end] per stage")
    parser.add_argument("--job", required=True, help="JobSpec JSON (without assignment)")
    parser.add_argument(
        "--runs",
        nargs="+",
        required=True,
        help="schedule:window[:averaging period], e.g. async_1f1b:7 async_1f1b:auto gpipe:7",
    )
    parser.add_argument("--updates", help="JSON list, per run: JobSpec fields to set (validated)")
    parser.add_argument(
        "--trace", action="store_true", help="keep every poll's metrics (step, eval loss, averaging bytes)"
    )
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
