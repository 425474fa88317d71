"""The churn soak's accounting: schedule shape, and samples counted across re-plans."""

from __future__ import annotations

import itertools
from typing import Any

from benchmarks.churn_accounting import churn_schedule, loss_points, stalled_s, useful_samples


def record(epoch: int, cluster: int, start: int, position: int) -> dict[str, Any]:
    return {"epoch": epoch, "cluster": cluster, "epoch_start": start, "micro_batches": position}


def poll(t: float, *records: dict[str, Any], plan: list[Any] | None = None) -> dict[str, Any]:
    return {"kind": "poll", "t": t, "progress": list(records), "evals": [], "plan": plan or []}


def plan(epoch: int, clusters: dict[int, list[str]]) -> list[Any]:
    return [[epoch, c, s, p] for c, peers in clusters.items() for s, p in enumerate(peers)]


def test_schedule_alternates_leave_and_join_and_kill_and_term():
    events = churn_schedule(seed=3, duration_s=3600, mean_interval_s=60)
    actions = [e.action for e in events]
    assert actions[:4] == ["kill", "join", "term", "join"]
    assert all(a == "join" for a in actions[1::2])
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(events)]
    assert all(30 <= g <= 90 for g in gaps)
    assert 50 < sum(gaps) / len(gaps) < 70
    assert churn_schedule(seed=3, duration_s=3600) == events  # seeded


def test_undisturbed_counts_every_cluster_position():
    polls = [
        poll(1, record(1, 0, 0, 10), record(1, 1, 0, 8)),
        poll(3, record(1, 0, 0, 20), record(1, 1, 0, 18)),
    ]
    acc = useful_samples(polls, until_t=10, batch_size=2, averaging_period_steps=8)
    assert acc["useful"] == acc["trained"] == (20 + 18) * 2
    assert acc["rolled_back"] == 0


def test_a_replan_caps_each_cluster_at_the_next_start_and_deducts_lost_tails():
    members = {0: ["a", "b"], 1: ["c", "d"]}
    polls = [
        poll(1, record(1, 0, 0, 50), record(1, 1, 0, 40), plan=plan(1, members)),
        # cluster 0 reported 60 (past the next start), cluster 1 broke at 40; the new plan starts at 55
        poll(2, record(1, 0, 0, 60), record(1, 1, 0, 40), plan=plan(1, members)),
        poll(5, record(2, 0, 55, 55), record(2, 1, 55, 55), plan=plan(2, {0: ["a", "b"], 1: ["c", "e"]})),
        poll(7, record(2, 0, 55, 75), record(2, 1, 55, 65), plan=plan(2, {0: ["a", "b"], 1: ["c", "e"]})),
    ]
    acc = useful_samples(polls, until_t=100, batch_size=1, averaging_period_steps=8)
    # epoch 1: cluster 0 (furthest, intact) 55, cluster 1 40 - one period; epoch 2: 20 + 10
    assert acc["useful"] == 55 + (40 - 8) + 20 + 10
    assert acc["trained"] == 60 + 40 + 20 + 10
    assert [row["epoch"] for row in acc["epochs"]] == [1, 2]
    # the window closes before the re-plan: nothing is capped
    early = useful_samples(polls, until_t=2, batch_size=1, averaging_period_steps=8)
    assert early["useful"] == 100


def test_the_furthest_cluster_loses_its_tail_too_when_a_member_left():
    polls = [
        poll(1, record(1, 0, 0, 50), record(1, 1, 0, 40), plan=plan(1, {0: ["a", "b"], 1: ["c", "d"]})),
        poll(5, record(2, 0, 50, 52), plan=plan(2, {0: ["b", "c", "d"]})),
    ]
    acc = useful_samples(polls, until_t=100, batch_size=1, averaging_period_steps=8)
    assert acc["useful"] == (50 - 8) + (40 - 8) + 2


def test_stalls_and_losses():
    polls = [poll(t, record(1, 0, 0, t)) for t in (1, 2, 3)]
    polls += [poll(20, record(2, 0, 3, 3)), poll(21, record(2, 0, 3, 5))]
    assert stalled_s(polls, t0=0, until_t=22) == 21 - 3
    evals = [{"epoch": 1, "cluster": 0, "step": 16, "eval_loss": 0.5, "eval_accuracy": 0.9}]
    lines = [{**poll(1), "evals": evals}, {**poll(3), "evals": evals}]
    assert loss_points(lines, t0=0) == [(1, 0.5)]


def test_a_restart_on_the_same_plan_counts_only_what_each_run_trained():
    # cluster 0 broke at 30, restarted on epoch 1 at the job's furthest position (50) and trained to 60
    polls = [
        poll(1, record(1, 0, 0, 30), record(1, 1, 0, 40)),
        poll(2, record(1, 0, 0, 30), record(1, 1, 0, 50)),
        poll(3, record(1, 0, 50, 50), record(1, 1, 0, 55)),
        poll(4, record(1, 0, 50, 60), record(1, 1, 0, 58)),
    ]
    acc = useful_samples(polls, until_t=10, batch_size=1, averaging_period_steps=8)
    assert acc["useful"] == acc["trained"] == 30 + 10 + 58
    assert acc["epochs"][0]["runs"] == [[0, 0, 30], [0, 50, 60], [1, 0, 58]]
