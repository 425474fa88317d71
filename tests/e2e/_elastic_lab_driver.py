"""The researcher of the elastic lab tests, run inside a lab namespace (the root namespace cannot reach
the peers): publish a job without an assignment, wait until two clusters learn on one agreed plan, then
disturb the swarm and measure how the job carries on.

Run as ``python -m tests.e2e._elastic_lab_driver --initial-peers M.. --run-id R --job JSON --logs DIR
--pids JSON --mode kill|join --out FILE`` from the repository root.

- ``kill``: SIGKILL the process group of one stage of cluster 1 (``--pids`` maps peer id -> pid of its
  process group leader) and measure the time until the job trains on a newer plan, and the held-out loss
  the new plan resumes at. Meanwhile it watches cluster 0's optimizer steps in the stages' published
  metrics (`StepWatch`): the longest time without a new step count around the re-plan, on the peers'
  own publication stamps (metrics every 2 s, so that is the resolution).
- ``join``: write ``DIR/join_now`` and let the test start one more peer; measure the time until a plan
  that names the joiner trains, and the loss it resumes at.

Either way the owner then stops the job and the driver writes what it measured (JSON) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.discovery import dht_time
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.utils import wait_until

INITIAL_LOSS = 2.30  # ln(10)
_RESUMED = re.compile(r"resumed at micro-batch (\d+): held-out loss ([0-9.]+)")
_IN_PLACE = re.compile(r"plan moved to epoch (\d+); cluster unchanged")
_EVALUATED = re.compile(r"\] micro-batch (\d+): held-out loss ([0-9.]+)")


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float, *, what: str) -> None:
    await wait_until(predicate, timeout_s, interval_s=0.25, message=what)  # stretched on a busy host


def logged(logs: list[Path], pattern: re.Pattern[str]) -> list[tuple[int, float]]:
    found = []
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        found += [(int(p), float(loss)) for p, loss in pattern.findall(text)]
    return sorted(found)


class StepWatch:
    """Optimizer-step counts of some stages, as their metrics report them, by publication time."""

    def __init__(self, peer_ids: set[str]) -> None:
        self.seen: dict[str, dict[float, int]] = {pid: {} for pid in peer_ids}
        self.epoch_at: dict[float, int] = {}

    def observe(self, metrics: list[StageMetrics]) -> None:
        for m in metrics:
            if m.peer_id in self.seen:
                self.seen[m.peer_id][m.updated_at] = m.optimizer_steps
                self.epoch_at[m.updated_at] = m.epoch

    def first_on_epoch_after(self, epoch: int) -> float | None:
        """The first publication of a watched stage on a plan after `epoch` (an in-place move publishes
        at once)."""
        return min((at for at, e in self.epoch_at.items() if e > epoch), default=None)

    def series(self, origin: float) -> dict[str, list[tuple[float, int]]]:
        return {
            pid: [(round(at - origin, 2), steps) for at, steps in sorted(seen.items())]
            for pid, seen in self.seen.items()
        }

    def changes(self, peer_id: str) -> list[float]:
        """Publication times at which the peer's step count differed from its previous publication."""
        out, previous = [], None
        for at, steps in sorted(self.seen[peer_id].items()):
            if steps != previous:
                out.append(at)
            previous = steps
        return out

    def longest_gap_s(self, start: float, end: float) -> float:
        """The longest stretch without a new step count, of any watched stage, overlapping [start, end]."""
        worst = 0.0
        for pid in self.seen:
            times = self.changes(pid)
            for a, b in zip(times, [*times[1:], end], strict=True):
                if b >= start and a <= end:
                    worst = max(worst, b - a)
        return worst

    def median_interval_s(self, before: float) -> float:
        gaps = sorted(
            b - a for pid in self.seen for a, b in itertools.pairwise(self.changes(pid)) if b <= before
        )
        return gaps[len(gaps) // 2] if gaps else float("nan")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    job = JobSpec.model_validate_json(args.job)
    pids: dict[str, int] = json.loads(args.pids)
    logs_dir = Path(args.logs)
    log_of = {peer_id: logs_dir / f"peer{i}.log" for i, peer_id in enumerate(pids)}
    result: dict[str, Any] = {"mode": args.mode}
    async with await RunClient.connect(args.initial_peers, args.run_id) as client:
        await client.wait_for_peers(len(pids), timeout_s=180, measured=False)
        await client.publish_job(job)
        published_at = time.monotonic()
        plan: list[StageMetrics] = []

        async def learned() -> bool:
            nonlocal plan
            plan = newest_epoch(await client.metrics(job_id=job.job_id))
            firsts = [m for m in plan if m.stage == 0]
            # two clusters of at least min_stages; a peer may be left spare: on a busy host the measured
            # latencies (14-35 ms at load 15 on 0.1 ms links) can make a 4 + 3 plan with a spare estimate
            # faster than 4 + 4 (the planner's call, not what this test checks)
            return (
                len(firsts) == 2
                and len(plan) >= 2 * job.min_stages
                and all(m.eval_loss is not None and m.eval_loss < args.learned_loss for m in firsts)
            )

        await wait_for(learned, 420, what="two clusters learning on one plan")
        epoch = plan[0].epoch
        result["plan_before"] = sorted((m.cluster, m.stage, m.peer_id) for m in plan)
        result["learned_after_s"] = time.monotonic() - published_at
        kept_cluster = {m.peer_id for m in plan if m.cluster == 0}
        watch = StepWatch(kept_cluster)

        async def watch_steps() -> None:
            while True:
                with contextlib.suppress(Exception):
                    watch.observe(await client.metrics(job_id=job.job_id))
                await asyncio.sleep(0.25)

        watcher = asyncio.create_task(watch_steps())

        async def baseline() -> bool:  # a few steps of cluster 0 seen before the disturbance
            return all(len(watch.changes(pid)) >= 3 for pid in kept_cluster)

        await wait_for(baseline, 60, what="cluster 0's steps in its metrics")
        disturbed_dht_time = dht_time()
        if args.mode == "kill":
            last = max(m.stage for m in plan if m.cluster == 1)
            victim = next(m.peer_id for m in plan if m.cluster == 1 and m.stage == last)
            os.killpg(pids[victim], signal.SIGKILL)
            result["victim"] = victim
            watched = [path for peer_id, path in log_of.items() if peer_id != victim]
        else:
            (logs_dir / "join_now").write_text("1")
            watched = list(log_of.values()) + [logs_dir / "joiner.log"]
        disturbed_at = time.monotonic()
        position_at, loss_at = logged(watched, _EVALUATED)[-1]

        async def training_on_a_new_plan() -> bool:
            progress = await client.progress(job.job_id)
            return progress is not None and progress.epoch > epoch and progress.all_started

        await wait_for(training_on_a_new_plan, 180, what="training on a new plan")
        result["training_again_after_s"] = time.monotonic() - disturbed_at
        trained_again_dht_time = dht_time()

        def resumed() -> list[tuple[int, float]]:
            return [r for r in logged(watched, _RESUMED) if r[0] > position_at // 2]

        async def resumption_logged() -> bool:
            return bool(resumed())

        await wait_for(resumption_logged, 60, what="a first stage's resumption in the logs")
        result["resumed"] = resumed()
        result["loss_at_disturbance"] = loss_at
        result["position_at_disturbance"] = position_at
        first_resumed = min(p for p, _ in result["resumed"])
        result["loss_before_replan"] = max(e for e in logged(watched, _EVALUATED) if e[0] <= first_resumed)[1]
        new_plan = newest_epoch(await client.metrics(job_id=job.job_id))
        result["plan_after"] = sorted((m.cluster, m.stage, m.peer_id) for m in new_plan if m.epoch > epoch)
        # cluster 0 around the re-plan: from 5 s before the disturbance until 5 s after training again
        await asyncio.sleep(max(0.0, trained_again_dht_time + 5.0 - dht_time()))
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        result["kept_cluster"] = [m.peer_id for m in sorted(plan, key=lambda m: m.stage) if m.cluster == 0]
        result["kept_longest_gap_s"] = watch.longest_gap_s(
            disturbed_dht_time - 5.0, trained_again_dht_time + 5.0
        )
        # the same around the moment cluster 0 moved to the new plan only (the kill itself also stalls
        # it a while: its averaging partner in the killed cluster is gone until the round's deadline)
        moved_at = watch.first_on_epoch_after(epoch)
        result["kept_moved_after_s"] = None if moved_at is None else moved_at - disturbed_dht_time
        result["kept_longest_gap_at_move_s"] = (
            None if moved_at is None else watch.longest_gap_s(moved_at - 10.0, moved_at + 10.0)
        )
        result["kept_steps"] = watch.series(disturbed_dht_time)
        result["kept_median_interval_s"] = watch.median_interval_s(disturbed_dht_time)
        result["kept_moved_in_place"] = sorted(
            peer_id
            for peer_id in kept_cluster
            if any(int(e) > epoch for e in _IN_PLACE.findall(log_of[peer_id].read_text(errors="replace")))
        )
        # train on for a while on the new plan, then stop and collect the done metrics
        await asyncio.sleep(args.train_on_s)
        await client.stop_job(job.job_id)
        final = await client.wait_for_job(job, timeout_s=180, poll_s=1.0)
        result["final"] = [m.model_dump(mode="json") for m in final]
        result["epoch_before"] = epoch
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--pids", required=True, help="JSON: peer id -> pid, in peer index order")
    parser.add_argument("--logs", required=True)
    parser.add_argument("--mode", choices=("kill", "join"), required=True)
    parser.add_argument("--learned-loss", type=float, default=0.6 * INITIAL_LOSS)
    parser.add_argument("--train-on-s", type=float, default=10.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    Path(args.out).write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
