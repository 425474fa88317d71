"""End to end, elastic: a job survives the SIGKILL of a stage and resumes with its state on the new plan.

Four peer CLI processes (and a stock hivemind-dht bootstrap) agree on two clusters x two stages for a job
published without an assignment that runs until stopped. Once it has clearly learned, the test SIGKILLs
the process group of the last stage of one cluster and measures:

- the time from the kill until the survivors train again on a newer plan (the job's progress record
  shows that plan's pipelines moved past their start), which must be under 30 s;
- the held-out loss at which the new plan resumes (each first stage evaluates right after restoring
  its state, and logs it) against the loss at the kill (within 10 %, not back at the initial loss) and
  against the last evaluation of the state that was handed over (within the evaluation's own noise).
  The re-plan keeps the other cluster whole (`planning.replan`); whether the lone survivor of the
  killed cluster joins it (that cluster then restarts with its state) or waits as a spare (it keeps
  training in place: its next evaluations are the loss on the new plan) is the cost model's call on
  the measured figures, so the test accepts both.

Then the owner stops the job (`stop_job`), and `wait_for_job` returns its done metrics.

A second test sends SIGTERM instead (a graceful leave): the peer announces draining, hands its stage
over and exits once the new plan no longer names it, within its 30 s drain grace; the job resumes without
it, not from the initial loss.
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

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm, PeerProcess
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.utils import wait_until
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG, PINNED_COMPUTE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

RUN_ID = "elastic"
INITIAL_LOSS = 2.30  # ln(10): ten digit classes, an untrained model
PEER_CONFIG = FAST_MEMBERSHIP_PEER_CONFIG + PINNED_COMPUTE  # two clusters x two stages, whatever the load
_RESUMED = re.compile(r"resumed at micro-batch (\d+): held-out loss ([0-9.]+)")
_EVALUATED = re.compile(r"\] micro-batch (\d+): held-out loss ([0-9.]+)")
_IN_PLACE = re.compile(r"plan moved to epoch (\d+); cluster unchanged")


async def wait_for(
    predicate: Callable[[], Awaitable[bool]], timeout_s: float, *, what: str, interval_s: float = 0.25
) -> None:
    await wait_until(predicate, timeout_s, interval_s=interval_s, message=what)  # stretched on a busy host


def logged_losses(peers: list[PeerProcess], pattern: re.Pattern[str]) -> list[tuple[int, float]]:
    """(data position, held-out loss) of every evaluation the pattern finds in the peers' logs."""
    return sorted((int(p), float(loss)) for peer in peers for p, loss in pattern.findall(peer.log()))


def log_sizes(peers: list[PeerProcess]) -> dict[int, int]:
    return {id(peer): len(peer.log()) for peer in peers}


def evaluated_since(
    peers: list[PeerProcess], sizes: dict[int, int], pattern: re.Pattern[str]
) -> list[tuple[int, float]]:
    """(data position, held-out loss) of the evaluations logged after `sizes` (from `log_sizes`)."""
    found = []
    for peer in peers:
        found += [(int(p), float(loss)) for p, loss in pattern.findall(peer.log()[sizes[id(peer)] :])]
    return sorted(found)


async def loss_on_the_new_plan(
    peers: list[PeerProcess], at_disturbance: dict[int, int], at_training_again: dict[int, int]
) -> list[tuple[int, float]]:
    """The held-out losses the new plan starts from: the resumptions logged since the disturbance (a
    restarted stage evaluates its restored state) and, for a cluster that kept training in place, its
    first evaluations logged since the job trained on the new plan."""

    def found() -> list[tuple[int, float]]:
        resumed = evaluated_since(peers, at_disturbance, _RESUMED)
        kept = evaluated_since(peers, at_training_again, _EVALUATED)
        return resumed + kept[:1]

    async def any_found() -> bool:
        return bool(found())

    await wait_for(any_found, 60, what="an evaluation on the new plan in the logs")
    return found()


def moved_in_place(peers: list[PeerProcess], epoch: int) -> int:
    """How many of `peers` moved a stage in place to a plan after `epoch`."""
    return sum(any(int(e) > epoch for e in _IN_PLACE.findall(peer.log())) for peer in peers)


def elastic_job() -> JobSpec:
    return JobSpec(
        job_id="elastic",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        until_stopped=True,
        min_stages=2,
        eval_every_steps=16,
        averaging_period_steps=8,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )


async def learned_on_one_plan(client: RunClient, job: JobSpec) -> list[StageMetrics]:
    """Wait until two clusters of two stages train the job on one plan and have clearly learned."""
    plan: list[StageMetrics] = []

    async def learned() -> bool:
        nonlocal plan
        plan = newest_epoch(await client.metrics(job_id=job.job_id))
        firsts = [m for m in plan if m.stage == 0]
        return (
            len(plan) == 4
            and len(firsts) == 2
            and all(m.eval_loss is not None and m.eval_loss < 0.6 * INITIAL_LOSS for m in firsts)
        )

    await wait_for(learned, 240, what="two clusters learning on one plan")
    assert {(m.cluster, m.stage) for m in plan} == {(0, 0), (0, 1), (1, 0), (1, 1)}, plan
    return plan


async def test_a_killed_stage_moves_the_job_to_a_new_plan_with_its_state(tmp_path: Path):
    config = tmp_path / "peer.toml"
    config.write_text(PEER_CONFIG)
    job = elastic_job()
    with LocalSwarm(
        4, run_id=RUN_ID, bootstrap="hivemind-dht", peer_args=["--config", str(config)], workdir=tmp_path
    ) as swarm:
        by_id: dict[str, PeerProcess] = {p.peer_id: p for p in swarm.peers if p.peer_id}
        assert len(by_id) == 4
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(4, timeout_s=90, measured=False)
            await client.publish_job(job)

            plan = await learned_on_one_plan(client, job)
            epoch = plan[0].epoch
            victim = by_id[next(m.peer_id for m in plan if m.cluster == 1 and m.stage == 1)]
            survivors = [p for p in swarm.peers if p is not victim]
            os.killpg(victim.popen.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            at_kill = log_sizes(survivors)
            victim.popen.wait(10)
            # the newest evaluation before the kill (each first stage logs one every 16 micro-batches)
            position_at_kill, loss_at_kill = logged_losses(survivors, _EVALUATED)[-1]

            async def training_again_on_a_new_plan() -> bool:
                progress = await client.progress(job.job_id)
                return progress is not None and progress.epoch > epoch and progress.all_started

            await wait_for(training_again_on_a_new_plan, 120, what="training on a plan without the victim")
            resumed_after_s = time.monotonic() - killed_at
            resumed = await loss_on_the_new_plan(survivors, at_kill, log_sizes(survivors))
            loss_after = max(loss for _, loss in resumed)
            # the surviving cluster trains on until the plan moves: the state handed over is the one of
            # its last evaluation before the resumption's position
            position_before, loss_before = max(
                e for e in logged_losses(survivors, _EVALUATED) if e[0] <= min(p for p, _ in resumed)
            )
            print(
                f"kill -> training on the new plan: {resumed_after_s:.1f}s; held-out loss at the kill "
                f"{loss_at_kill:.4f} (micro-batch {position_at_kill}), before the re-plan {loss_before:.4f} "
                f"(micro-batch {position_before}), on the new plan {resumed}; stages moved in place: "
                f"{moved_in_place(survivors, epoch)}"
            )

            await client.stop_job(job.job_id)
            final = await client.wait_for_job(job, timeout_s=120, poll_s=0.5)

        assert resumed_after_s < 30.0, resumed_after_s
        # not back at the initial loss: within 10 % of the loss at the kill (the surviving cluster trains on
        # until the plan moves, so it is usually lower) ...
        assert loss_after <= 1.10 * loss_at_kill, (loss_at_kill, resumed)
        # ... and the state handed over is the one trained until the re-plan (consecutive evaluations 16
        # micro-batches apart already differ by up to ~20 % here: 0.0877 -> 0.0731)
        assert loss_after <= 1.25 * loss_before, (loss_before, resumed)
        # it resumes near where it was (the data position lags the state by a metrics period at most)
        assert all(position > position_at_kill // 2 for position, _ in resumed)
        assert final
        assert victim.peer_id not in {m.peer_id for m in final}
        assert max(m.epoch for m in final) > epoch
        assert any(m.done for m in final if m.stage == 0), final


async def test_a_leaving_peer_hands_its_stage_over_and_exits_within_its_grace(tmp_path: Path):
    config = tmp_path / "peer.toml"
    config.write_text(PEER_CONFIG)
    job = elastic_job()
    with LocalSwarm(
        4, run_id=RUN_ID, bootstrap="hivemind-dht", peer_args=["--config", str(config)], workdir=tmp_path
    ) as swarm:
        by_id: dict[str, PeerProcess] = {p.peer_id: p for p in swarm.peers if p.peer_id}
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(4, timeout_s=90, measured=False)
            await client.publish_job(job)
            plan = await learned_on_one_plan(client, job)
            epoch = plan[0].epoch
            leaver = by_id[next(m.peer_id for m in plan if m.cluster == 1 and m.stage == 1)]
            survivors = [p for p in swarm.peers if p is not leaver]

            at_leave = log_sizes(survivors)
            leaver.popen.send_signal(signal.SIGTERM)  # the CLI's graceful leave
            asked_at = time.monotonic()
            position_at_leave, loss_at_leave = logged_losses(survivors, _EVALUATED)[-1]

            async def training_again_on_a_new_plan() -> bool:
                progress = await client.progress(job.job_id)
                return progress is not None and progress.epoch > epoch and progress.all_started

            await wait_for(training_again_on_a_new_plan, 120, what="training on a plan without the leaver")
            resumed_after_s = time.monotonic() - asked_at
            at_training_again = log_sizes(survivors)
            exit_code = await asyncio.to_thread(leaver.popen.wait, 60)
            exited_after_s = time.monotonic() - asked_at
            resumed = await loss_on_the_new_plan(survivors, at_leave, at_training_again)
            print(
                f"SIGTERM -> training on the new plan: {resumed_after_s:.1f}s, the leaver exited after "
                f"{exited_after_s:.1f}s (code {exit_code}); held-out loss at the signal {loss_at_leave:.4f} "
                f"(micro-batch {position_at_leave}), resumed at {resumed}"
            )
            log = leaver.log()
            await client.stop_job(job.job_id)
            final = await client.wait_for_job(job, timeout_s=120, poll_s=0.5)

        assert "leaving: announcing draining" in log
        assert exit_code == 0
        assert exited_after_s < 30.0 + 15.0  # the drain grace, plus closing the daemon and the DHT
        assert resumed
        assert all(loss < 0.5 * INITIAL_LOSS for _, loss in resumed)  # not back at the initial loss
        assert leaver.peer_id not in {m.peer_id for m in final}
