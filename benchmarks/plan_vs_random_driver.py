"""The researcher of `bench_plan_vs_random`, run inside its own lab namespace; writes one JSON file.

1. Waits until every peer is ready with measured compute and until every record reports links to at
   least `--min-links` of the other peers (the measured matrix the planner reads).
2. Plans the job with `RunClient.plan(records, job)` (the link matrix from the records, the same
   `make_plan` the peers' agreement runs) and draws a random placement of the same peers into the same
   cluster/stage shape (same layer ranges) for each seed.
3. Trains them in the order given by `--order` (``A`` = planned, ``B`` = the next random seed, ``C`` =
   planned without the link matrix, `use_links=False`), each as a new job on the same peers, and
   records every stage's final metrics and the host's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient
from ravnest_p2p.discovery.records import PeerRecord
from ravnest_p2p.training.job import JobSpec, StagePlacement

Assignment = tuple[tuple[StagePlacement, ...], ...]


def random_assignment(planned: Assignment, peer_ids: Sequence[str], seed: int) -> Assignment:
    """The planned shape (clusters, stages, layer ranges) filled with a seeded shuffle of `peer_ids`."""
    shuffled = sorted(peer_ids)
    random.Random(seed).shuffle(shuffled)
    it = iter(shuffled)
    return tuple(
        tuple(StagePlacement(peer_id=next(it), first_layer=s.first_layer, end_layer=s.end_layer) for s in c)
        for c in planned
    )


def _links_ready(records: Sequence[PeerRecord], min_links: int) -> bool:
    ids = {r.peer_id for r in records}
    return all(len({link.peer_id for link in r.links} & ids) >= min_links for r in records)


async def _measured_records(
    client: RunClient, num_peers: int, min_links: int, timeout_s: float
) -> tuple[list[PeerRecord], float]:
    started = time.monotonic()
    deadline = started + timeout_s
    await client.wait_for_peers(num_peers, timeout_s=timeout_s, measured=True)
    while True:
        records = [r for r in await client.peers() if r.state == "ready" and r.flops > 0]
        if len(records) >= num_peers and _links_ready(records, min_links):
            return records, time.monotonic() - started
        if time.monotonic() > deadline:
            counts = [len(r.links) for r in records]
            raise TimeoutError(f"records' links {counts} did not reach {min_links} in {timeout_s:.0f}s")
        await asyncio.sleep(2.0)  # polling the DHT, bounded by the deadline


def _record_summary(r: PeerRecord) -> dict[str, Any]:
    return {
        "peer_id": r.peer_id,
        "flops": r.flops,
        "upload_mbps": r.upload_mbps,
        "download_mbps": r.download_mbps,
        "links": {link.peer_id: [link.up_mbps, link.down_mbps, link.rtt_ms] for link in r.links},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = JobSpec.model_validate_json(args.job)
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        records, waited_s = await _measured_records(
            client, args.num_peers, args.min_links, args.measure_timeout_s
        )
        t0 = time.process_time()
        planned = client.plan(records, base, min_stages=args.min_stages).assignment
        plan_cpu_s = time.process_time() - t0
        assert planned is not None
        used = [s.peer_id for c in planned for s in c]
        peer_ids = [r.peer_id for r in records]
        placements: dict[str, Assignment] = {"A": planned}
        if "C" in args.order:
            unlinked = client.plan(records, base, min_stages=args.min_stages, use_links=False).assignment
            assert unlinked is not None
            placements["C"] = unlinked
        for seed in args.seeds:
            placements[f"B{seed}"] = random_assignment(planned, peer_ids, seed)
        out: dict[str, Any] = {
            "records": [_record_summary(r) for r in records],
            "links_wait_s": waited_s,
            "plan_cpu_s": plan_cpu_s,
            "planned_peers": used,
            "placements": {k: [[s.model_dump() for s in c] for c in v] for k, v in placements.items()},
            "runs": [],
        }
        seeds = iter(args.seeds)
        for index, kind in enumerate(args.order):
            key = f"B{next(seeds)}" if kind == "B" else kind
            job = base.model_copy(
                update={"job_id": f"{base.job_id}-{index}-{key.lower()}", "assignment": placements[key]}
            )
            load_before = os.getloadavg()
            started = time.monotonic()
            await client.publish_job(job)
            final = await client.wait_for_job(job, timeout_s=args.run_timeout_s, poll_s=1.0)
            out["runs"].append(
                {
                    "index": index,
                    "kind": kind,
                    "placement": key,
                    "seed": int(key[1:]) if kind == "B" else None,
                    "wall_s": time.monotonic() - started,
                    "load_before": load_before,
                    "load_after": os.getloadavg(),
                    "metrics": [m.model_dump(mode="json") for m in final],
                }
            )
            # partial results survive a later failure (a small local file: blocking is harmless here)
            Path(args.out).write_text(json.dumps(out))  # noqa: ASYNC240
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--num-peers", type=int, required=True)
    parser.add_argument("--min-links", type=int, required=True, help="links each record must report")
    parser.add_argument("--min-stages", type=int, required=True)
    parser.add_argument("--job", required=True, help="JobSpec JSON (without assignment)")
    parser.add_argument("--order", nargs="+", choices=["A", "B", "C"], required=True)
    parser.add_argument("--seeds", nargs="+", type=int, required=True, help="one per B run")
    parser.add_argument("--measure-timeout-s", type=float, default=600)
    parser.add_argument("--run-timeout-s", type=float, default=900)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.order.count("B") != len(args.seeds):
        parser.error("give one seed per B run")
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
