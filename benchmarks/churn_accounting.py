"""Pure parts of the churn soak: the churn schedule, and what a timeline of progress polls says about the
samples that reached the final model.

What the progress record counts (`training.progress`, `training.runner.StageRunner.progress`): every
cluster's first stage publishes, under its own signed subkey, the plan epoch it trains on, the data
position the epoch's run began at (``epoch_start``) and its data position now (``micro_batches``:
micro-batches this cluster fed since the job began, over every plan). On a new plan every stage of every
cluster restarts (`training.supervisor`, known limit) and resumes at the furthest position any record
shows (`ProgressView.micro_batches`, `role_for`: ``data_start``), with the state of the freshest replica
(`resume.freshest_first`). So work a cluster did past that position, or that no record reported before the
plan moved, is rolled back: the next plan's weights do not hold it and its position does not count it.

Samples that reached the final model (`useful_samples`), over the plan epochs e seen in the window, with
S_next the next epoch's start (the last epoch: no cap), and for each run r of a cluster c on epoch e
(a stage restarted on the same plan starts a new run, at the job's furthest position then) its start
s_r and the furthest position end_r it reported before the window closed::

    sum_e sum_c sum_r max(0, min(end_r, S_next) - s_r) * batch_size  -  tails

Only one cluster's replica (the furthest, the one the next plan takes its state from) carries its work
since the last averaging round into the next plan; every other cluster of an epoch that a re-plan ended
loses that tail, up to one averaging period: ``tails`` deducts min(its count, averaging_period_steps)
micro-batches for each of them, and for the furthest too when one of its members left (its layers then
come from a replica). That is an upper bound on the lost tails, so the count is conservative.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ChurnEvent",
    "EpochAccount",
    "churn_schedule",
    "loss_points",
    "stalled_s",
    "useful_curve",
    "useful_samples",
]


@dataclass(frozen=True)
class ChurnEvent:
    """One change of the swarm, `at_s` seconds after the job started training.

    Attributes:
        at_s: time after t0.
        action: ``kill`` (SIGKILL of the peer's process group), ``term`` (SIGTERM: a graceful leave) or
            ``join`` (restart the peer that left longest ago, same identity).
    """

    at_s: float
    action: str


def churn_schedule(*, seed: int, duration_s: float, mean_interval_s: float = 60.0) -> list[ChurnEvent]:
    """Events in [0, duration_s): leave, join, leave, ... (leaves alternate SIGKILL and SIGTERM).

    Intervals are uniform in [0.5, 1.5] x `mean_interval_s` (mean `mean_interval_s`), from `seed`.
    """
    rng = random.Random(seed)
    events: list[ChurnEvent] = []
    at_s = 0.0
    leaves = 0
    while True:
        at_s += rng.uniform(0.5, 1.5) * mean_interval_s
        if at_s >= duration_s:
            return events
        if len(events) % 2 == 0:
            events.append(ChurnEvent(at_s, "kill" if leaves % 2 == 0 else "term"))
            leaves += 1
        else:
            events.append(ChurnEvent(at_s, "join"))


@dataclass
class EpochAccount:
    """One plan epoch: its start position, each run's furthest position, members.

    A cluster may run more than once on one epoch: the supervisor restarts a failed stage on the same
    plan, at the job's furthest position then (`role_for`'s ``data_start``), which can be past where
    this cluster got. Each (cluster, start) is one run; positions it skipped were never trained here.
    """

    epoch: int
    start: int = 0
    runs: dict[tuple[int, int], int] = field(default_factory=dict)  # (cluster, run start) -> furthest
    members: dict[int, set[str]] = field(default_factory=dict)
    first_advance_t: float | None = None  # first poll showing a cluster past its run's start
    last_advance_t: float | None = None  # last poll at which a run's position grew

    @property
    def ends(self) -> dict[int, int]:
        """Furthest position per cluster."""
        out: dict[int, int] = {}
        for (c, _), end in self.runs.items():
            out[c] = max(out.get(c, 0), end)
        return out


def _epochs(polls: Sequence[Mapping[str, Any]], until_t: float) -> dict[int, EpochAccount]:
    epochs: dict[int, EpochAccount] = {}
    for line in polls:
        if line.get("kind") != "poll" or line["t"] > until_t:
            continue
        for r in line["progress"]:
            acc = epochs.setdefault(r["epoch"], EpochAccount(r["epoch"], start=r["epoch_start"]))
            acc.start = min(acc.start, r["epoch_start"])
            run = (r["cluster"], r["epoch_start"])
            before = acc.runs.get(run, r["epoch_start"])
            if r["micro_batches"] > before:
                acc.last_advance_t = line["t"]
                if acc.first_advance_t is None:
                    acc.first_advance_t = line["t"]
            acc.runs[run] = max(before, r["micro_batches"])
        for plan_epoch, cluster, _stage, peer_id in line.get("plan", []):
            if plan_epoch in epochs:
                epochs[plan_epoch].members.setdefault(cluster, set()).add(peer_id)
    return epochs


def useful_samples(
    polls: Sequence[Mapping[str, Any]], *, until_t: float, batch_size: int, averaging_period_steps: int
) -> dict[str, Any]:
    """Samples in the final model at `until_t` (module docstring), and what was trained but rolled back.

    Returns:
        ``useful``: samples counted; ``trained``: samples any cluster reported feeding (every epoch,
        every cluster's runs, each up to its furthest position); ``rolled_back``: trained - useful;
        ``epochs``: one row per plan epoch (start, ends, counted micro-batches).
    """
    epochs = _epochs(polls, until_t)
    order = sorted(epochs)
    useful_mb = trained_mb = 0
    rows = []
    for i, e in enumerate(order):
        acc = epochs[e]
        nxt = epochs[order[i + 1]] if i + 1 < len(order) else None
        cap = nxt.start if nxt is not None else None
        counted: dict[int, int] = {}
        for (c, start), end in acc.runs.items():
            counted[c] = counted.get(c, 0) + max(0, (end if cap is None else min(end, cap)) - start)
            trained_mb += max(0, end - start)
        tails = 0
        if nxt is not None and counted:
            ends = acc.ends
            furthest = min(ends, key=lambda c: (-ends[c], c))
            survivors = set().union(*nxt.members.values()) if nxt.members else None
            for c, n in counted.items():
                intact = survivors is None or acc.members.get(c, set()) <= survivors
                if c != furthest or not intact:
                    tails += min(n, averaging_period_steps)
        useful_mb += sum(counted.values()) - tails
        rows.append(
            {
                "epoch": e,
                "start": acc.start,
                "ends": dict(sorted(acc.ends.items())),
                "runs": sorted([c, start, end] for (c, start), end in acc.runs.items()),
                "counted_micro_batches": sum(counted.values()) - tails,
                "tails_deducted": tails,
                "first_advance_t": acc.first_advance_t,
                "last_advance_t": acc.last_advance_t,
            }
        )
    return {
        "useful": useful_mb * batch_size,
        "trained": trained_mb * batch_size,
        "rolled_back": (trained_mb - useful_mb) * batch_size,
        "epochs": rows,
    }


def useful_curve(
    polls: Sequence[Mapping[str, Any]],
    *,
    t0: float,
    until_t: float,
    batch_size: int,
    averaging_period_steps: int,
) -> list[tuple[float, int]]:
    """(seconds after t0, samples that would be in the model if the window closed then), one per poll."""
    times = [line["t"] for line in polls if line.get("kind") == "poll" and line["t"] <= until_t]
    return [
        (
            t - t0,
            useful_samples(
                polls, until_t=t, batch_size=batch_size, averaging_period_steps=averaging_period_steps
            )["useful"],
        )
        for t in times
    ]


def loss_points(polls: Sequence[Mapping[str, Any]], *, t0: float) -> list[tuple[float, float]]:
    """(seconds after t0, held-out loss) of every new evaluation a first stage published, in time order."""
    seen: set[tuple[int, int, int, float]] = set()
    points = []
    for line in polls:
        if line.get("kind") != "poll":
            continue
        for m in line["evals"]:
            if m["eval_loss"] is None:
                continue
            key = (m["epoch"], m["cluster"], m["step"], m["eval_loss"])
            if key not in seen:
                seen.add(key)
                points.append((line["t"] - t0, float(m["eval_loss"])))
    return points


def stalled_s(polls: Sequence[Mapping[str, Any]], *, t0: float, until_t: float, gap_s: float = 6.0) -> float:
    """Seconds of [t0, until_t] in gaps longer than `gap_s` between two polls at which some cluster's
    reported position grew (records are republished every 2 s: shorter gaps are polling noise)."""
    furthest: dict[tuple[int, int], int] = {}
    advances = [t0]
    for line in polls:
        if line.get("kind") != "poll" or not t0 <= line["t"] <= until_t:
            continue
        grew = False
        for r in line["progress"]:
            key = (r["epoch"], r["cluster"])
            if r["micro_batches"] > max(furthest.get(key, r["epoch_start"]), r["epoch_start"]):
                grew = True
            furthest[key] = max(furthest.get(key, 0), r["micro_batches"])
        if grew:
            advances.append(line["t"])
    advances.append(until_t)
    return sum(b - a for a, b in itertools.pairwise(advances) if b - a > gap_s)
