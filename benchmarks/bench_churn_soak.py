"""Churn soak: how much of the compute a swarm of 8 volunteers does under churn reaches the final model.

Method (docs/churn-soak.md): 8 peers in lab namespaces (htb, 100 Mbit/s each way, one torch thread each)
train an `until_stopped` digits job published without an assignment, so the swarm plans it (two clusters
of at least 3 stages). From t0, the moment the first plan's pipelines move, a seeded schedule changes the
swarm on average every 60 s (uniform 30-90 s): a peer leaves (SIGKILL and SIGTERM alternating) or the
peer that left rejoins with the same identity (8, 7, 8, 7 ... peers). At t0 + duration the owner stops
the job. Then the same job runs in a fresh lab for the same wall time with no churn.

Useful-compute fraction = samples that reached the final model in the churn run / the same count in the
undisturbed run, both over [t0, t0 + duration]. "Reached the final model" is counted from the job's
progress records, polled every 2 s (`churn_accounting.useful_samples`): per plan epoch and cluster, the
positions fed from the epoch's start up to the next epoch's start (work past it, or never reported, is
rolled back by the re-plan and not counted), minus up to one averaging period per cluster whose replica
is not the one the next plan resumes from. The shortfall is split into re-plan downtime (seconds in
which no cluster's position grew for > 6 s, at the undisturbed rate), rolled-back work, and slower
plans (a lower rate while training).

``--part kill`` is the issue's kill -9 acceptance with its baseline: a job of ``--kill-steps``
micro-batches per cluster, once with a SIGKILL of cluster 1's last stage at 40 % of it and once
undisturbed; it reports both final accuracies, samples, and the time to train again.

Run: ``nice -n 5 python -m benchmarks.bench_churn_soak [--duration-s 600] [--part soak|kill|all]``
(needs root for the namespaces). Results: benchmarks/results/churn_soak.{md,json,png} and
kill_vs_undisturbed.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.churn_accounting import churn_schedule, loss_points, stalled_s, useful_curve, useful_samples
from benchmarks.harness import RESULTS_DIR, machine_facts
from benchmarks.soak_lab import LINK_MBPS, NUM_PEERS, load_run, run_in_lab
from benchmarks.soak_logs import phase_times, spurious_failures
from benchmarks.soak_report import plot_soak, write_kill_results, write_soak_results
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec

BATCH_SIZE = 32
AVERAGING_PERIOD_STEPS = 8


def soak_job(job_id: str, *, max_steps: int | None = None) -> JobSpec:
    """The elastic lab tests' job: digits CNN, batch 32, >= 3 stages per cluster, averaging every 8."""
    return JobSpec(
        job_id=job_id,
        model="digits_cnn",
        dataset="digits",
        batch_size=BATCH_SIZE,
        until_stopped=True,
        max_steps=max_steps,
        min_stages=3,
        eval_every_steps=16,
        averaging_period_steps=AVERAGING_PERIOD_STEPS,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )


def _final_accuracy(final: list[dict[str, Any]]) -> float | None:
    firsts = [m["eval_accuracy"] for m in final if m["stage"] == 0 and m["eval_accuracy"] is not None]
    return statistics.mean(firsts) if firsts else None


def _polls(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in timeline if line["kind"] == "poll"]


def recoveries(timeline: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per event: seconds until a plan newer than the one training at the event moved past its start."""
    polls = _polls(timeline)
    out = []
    for ev in events:
        before = [p for p in polls if p["t"] <= ev["t"]]
        epoch = max((r["epoch"] for p in before[-1:] for r in p["progress"]), default=0)
        again = next(
            (
                p["t"]
                for p in polls
                if p["t"] > ev["t"]
                and any(r["epoch"] > epoch and r["micro_batches"] > r["epoch_start"] for r in p["progress"])
            ),
            None,
        )
        out.append(
            {**ev, "epoch_before": epoch, "training_again_s": None if again is None else again - ev["t"]}
        )
    return out


def summarize(result: dict[str, Any], *, duration_s: float) -> dict[str, Any]:
    """The run's counts over [t0, t0 + duration_s] and its curves (seconds after t0)."""
    timeline, t0 = result["timeline"], result["t0"]
    until_t = t0 + duration_s
    kw = {"batch_size": BATCH_SIZE, "averaging_period_steps": AVERAGING_PERIOD_STEPS}
    acc = useful_samples(timeline, until_t=until_t, **kw)
    return {
        "useful_samples": acc["useful"],
        "trained_samples": acc["trained"],
        "rolled_back_samples": acc["rolled_back"],
        "plan_epochs": len(acc["epochs"]),
        "stalled_s": stalled_s(timeline, t0=t0, until_t=until_t),
        "final_accuracy": _final_accuracy(result["final"]),
        "done": result.get("done", True),
        "mean_loadavg": statistics.mean(result["loadavg"]) if result["loadavg"] else None,
        "epochs": acc["epochs"],
        "spurious_failures": spurious_failures(
            Path(result["workdir"]), [e["peer_id"] for e in result["events"]]
        ),
        "events": [
            {**ev, **phases}
            for ev, phases in zip(
                recoveries(timeline, [{**e, "t_s": e["t"] - t0} for e in result["events"]]),
                phase_times(Path(result["workdir"]), result["events"]),
                strict=True,
            )
        ],
        "useful_curve": useful_curve(timeline, t0=t0, until_t=until_t, **kw),
        "loss": [(t, loss) for t, loss in loss_points(timeline, t0=t0) if t <= duration_s],
        "workdir": result["workdir"],
    }


def breakdown(churn: dict[str, Any], calm: dict[str, Any], *, duration_s: float) -> dict[str, float]:
    """The churn run's shortfall against the undisturbed one, as fractions of the undisturbed samples.

    shortfall = downtime (stalled seconds at the undisturbed rate) + rolled back + slower plans (the
    lower rate while training); with the undisturbed run's own (negative) rolled-back share, the four
    add up to 1 - fraction.
    """
    base = calm["useful_samples"]
    rate = calm["trained_samples"] / duration_s
    active_s = max(1e-9, duration_s - churn["stalled_s"])
    downtime = rate * churn["stalled_s"]
    slower = (rate - churn["trained_samples"] / active_s) * active_s
    return {
        "downtime": downtime / base,
        "rolled_back": churn["rolled_back_samples"] / base,
        "slower_plans": slower / base,
        "undisturbed_rolled_back": (base - calm["trained_samples"]) / base,
    }


def soak(
    *,
    duration_s: float,
    seed: int,
    workdir: Path,
    results_dir: Path,
    sequential: bool = False,
    reuse: bool = False,
) -> dict[str, Any]:
    """The churn run, then the undisturbed run (`sequential`), or both at once in two labs.

    One after the other by default. Both at once would give both runs the same host load (this host is
    shared: in a smoke run the second run met twice the load of the first), but 16 peers on 2 cores
    starve each other: in a 600 s attempt (load average 35) both swarms' plan agreement broke down and
    the undisturbed run re-planned six times. The JSON records each run's load average.
    """
    events = churn_schedule(seed=seed, duration_s=duration_s)
    print(f"churn run: {len(events)} events over {duration_s:.0f} s; undisturbed run", flush=True)

    def churn_run() -> dict[str, Any]:
        return run_in_lab(
            workdir / "churn",
            run_id="soak",
            job=soak_job("soak"),
            duration_s=duration_s,
            events=events,
            seed=seed,
        )

    def calm_run() -> dict[str, Any]:
        return run_in_lab(workdir / "calm", run_id="soakcalm", job=soak_job("soak"), duration_s=duration_s)

    if reuse:
        churn_raw, calm_raw = load_run(workdir / "churn"), load_run(workdir / "calm")
    elif sequential:
        churn_raw, calm_raw = churn_run(), calm_run()
    else:
        with ThreadPoolExecutor(2) as pool:  # two blocking lab runs side by side
            churn_future, calm_future = pool.submit(churn_run), pool.submit(calm_run)
            churn_raw, calm_raw = churn_future.result(), calm_future.result()
    churn, calm = summarize(churn_raw, duration_s=duration_s), summarize(calm_raw, duration_s=duration_s)
    fraction = churn["useful_samples"] / calm["useful_samples"] if calm["useful_samples"] else float("nan")
    payload = {
        "benchmark": "churn_soak",
        "machine": machine_facts(),
        "duration_s": duration_s,
        "seed": seed,
        "concurrent": not sequential,
        "num_peers": NUM_PEERS,
        "link_mbps": LINK_MBPS,
        "job": soak_job("soak").model_dump(mode="json"),
        "schedule": [{"at_s": e.at_s, "action": e.action} for e in events],
        "useful_compute_fraction": fraction,
        "breakdown": breakdown(churn, calm, duration_s=duration_s),
        "churn": churn,
        "undisturbed": calm,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    plot_soak(payload, results_dir / "churn_soak.png")
    write_soak_results(payload, results_dir)
    print(f"useful-compute fraction {fraction:.3f}; results in {results_dir}", flush=True)
    return payload


def kill_vs_undisturbed(
    *, max_steps: int, workdir: Path, results_dir: Path, sequential: bool = False, reuse: bool = False
) -> dict[str, Any]:
    def one(name: str, position: int | None) -> dict[str, Any]:
        if reuse:
            raw = load_run(workdir / name)
        else:
            raw = run_in_lab(
                workdir / name,
                run_id=f"soak{name}",
                job=soak_job("soakkill", max_steps=max_steps),
                duration_s=0,
                kill_at_position=position,
            )
        acc = useful_samples(
            raw["timeline"],
            until_t=float("inf"),
            batch_size=BATCH_SIZE,
            averaging_period_steps=AVERAGING_PERIOD_STEPS,
        )
        return {
            "final_accuracy": _final_accuracy(raw["final"]),
            "done": raw.get("done", True),
            "useful_samples": acc["useful"],
            "trained_samples": acc["trained"],
            "plan_epochs": len(acc["epochs"]),
            "wall_s": raw["timeline"][-1]["t"] - raw["t0"],
            "events": recoveries(raw["timeline"], raw["events"]),
            "final_losses": [m["eval_loss"] for m in raw["final"] if m["stage"] == 0],
            "workdir": raw["workdir"],
        }

    print(f"kill and undisturbed runs: {max_steps} micro-batches a cluster", flush=True)
    if sequential:
        runs = {"kill": one("kill", int(0.4 * max_steps)), "undisturbed": one("undisturbed", None)}
    else:
        with ThreadPoolExecutor(2) as pool:
            kill_future = pool.submit(one, "kill", int(0.4 * max_steps))
            calm_future = pool.submit(one, "undisturbed", None)
            runs = {"kill": kill_future.result(), "undisturbed": calm_future.result()}
    payload = {
        "benchmark": "kill_vs_undisturbed",
        "machine": machine_facts(),
        "max_steps": max_steps,
        "concurrent": not sequential,
        **runs,
    }
    write_kill_results(payload, results_dir)
    return payload


def main(quick: bool = False, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_churn_soak")
    parser.add_argument("--duration-s", type=float, default=120.0 if quick else 600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", choices=("soak", "kill", "all"), default="soak" if quick else "all")
    parser.add_argument("--kill-steps", type=int, default=1200, help="micro-batches a cluster (--part kill)")
    parser.add_argument("--concurrent", action="store_true", help="both runs at once, in two labs")
    parser.add_argument("--reuse", action="store_true", help="recompute the results from --workdir's runs")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--workdir", type=Path, default=None, help="logs and timelines (default: a temp dir)")
    args = parser.parse_args(argv if argv is not None else [])
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"churn-soak-{time.strftime('%H%M%S')}-"))
    print(f"logs and timelines under {workdir}", flush=True)
    if args.part in ("soak", "all"):
        soak(
            duration_s=args.duration_s,
            seed=args.seed,
            workdir=workdir,
            results_dir=args.results_dir,
            sequential=not args.concurrent,
            reuse=args.reuse,
        )
    if args.part in ("kill", "all"):
        out = kill_vs_undisturbed(
            max_steps=args.kill_steps,
            workdir=workdir,
            results_dir=args.results_dir,
            sequential=not args.concurrent,
            reuse=args.reuse,
        )
        print(json.dumps({k: out[k]["final_accuracy"] for k in ("kill", "undisturbed")}), flush=True)


if __name__ == "__main__":
    import sys

    main(argv=sys.argv[1:])
