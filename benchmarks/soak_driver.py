"""The researcher of the churn soak, run inside a lab namespace (the root namespace cannot reach the peers).

Publishes a job without an assignment (the swarm plans it), waits until the first plan's pipelines move,
then polls the job every `--poll-s` and appends what it saw to a JSON-lines timeline that the orchestrator
(`benchmarks.bench_churn_soak`, in the root namespace) reads while it churns the swarm and afterwards:

- ``{"kind": "started", "t": ...}`` once: the first plan's pipelines moved past their start (t0).
- ``{"kind": "poll", "t": ..., "progress": [...], "evals": [...], "plan": [...]}`` every poll: every
  signed progress record of the job (validated `JobProgress`, one per first stage, their own subkeys),
  the first stages' newest held-out loss/accuracy, and the newest plan's (epoch, cluster, stage, peer id).
- ``{"kind": "window_end", "t": ...}``: t0 + `--duration-s` (only with a duration).

With ``--duration-s D`` the owner stops the job at t0 + D; with 0 the job ends by itself (``max_steps``).
Either way the driver then waits for the job's done metrics (at most `--done-timeout-s`; then the
newest metrics, with ``done: false``) and writes them (JSON) to ``--out``.

Run as ``python -m benchmarks.soak_driver --initial-peers M.. --run-id R --num-peers N --job JSON
--timeline FILE --out FILE [--duration-s D]`` from the repository root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.progress import PROGRESS_KEY, parse_progress


async def progress_records(client: RunClient, job_id: str) -> list[dict[str, Any]]:
    """Every valid progress record of `job_id` a cluster's first stage signed (the owner's stop excluded)."""
    found = await client.dht.get_signed(PROGRESS_KEY, from_initial_peers=True)
    out = []
    for signer, (value, _) in found.items():
        try:
            record = parse_progress(value, signer)
        except Exception:  # malformed or not its signer's: the swarm ignores it too
            continue
        if record.job_id == job_id and record.cluster is not None:
            out.append(record.model_dump(mode="json"))
    return out


async def poll(client: RunClient, job: JobSpec) -> dict[str, Any]:
    records = await progress_records(client, job.job_id)
    metrics = newest_epoch(await client.metrics(job_id=job.job_id))
    evals = [
        {
            "epoch": m.epoch,
            "cluster": m.cluster,
            "step": m.step,
            "eval_loss": m.eval_loss,
            "eval_accuracy": m.eval_accuracy,
            "samples_per_s": m.samples_per_s,
        }
        for m in metrics
        if m.stage == 0
    ]
    plan = sorted((m.epoch, m.cluster, m.stage, m.peer_id) for m in metrics)
    return {"kind": "poll", "t": time.time(), "progress": records, "evals": evals, "plan": plan}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    job = JobSpec.model_validate_json(args.job)
    timeline = Path(args.timeline)

    def note(line: dict[str, Any]) -> None:
        with timeline.open("a") as f:
            f.write(json.dumps(line) + "\n")

    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(args.num_peers, timeout_s=300, measured=False)
        await client.publish_job(job)
        published_at = time.time()
        deadline = time.monotonic() + 600
        while True:
            progress = await client.progress(job.job_id)
            if progress is not None and progress.started_epoch:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the job did not start training within 600 s")
            await asyncio.sleep(0.5)
        t0 = time.time()
        note({"kind": "started", "t": t0, "published_at": published_at})
        window_end = t0 + args.duration_s if args.duration_s > 0 else None
        hard_deadline = time.monotonic() + args.max_run_s
        while True:
            started = time.monotonic()
            try:
                async with asyncio.timeout(max(10.0, 3 * args.poll_s)):
                    line = await poll(client, job)
            except TimeoutError:
                line = None
            if line is not None:
                note(line)
            if window_end is not None and time.time() >= window_end:
                note({"kind": "window_end", "t": time.time()})
                await client.stop_job(job.job_id)
                break
            if window_end is None:
                progress = await client.progress(job.job_id)
                if progress is not None and progress.done:
                    break
            if time.monotonic() > hard_deadline:
                raise TimeoutError(f"the job did not end within {args.max_run_s:.0f} s")
            await asyncio.sleep(max(0.0, args.poll_s - (time.monotonic() - started)))
        done = True
        try:
            final = await client.wait_for_job(job, timeout_s=args.done_timeout_s, poll_s=1.0)
        except TimeoutError:  # a swarm that cannot agree on a plan never finishes: report what it shows
            done = False
            final = newest_epoch(await client.metrics(job_id=job.job_id))
        note(await poll(client, job))
    return {
        "t0": t0,
        "published_at": published_at,
        "done": done,
        "final": [m.model_dump(mode="json") for m in final],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--num-peers", type=int, required=True, help="peers to wait for before publishing")
    parser.add_argument("--job", required=True)
    parser.add_argument("--timeline", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--duration-s", type=float, default=0.0, help="stop the job at t0 + this (0: never)")
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--done-timeout-s", type=float, default=240.0)
    parser.add_argument("--max-run-s", type=float, default=3600.0)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
