"""Compute utilisation on the lab at 25 Mbit/s between clusters: outer optimizer beside periodic averaging.

Issue 16's acceptance: time in forward, backward and optimizer ÷ wall time, per peer, ≥ 0.9 with the outer
optimizer. Setup: 4 clusters x 1 stage of char-GPT (4 peer processes, one lab namespace each, htb links
of 25 Mbit/s up and down, so every pair of clusters meets at 25 Mbit/s; equal cgroup CPU caps). One stage
per cluster because this 2-core machine, shared with other sessions, cannot hold 8 peers' compute: with
4 x 2 the pipeline's own bubbles would also hide what averaging costs. Per peer: `compute_s` (fwd, bwd
and the optimizer step on the compute thread) ÷ `train_wall_s` (wall time inside `train`).

Modes, interleaved in one lab (A B C C B A), so a drift of the shared machine's load hits all of them:
- none: no averaging during training (only the closing round): the ceiling, what the loop itself costs;
- periodic: today's plain averaging every `PERIOD` micro-batches (delayed, in the background);
- outer: the outer optimizer (DiLoCo) every `H` micro-batches, Δ compressed (`CODEC`).

Under load the CPU cap is not the peers' only limit: a stretched compute step counts as compute, so the
ratio measures time lost *waiting* (for averaging to apply, for the CPU that averaging's own encode and
copies take), not the machine's speed. The load average is recorded beside each run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR, record
from benchmarks.lab_training import run_jobs
from benchmarks.labrun import run_dir
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec

LINK_MBPS = 25.0
NUM_CLUSTERS = 4
PERIOD = 10  # periodic averaging (bench_overlap's period)
H = 50  # outer optimizer sync period
CODEC = "int4"  # the docs' recommended Δ codec at H = 50
NUM_LAYERS = 4


def _job(steps: int) -> JobSpec:
    return JobSpec(
        job_id="util",
        model="char_gpt",
        model_params={"block_size": 64, "num_layers": NUM_LAYERS, "embed_dim": 128, "num_heads": 4},
        dataset="char_corpus",
        dataset_config={"block_size": 64, "max_eval_samples": 32},  # eval counts as compute: keep it tiny
        batch_size=16,
        num_epochs=3,  # a cluster's quarter of the corpus is ~103 batches of 16 x 64
        max_steps=steps,
        seed=0,
        optimizer=OptimizerConfig(name="adamw", lr=1e-3),
    )


MODES: dict[str, dict[str, Any]] = {
    "none": {"averaging_period_steps": 0, "outer_optimizer": None},
    "periodic": {"averaging_period_steps": PERIOD, "outer_optimizer": None},
    "outer": {"averaging_period_steps": H, "outer_optimizer": {"compression": CODEC}},
}


_ROUND = re.compile(r"averaging round (\d+) finished in [0-9.]+s with (\d+) of (\d+) replicas")
_JOB = re.compile(r"job (\S+): stage \d+ of")


def _participation(workdir: Path) -> dict[str, tuple[int, int]]:
    """Job id -> (rounds every replica joined, rounds), over every peer's log (closing rounds left out)."""
    out: dict[str, list[int]] = {}
    for log in workdir.glob("peer*.log"):
        job = None
        for line in log.read_text(errors="replace").splitlines():
            if (started := _JOB.search(line)) is not None:
                job = started.group(1)
            elif (
                job is not None and (done := _ROUND.search(line)) is not None and int(done.group(1)) < 1 << 40
            ):
                counts = out.setdefault(job, [0, 0])
                counts[0] += done.group(2) == done.group(3)
                counts[1] += 1
    return {job: (full, total) for job, (full, total) in out.items()}


def _row(mode: str, result: dict[str, Any], load: float, rounds: tuple[int, int]) -> dict[str, Any]:
    metrics = result["metrics"]
    utils = [m["compute_s"] / max(m["train_wall_s"], 1e-9) for m in metrics]
    return {
        "mode": mode,
        "utilisation_min": min(utils),
        "utilisation_mean": sum(utils) / len(utils),
        "per_peer": [round(u, 4) for u in utils],
        "wall_s": max(m["train_wall_s"] for m in metrics),
        "steps": min(m["step"] for m in metrics),
        "rounds": min(m["averaging_rounds"] for m in metrics),
        # periodic rounds (peer-rounds over all peers) in which all replicas averaged, of those started
        "rounds_all_replicas": f"{rounds[0]}/{rounds[1]}",
        "averaging_mb_sent_per_peer": sum(m["averaging_bytes_sent"] for m in metrics) / len(metrics) / 1e6,
        "load_1min": load,
    }


def measure(steps: int, order: list[str], keep: str | None = None) -> list[dict[str, Any]]:
    job = _job(steps)
    split = [(0, NUM_LAYERS + 2)]  # embedding, blocks, head: the whole model on one stage
    started_load = os.getloadavg()[0]
    with run_dir("ravnest-outer2-", keep) as tmp:
        results = run_jobs(
            num_peers=NUM_CLUSTERS,
            link_mbps=LINK_MBPS,
            job=job,
            split=split,
            runs=["async_1f1b:2:0"] * len(order),
            updates=[MODES[m] for m in order],
            workdir=Path(tmp),
            timeout_s=900 * len(order),
            run_id="outer2util",
            prefix="outer2" + os.urandom(1).hex(),
        )
        rounds = _participation(Path(tmp))
    load = (started_load + os.getloadavg()[0]) / 2  # the runs' own rows carry no load: the lab's average
    return [
        _row(m, r, load, rounds.get(r["metrics"][0]["job_id"], (0, 0)))
        for m, r in zip(order, results, strict=True)
    ]


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, row in enumerate(rows):
        xs = [i] * len(row["per_peer"])
        ax.scatter(xs, row["per_peer"], color={"none": "grey", "periodic": "C0", "outer": "C1"}[row["mode"]])
    ax.axhline(0.9, color="red", linestyle=":", label="goal 0.9")
    ax.set_xticks(range(len(rows)), [f"{r['mode']}\n#{i}" for i, r in enumerate(rows)])
    ax.set_ylabel("compute / wall, per peer")
    ax.set_title(f"{NUM_CLUSTERS} clusters at {LINK_MBPS:g} Mbit/s, char-GPT (runs in order)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(rows: list[dict[str, Any]], *, steps: int, order: str, took_s: float) -> None:
    """outer_lab.{json,md,png}: per mode, then every run in order (with its load)."""
    summary = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        full = [tuple(map(int, r["rounds_all_replicas"].split("/"))) for r in mine]
        summary.append(
            {
                "mode": mode,
                "runs": len(mine),
                "utilisation_min": min(r["utilisation_min"] for r in mine),
                "utilisation_mean": sum(r["utilisation_mean"] for r in mine) / len(mine),
                "rounds_all_replicas": f"{sum(f for f, _ in full)}/{sum(t for _, t in full)}",
                "averaging_mb_sent_per_peer": sum(r["averaging_mb_sent_per_peer"] for r in mine) / len(mine),
            }
        )
    json_path = record(
        "outer_lab",
        summary,
        notes=(
            f"{NUM_CLUSTERS} clusters x 1 stage of char-GPT ({NUM_LAYERS} blocks, width 128, 0.83 M "
            f"parameters), lab namespaces, htb {LINK_MBPS:g} Mbit/s per peer up and down, equal cgroup CPU "
            f"caps (1.8 CPUs in all), batch 16 x 64 tokens, {steps} micro-batches per run. Utilisation = "
            "compute_s (forward, backward, optimizer step, timed on the compute thread; plus a 32-sample "
            "evaluation at the end) / train_wall_s, per peer; runs interleaved in one lab "
            f"({order}); periodic: plain averaging every {PERIOD} steps; outer: DiLoCo every {H} steps, "
            f"{CODEC} Δ. rounds_all_replicas: peer-rounds (closing round excluded) in which all "
            f"{NUM_CLUSTERS} replicas averaged, of those started (from the peers' logs). Goal: outer >= 0.9. "
            f"Took {took_s:.0f} s."
        ),
    )
    payload = json.loads(json_path.read_text())
    payload["runs"] = rows  # every run, in order, with its per-peer ratios and the load
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    lines = ["", "| run | mode | per peer | wall_s | rounds all replicas | load_1min |", "|---" * 6 + "|"]
    for i, r in enumerate(rows):
        peers = " ".join(f"{u:.3f}" for u in r["per_peer"])
        cells = [i, r["mode"], peers, f"{r['wall_s']:.1f}", r["rounds_all_replicas"], f"{r['load_1min']:.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    md = json_path.with_suffix(".md")
    md.write_text(md.read_text() + "\n".join(lines) + "\n")
    _plot(rows, RESULTS_DIR / "outer_lab.png")
    print(json.dumps(summary, indent=1), flush=True)


def main(quick: bool = False) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60 if quick else 300)
    parser.add_argument("--order", default="none,periodic,outer,outer,periodic,none")
    parser.add_argument("--keep", help="keep the peers' logs in a new directory under this one")
    args, _ = parser.parse_known_args()
    if os.geteuid() != 0:
        print("bench_utilisation needs root (network namespaces); skipped", flush=True)
        return
    started = time.monotonic()
    rows = measure(args.steps, args.order.split(","), args.keep)
    write_results(rows, steps=args.steps, order=args.order, took_s=time.monotonic() - started)


if __name__ == "__main__":
    main()
