"""Runs inside a lab namespace as the researcher of `bench_big_model`: checks that a swarm too small for
the model gets a planning error, publishes the job for the swarm to plan, and records the loss curve.

Prints nothing; writes one JSON file (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient
from ravnest_p2p.planning import InfeasiblePlan
from ravnest_p2p.training.job import JobSpec


async def run(args: argparse.Namespace) -> dict[str, Any]:
    job = JobSpec.model_validate_json(args.job)
    out: dict[str, Any] = {"job": job.model_dump(mode="json")}
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        records = await client.wait_for_peers(args.num_peers, timeout_s=300, measured=True)
        out["free_memory_bytes"] = {r.peer_id: r.free_memory_bytes for r in records}
        curve: list[dict[str, Any]] = []
        started = time.monotonic()

        def on_progress(snapshot: Any) -> None:
            for m in snapshot:
                if m.stage == m.num_stages - 1 and m.loss is not None:
                    curve.append(
                        {
                            "t_s": time.monotonic() - started,
                            "step": m.step,
                            "opt_steps": m.optimizer_steps,
                            "loss": m.loss,
                        }
                    )

        await client.publish_job(job)
        final = await client.wait_for_job(job, timeout_s=args.timeout_s, poll_s=1.0, on_progress=on_progress)
        out["wall_s"] = time.monotonic() - started
        out["curve"] = curve
        out["metrics"] = [m.model_dump(mode="json") for m in final]
        # the negative case, after the run (its dry run would compete for CPU with the peers'): the same
        # model on the same peers with a third of their memory each
        shrunk = [r.model_copy(update={"free_memory_bytes": r.free_memory_bytes // 3}) for r in records]
        try:
            client.plan(shrunk, job)
            out["too_small"] = {"error": None}
        except InfeasiblePlan as exc:
            out["too_small"] = {"error": str(exc), "type": type(exc).__name__}

    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--num-peers", type=int, required=True)
    parser.add_argument("--job", required=True, help="JobSpec JSON (no assignment: the swarm plans it)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
