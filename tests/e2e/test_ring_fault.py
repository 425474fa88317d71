"""End to end, a fault: SIGKILL a ring member mid-round while two clusters train on the agreed plan.

Four peer CLI processes (and a stock hivemind-dht bootstrap) agree on a plan of two clusters x two
stages for a job published without an assignment; the clusters average every few steps. When the
victim (the last stage of one cluster) logs that it started round N, the test freezes its process
group (peer and daemon) with SIGSTOP, checks from its log that round N is still running there, and
SIGKILLs the group. Then:

- the victim's ring partners finish round N without it, within the ring's round deadline (or, when
  the victim's parts had all gone out before the freeze and round N completed, round N + 1);
- the other cluster keeps training (its first stage's step advances after the kill);
- the membership opens a newer epoch whose plan leaves the victim out, and the job runs to the end
  on it (a re-plan restarts the job, see `Peer._run_stage`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from ravnest_p2p.averaging import RingConfig
from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm, PeerProcess
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.replicas import FINAL_ROUND
from ravnest_p2p.utils import load_stretch, wait_until
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG, PINNED_COMPUTE

# slow-marked (make test-slow) on 2026-11-24: it failed 3 of about 8 runs that day on real product faults
# it exists to catch — a stall when the kill lands as the surviving first stage ran out of data (fixed:
# READY tells a restarted first stage where to number micro-batches from), a split vote on epoch 1 (two
# causes fixed in membership.agreement), and once a first stage ending 21 steps short (not explained).
# Session 10 ran it 13 times: the 5 failures were all the job's 200 s budget running out at host loads
# of 13-27 (training went on, slowly: no stall), hence the job budget below stretches with the load.
# Back in the default suite once it passes repeatedly beside the busy-loop `make test` runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RUN_ID = "ringfault"
PERIOD_STEPS = 8
# fast membership: a dead peer's record expires in 6 s, it is dropped 3 s later; compute pinned
PEER_CONFIG = FAST_MEMBERSHIP_PEER_CONFIG + PINNED_COMPUTE


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, *, what: str, interval_s: float = 0.5
) -> None:
    await wait_until(predicate, timeout_s, interval_s=interval_s, message=what)  # stretched on a busy host


def started_rounds(log: str, epoch: int) -> set[int]:
    rounds = {int(n) for n in re.findall(rf"epoch {epoch}: averaging round (\d+) started", log)}
    return rounds - {FINAL_ROUND}


def finished_rounds(log: str, epoch: int) -> dict[int, tuple[float, int, int]]:
    """Round index -> (seconds, fewest participants, replicas), from a peer's log."""
    pattern = rf"epoch {epoch}: averaging round (\d+) finished in ([0-9.]+)s with (\d+) of (\d+) replicas"
    return {int(n): (float(t), int(p), int(c)) for n, t, p, c in re.findall(pattern, log)}


async def test_sigkill_a_ring_member_mid_round(tmp_path: Path):
    config = tmp_path / "peer.toml"
    config.write_text(PEER_CONFIG)
    job = JobSpec(
        job_id="fault",
        model="digits_cnn",
        # a wide hidden layer makes a round take long enough to be caught in the middle on loopback
        model_params={"hidden_features": 4096},
        dataset="digits",
        batch_size=32,
        max_steps=640,
        num_epochs=60,
        min_stages=2,
        optimizer=OptimizerConfig(name="adam", lr=1e-3),
        averaging_period_steps=PERIOD_STEPS,
    )
    with LocalSwarm(
        4, run_id=RUN_ID, bootstrap="hivemind-dht", peer_args=["--config", str(config)], workdir=tmp_path
    ) as swarm:
        by_id: dict[str, PeerProcess] = {p.peer_id: p for p in swarm.peers if p.peer_id}
        assert len(by_id) == 4
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(4, timeout_s=90, measured=False)
            await client.publish_job(job)

            plan: list[StageMetrics] = []

            async def two_clusters_train_on_one_plan() -> bool:
                nonlocal plan
                epochs = {r.epoch for r in await client.peers()}
                plan = newest_epoch(await client.metrics(job_id=job.job_id))
                agreed = len(epochs) == 1 and bool(plan) and plan[0].epoch in epochs
                return agreed and len(plan) == 4 and all(m.step > 0 for m in plan)

            await wait_for(two_clusters_train_on_one_plan, 150, what="4 stages training on one plan")
            epoch = plan[0].epoch
            assert {(m.cluster, m.stage) for m in plan} == {(0, 0), (0, 1), (1, 0), (1, 1)}, plan
            victim = by_id[next(m.peer_id for m in plan if m.cluster == 1 and m.stage == 1)]
            # the other cluster's last stage shares the model's last layer with the victim: same ring
            partner = by_id[next(m.peer_id for m in plan if m.cluster == 0 and m.stage == 1)]
            other_first = next(m.peer_id for m in plan if m.cluster == 0 and m.stage == 0)

            # catch a round both are inside: freeze the victim, check it is still inside, kill it
            round_index = None
            deadline = time.monotonic() + 120
            while round_index is None:
                assert time.monotonic() < deadline, "no averaging round caught in progress"
                assert victim.popen.poll() is None, victim.log()[-2000:]
                vlog, plog = victim.log(), partner.log()
                inside = (
                    (started_rounds(vlog, epoch) & started_rounds(plog, epoch))
                    - set(finished_rounds(vlog, epoch))
                    - set(finished_rounds(plog, epoch))
                )
                if not inside:
                    await asyncio.sleep(0.01)
                    continue
                os.killpg(victim.popen.pid, signal.SIGSTOP)
                candidate = max(inside)
                # the logs lag the wire: a victim frozen after its last part went out has finished the
                # round for its partner (seen: the partner logged it with both replicas 0.96 s in), so
                # kill only if the partner, still running, cannot finish it within a grace period
                grace_end = time.monotonic() + 2.0
                while time.monotonic() < grace_end and candidate not in finished_rounds(partner.log(), epoch):
                    await asyncio.sleep(0.05)  # polling interval, bounded by the grace period
                done = finished_rounds(partner.log(), epoch) | finished_rounds(victim.log(), epoch)
                if candidate not in done:
                    round_index = candidate
                    os.killpg(victim.popen.pid, signal.SIGKILL)
                else:
                    os.killpg(victim.popen.pid, signal.SIGCONT)
            victim.popen.wait(10)
            killed_at = time.monotonic()
            print(f"killed {victim.name} in round {round_index}")

            async def other_first_step() -> int:
                now = await client.metrics(epoch=epoch, job_id=job.job_id)
                return max((m.step for m in now if m.peer_id == other_first), default=0)

            step_at_kill = await other_first_step()

            # the partner finishes the round without the victim, within the round deadline
            deadline_s = RingConfig().round_timeout_s
            result: tuple[float, int, int] | None = None

            async def partner_finishes_the_round() -> bool:
                nonlocal result
                result = finished_rounds(partner.log(), epoch).get(round_index)
                return result is not None

            await wait_for(
                partner_finishes_the_round, deadline_s + 10, what=f"the partner's round {round_index}"
            )
            assert result is not None
            if result[1:] == (2, 2):
                # legal on a busy host: every part of the victim's had gone out before the freeze and
                # the partner's log lagged past the grace period; its next round must go without it
                print(f"round {round_index} completed before the kill: {result}; checking the next one")

                async def partner_starts_a_later_round() -> bool:
                    nonlocal round_index
                    later = {n for n in started_rounds(partner.log(), epoch) if n > round_index}
                    if later:
                        round_index = min(later)
                    return bool(later)

                await wait_for(partner_starts_a_later_round, 60, what="the partner's next round")
                await wait_for(
                    partner_finishes_the_round, deadline_s + 10, what=f"the partner's round {round_index}"
                )
                assert result is not None
            round_s, participants, replicas = result
            assert round_s < deadline_s, result
            assert (participants, replicas) == (1, 2), result
            without_victim: list[StageMetrics] = []

            async def partner_reports_the_round() -> bool:
                nonlocal without_victim
                without_victim = [
                    m
                    for m in await client.metrics(epoch=epoch, job_id=job.job_id)
                    if m.peer_id == partner.peer_id
                    and m.last_round is not None
                    and m.last_round >= round_index
                ]
                return bool(without_victim)

            await wait_for(partner_reports_the_round, 30, what="the partner's round metrics")
            assert without_victim[0].last_round_participants == 1, without_victim  # of 2 clusters
            assert without_victim[0].last_round_s is not None
            assert without_victim[0].last_round_s < deadline_s

            # the other cluster keeps training: its first stage moves on by more than one period
            async def other_cluster_advances() -> bool:
                return await other_first_step() > step_at_kill + PERIOD_STEPS

            await wait_for(other_cluster_advances, 60, what="the other cluster to keep training")

            # a newer epoch plans without the victim, and the job runs to its end there
            async def replanned() -> bool:
                current = newest_epoch(await client.metrics(job_id=job.job_id))
                # a cluster that finishes the whole job before the re-plan never runs it again, and
                # the new plan would wait for it forever: the job must be long enough
                assert not any(m.done for m in current if m.epoch == epoch), "job ended before the re-plan"
                return bool(current) and current[0].epoch > epoch

            await wait_for(replanned, 90, what="a re-plan without the victim")
            replanned_after_s = time.monotonic() - killed_at
            # 640 micro-batches take ~100 s on a quiet host; stretched by the load (at most 6x)
            final = await client.wait_for_job(job, timeout_s=200 * load_stretch(), poll_s=1.0)
        summary = [(m.epoch, m.cluster, m.stage, m.step) for m in final]
        print(f"round {round_index}: partner {result}; re-planned after {replanned_after_s:.1f}s; {summary}")
        assert final[0].epoch > epoch
        assert victim.peer_id not in {m.peer_id for m in final}
        firsts = [m for m in final if m.stage == 0]
        assert firsts
        assert all(m.done and m.step == job.max_steps for m in firsts), firsts
        assert not [m for m in final if m.failed], final
