"""End to end: SIGTERM every peer of a running job, start them again with the same identities.

Four peer CLI processes (and a stock hivemind-dht bootstrap, which keeps the job and its progress on the
DHT while the peers are down) train a job on the agreed plan with a checkpoint every 16 optimizer steps,
each peer into its own `checkpoint_dir` (per-peer `--config` TOML). Once the job has clearly learned and
checkpointed, every peer gets SIGTERM; then all four start again with their identity keys and configs.
The test checks that the job trains again, that every stage resumes from one checkpoint step complete
across stages at most one checkpoint period before the stop (the held-out loss at the resumption is not
back at the initial loss, and near the loss at the stop), and that after the owner stops it
`wait_for_job` returns its done metrics with an accuracy at the level it had at the stop.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest

from ravnest_p2p.client import RunClient, newest_epoch
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import LocalSwarm, PeerProcess
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.transport import load_or_create_identity
from tests.e2e.test_elastic import INITIAL_LOSS, PEER_CONFIG, logged_losses, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Before the fix (21:33 UTC run): the plan agreed after the restart put peers on layers whose checkpoints
# were on other peers' disks, and only the own disk was read: resumed at held-out loss 2.2474 (initial 2.30)
# against 0.3601 at the stop. Now every stage resumes from the newest step complete across stages (own
# disk first, else fetched from the plan member that announced it).

RUN_ID = "fullrestart"
NUM_PEERS = 4
CHECKPOINT_EVERY_STEPS = 16
_RESUMED = re.compile(r"resumed at micro-batch (\d+): held-out loss ([0-9.]+)")
_EVALUATED = re.compile(r"\] micro-batch (\d+): held-out loss ([0-9.]+)")
_FROM_STEP = re.compile(r"layers \d+-\d+ from checkpoint step (\d+)")
# the first stage's optimizer steps (what the progress says) trail the last stage's by up to a window of
# micro-batches (3 x 2 - 2 = 4 here), and a stage may stop just before a checkpoint is due
_STEP_SLACK = 8
_ACCURACY_BAR = 0.9


def restart_job() -> JobSpec:
    return JobSpec(
        job_id="restart",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        until_stopped=True,
        min_stages=2,
        eval_every_steps=16,
        averaging_period_steps=8,
        checkpoint_every_steps=CHECKPOINT_EVERY_STEPS,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )


async def test_every_peer_restarted_resumes_the_job_from_its_checkpoints(tmp_path: Path):
    per_peer: list[list[str]] = []
    for i in range(NUM_PEERS):
        identity = load_or_create_identity(tmp_path / f"id{i}.key")
        config = tmp_path / f"peer{i}.toml"
        config.write_text(f'checkpoint_dir = "{tmp_path / f"ckpt{i}"}"\n' + PEER_CONFIG)
        per_peer.append(["--config", str(config), "--identity-path", str(identity.path)])
    job = restart_job()
    with LocalSwarm(
        NUM_PEERS, run_id=RUN_ID, bootstrap="hivemind-dht", per_peer_args=per_peer, workdir=tmp_path
    ) as swarm:
        async with await RunClient.connect(swarm.initial_peers, RUN_ID) as client:
            await client.wait_for_peers(NUM_PEERS, timeout_s=90, measured=False)
            await client.publish_job(job)

            async def learned_and_checkpointed() -> bool:
                plan = newest_epoch(await client.metrics(job_id=job.job_id))
                firsts = [m for m in plan if m.stage == 0]
                checkpoints = [
                    p for i in range(NUM_PEERS) for p in (tmp_path / f"ckpt{i}").rglob("*") if p.is_file()
                ]
                return (
                    len(plan) == NUM_PEERS
                    and len(firsts) == 2
                    and all(m.eval_loss is not None and m.eval_loss < 0.6 * INITIAL_LOSS for m in firsts)
                    and bool(checkpoints)
                )

            await wait_for(learned_and_checkpointed, 300, what="two clusters learning and checkpointing")
            at_stop = [m for m in newest_epoch(await client.metrics(job_id=job.job_id)) if m.stage == 0]
            accuracy_at_stop = min(m.eval_accuracy or 0.0 for m in at_stop)
            before = await client.progress(job.job_id)
            assert before is not None
            first_run: list[PeerProcess] = list(swarm.peers)
            for peer in first_run:
                peer.popen.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            codes = [await asyncio.to_thread(peer.popen.wait, 90) for peer in first_run]
            down_after_s = time.monotonic() - stopped_at
            position_at_stop, loss_at_stop = logged_losses(first_run, _EVALUATED)[-1]
            steps_at_stop = (await client.progress(job.job_id) or before).optimizer_steps

            restarted = [
                swarm._spawn(f"peer{i}-again", swarm._peer_argv(per_peer[i])) for i in range(NUM_PEERS)
            ]
            swarm.peers.extend(restarted)
            for peer in restarted:
                peer.wait_ready(60)
            started_at = time.monotonic()

            async def resumption_logged() -> bool:
                return bool(logged_losses(restarted, _RESUMED))

            await wait_for(resumption_logged, 240, what="a first stage's resumption after the restart")
            resumed_after_s = time.monotonic() - started_at
            resumed = logged_losses(restarted, _RESUMED)
            origins = [line for peer in restarted for line in peer.log().splitlines() if "state from" in line]
            steps_used = sorted({int(s) for peer in restarted for s in _FROM_STEP.findall(peer.log())})

            async def trained_on() -> bool:
                # 64 micro-batches past the stop, and on until an evaluation reached the accuracy bar: the
                # job is stopped by time, not by epochs, and on a busy host the first run stops it early
                # (once at 0.84 after 112 micro-batches)
                progress = await client.progress(job.job_id)
                if progress is None or progress.micro_batches <= position_at_stop + 64:
                    return False
                plan = newest_epoch(await client.metrics(job_id=job.job_id))
                firsts = [m for m in plan if m.stage == 0]
                return bool(firsts) and all((m.eval_accuracy or 0.0) > _ACCURACY_BAR for m in firsts)

            await wait_for(trained_on, 300, what="training on after the restart")
            after = await client.progress(job.job_id)
            await client.stop_job(job.job_id)
            final = await client.wait_for_job(job, timeout_s=180, poll_s=1.0)
        firsts = [m for m in final if m.stage == 0]
        print(
            f"full restart: peers down after {down_after_s:.1f}s (codes {codes}); training again "
            f"{resumed_after_s:.1f}s after the restart; held-out loss at the stop {loss_at_stop:.4f} "
            f"(micro-batch {position_at_stop}, {steps_at_stop} optimizer steps), resumed at {resumed}; "
            f"state origins {origins}; checkpoint steps {steps_used} ({steps_at_stop} at the stop); "
            f"accuracy at the stop {accuracy_at_stop:.4f}, final {[m.eval_accuracy for m in firsts]}"
        )
    assert after is not None
    assert all(loss < 0.5 * INITIAL_LOSS for _, loss in resumed), resumed  # not back at the start
    assert any("checkpoint" in line for line in origins), origins
    # every stage from one step, complete across stages, at most one checkpoint period before the stop
    assert len(steps_used) == 1, steps_used
    assert steps_used[0] % CHECKPOINT_EVERY_STEPS == 0
    assert steps_at_stop - steps_used[0] <= CHECKPOINT_EVERY_STEPS + _STEP_SLACK, (steps_used, steps_at_stop)
    assert all(loss < max(2 * loss_at_stop, loss_at_stop + 0.2) for _, loss in resumed), (
        resumed,
        loss_at_stop,
    )
    assert firsts
    assert all(m.done for m in firsts), final
    assert all(m.eval_accuracy is not None and m.eval_accuracy > _ACCURACY_BAR for m in firsts), firsts
    # the same level as at the stop (held-out accuracy moves by a point or two between evaluations)
    assert all(m.eval_accuracy is not None and m.eval_accuracy >= accuracy_at_stop - 0.03 for m in firsts), (
        accuracy_at_stop,
        firsts,
    )
