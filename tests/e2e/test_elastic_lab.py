"""End to end, elastic, on the lab: peer processes in their own network namespaces behind 100 Mbit/s
links agree on a plan of two clusters for a job published without an assignment, then the swarm changes
under the running job.

- Kill -9 one stage: the survivors train again on a new plan within 30 s of the kill (the job's progress
  record shows the new plan's pipelines moved past their start), the held-out loss the new plan resumes
  at is within 10 % of the loss at the kill (not back at the initial loss), and `wait_for_job` returns
  the done metrics after the owner stops the job. The other cluster is kept whole by the re-plan
  (`planning.replan`) and keeps training in place: no stage of it restarts, and its longest time without
  a new optimizer step around the re-plan stays within a bound scaled by its own step cadence.
- A peer joins mid-job: the swarm re-plans with it, it receives a stage and its state (the new plan
  names it and resumes near the loss before the join, not at the initial loss).

The researcher runs inside the lab (`tests.e2e._elastic_lab_driver`): the root namespace cannot reach
the peers. Both tests print what they measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.throttle import thread_env
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.transport import load_or_create_identity
from tests.e2e._config import FAST_MEMBERSHIP_PEER_CONFIG
from tests.integration.lab._support import assert_no_leftovers, requires_netns, run_tag, unique_prefix

pytestmark = [pytest.mark.slow, *requires_netns, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PORT = 31447
LINK_MBPS = 100.0
INITIAL_LOSS = 2.30  # ln(10): ten digit classes, an untrained model
PEER_CONFIG = FAST_MEMBERSHIP_PEER_CONFIG


def elastic_job(min_stages: int) -> JobSpec:
    return JobSpec(
        job_id="elasticlab",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        until_stopped=True,
        min_stages=min_stages,
        eval_every_steps=16,
        averaging_period_steps=8,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )


def run_on_the_lab(
    tmp_path: Path, *, num_peers: int, mode: str, run_id: str, min_stages: int
) -> dict[str, Any]:
    """Start `num_peers` peers (plus, for ``join``, one more on the driver's cue) and the driver."""
    total = num_peers + (1 if mode == "join" else 0)
    ids = [load_or_create_identity(tmp_path / f"id{i}.key") for i in range(total)]
    config = tmp_path / "peer.toml"
    config.write_text(PEER_CONFIG)
    link = {"upload_mbps": LINK_MBPS, "download_mbps": LINK_MBPS}
    peers = [{"name": f"s{i}", **link} for i in range(total)]
    profile = parse_profile(
        {"run_id": run_id, "shaping": "htb", "peers": [*peers, {"name": "researcher", **link}]}, source="test"
    )
    prefix = unique_prefix()
    out = tmp_path / "driver.json"
    with NetnsLab(profile, prefix=prefix) as lab:
        maddrs = [f"/ip4/{lab.address_of(i)}/tcp/{PORT}/p2p/{ids[i].peer_id}" for i in range(total)]

        def start(i: int, log: Path) -> int:
            addr = f"/ip4/{lab.address_of(i)}/tcp/{PORT}"
            argv = [sys.executable, "-m", "ravnest_p2p.peer", "--run-id", run_id, "--config", str(config)]
            argv += ["--identity-path", str(ids[i].path), "--host-maddrs", addr, "--announce-maddrs", addr]
            if i > 0:
                argv += ["--initial-peers", maddrs[0]]
            return lab.run_in_ns(i, argv, env=thread_env(1), log_path=log).pid

        pids: dict[str, int] = {}
        for i in range(num_peers):
            log = tmp_path / f"peer{i}.log"
            pids[ids[i].peer_id] = start(i, log)
            if i == 0:
                poll_until(
                    lambda path=log: "join with" in path.read_text(errors="replace"), 90, what="peer 0"
                )
        argv = [sys.executable, "-m", "tests.e2e._elastic_lab_driver", "--initial-peers", *maddrs[:num_peers]]
        argv += ["--run-id", run_id, "--job", elastic_job(min_stages).model_dump_json(), "--out", str(out)]
        argv += ["--pids", json.dumps(pids), "--logs", str(tmp_path), "--mode", mode]
        driver = lab.run_in_ns(total, argv, env=thread_env(1), log_path=tmp_path / "driver.log", cwd=REPO)
        if mode == "join":
            poll_until(
                lambda: (tmp_path / "join_now").exists() or driver.poll() is not None,
                600,
                what="the join cue",
            )
            if driver.poll() is None:
                start(num_peers, tmp_path / "joiner.log")
        poll_until(lambda: driver.poll() is not None, 840, what="the driver", interval_s=1)
        logs = {p.stem: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
        assert driver.returncode == 0, {name: text[-3000:] for name, text in logs.items()}
        started = lab.pids
    assert_no_leftovers(prefix, started)
    result: dict[str, Any] = json.loads(out.read_text())
    result["joiner"] = ids[num_peers].peer_id if mode == "join" else None
    return result


def report(result: dict[str, Any]) -> list[StageMetrics]:
    final = [StageMetrics.model_validate(m) for m in result["final"]]
    firsts = [m for m in final if m.stage == 0 and m.epoch == max(f.epoch for f in final)]
    print(
        f"{result['mode']}: plan before {len(result['plan_before'])} stages, "
        f"after {len(result['plan_after'])}; "
        f"learned after {result['learned_after_s']:.0f}s; training on the new plan "
        f"{result['training_again_after_s']:.1f}s after the disturbance; held-out loss at it "
        f"{result['loss_at_disturbance']:.4f} (micro-batch {result['position_at_disturbance']}), before the "
        f"re-plan {result['loss_before_replan']:.4f}, resumed at {result['resumed']}; final accuracy "
        f"{[m.eval_accuracy for m in firsts]}; cluster 0 moved in place on "
        f"{len(result['kept_moved_in_place'])}/{len(result['kept_cluster'])} stages, its longest time "
        f"without a new optimizer step {result['kept_longest_gap_s']:.1f}s from 5 s before the disturbance "
        f"until 5 s after training again, {result['kept_longest_gap_at_move_s']} s within 10 s of its "
        f"move to the new plan ({result['kept_moved_after_s']} s after the disturbance); median between "
        f"publications {result['kept_median_interval_s']:.1f}s"
    )
    print("cluster 0's (seconds since the disturbance, optimizer steps):", result["kept_steps"])
    return final


def near_the_last_evaluation(loss: float) -> float:
    """A bound on the loss a new plan resumes at, given the last evaluation of the state handed over.

    Consecutive evaluations 16 micro-batches apart differ by up to ~20 %, and more near convergence: a
    lab join resumed at 0.0602 after a last evaluation of 0.0446 (35 %, both at 98.6 % accuracy). The
    bound is relative, with a small absolute slack; state from the initial weights scores ~2.3, and
    state from the start of the run ~0.3.
    """
    return max(1.25 * loss, loss + 0.03)


def test_kill_9_of_a_stage_on_the_lab_resumes_within_30s_near_the_loss(tmp_path: Path):
    result = run_on_the_lab(tmp_path, num_peers=8, mode="kill", run_id=f"elab-kill{run_tag()}", min_stages=3)
    final = report(result)
    assert result["training_again_after_s"] < 30.0, result
    # every survivor that trained before trains again: 7 peers make two clusters of at least 3 stages
    # (4 + 3); with a spare before the kill (a busy host's plan), the spare may take the victim's place
    assert len(result["plan_after"]) >= len(result["plan_before"]) - 1, result["plan_after"]
    loss_after = max(loss for _, loss in result["resumed"])
    # within 10 % of the loss at the kill (the surviving cluster trains on until the plan moves, so it is
    # usually lower), and near the last evaluation of the state handed over (consecutive evaluations 16
    # micro-batches apart differ by up to ~20 %)
    assert loss_after <= 1.10 * result["loss_at_disturbance"], result
    assert loss_after <= near_the_last_evaluation(result["loss_before_replan"]), result
    assert loss_after < 0.5 * INITIAL_LOSS
    assert result["victim"] not in {p for _, _, p in result["plan_after"]}
    # the cluster without the victim is kept whole (same peers in the same order) and keeps training:
    # every stage moves in place, and its steps never stall for long around the move (metrics are
    # published every 2 s; the bound scales with the cadence seen before the kill, for a busy host).
    # The kill itself stalls it up to an averaging round's deadline (its ring partner is gone): that is
    # reported, not bounded here.
    kept = result["kept_cluster"]
    clusters_after: dict[int, list[str]] = {}
    for cluster, _, peer_id in result["plan_after"]:
        clusters_after.setdefault(cluster, []).append(peer_id)
    assert kept in clusters_after.values(), result["plan_after"]
    assert result["kept_moved_in_place"] == sorted(kept), result
    assert result["kept_longest_gap_at_move_s"] is not None, result
    assert result["kept_longest_gap_at_move_s"] < max(10.0, 4 * result["kept_median_interval_s"]), result
    assert final
    assert any(m.done for m in final if m.stage == 0), final
    assert result["victim"] not in {m.peer_id for m in final}


def test_a_peer_joining_mid_job_on_the_lab_receives_a_stage_and_its_state(tmp_path: Path):
    result = run_on_the_lab(tmp_path, num_peers=7, mode="join", run_id=f"elab-join{run_tag()}", min_stages=3)
    final = report(result)
    assert result["joiner"] in {p for _, _, p in result["plan_after"]}, result
    loss_after = max(loss for _, loss in result["resumed"])
    assert loss_after <= 1.10 * result["loss_at_disturbance"], result
    assert loss_after <= near_the_last_evaluation(result["loss_before_replan"]), result
    assert loss_after < 0.5 * INITIAL_LOSS
    assert result["joiner"] in {m.peer_id for m in final if m.done}, final
