"""Averaging overlapped with training: pipeline samples/s while averaging ÷ without, on the lab.

Two clusters x two stages (4 peer processes in lab namespaces, shaped links, equal CPU caps) train the
same job twice in one run: without periodic averaging (only the closing round) and with a ring round
every `period` micro-batches, in the background (delayed averaging). The rings share the links with the
pipeline, so the ratio shows what overlapping costs. Goal: >= 0.9.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness import record
from benchmarks.lab_training import run_jobs
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec


def _job(quick: bool) -> JobSpec:
    width = 512
    return JobSpec(
        job_id="ov",
        model="mlp",
        model_params={"in_features": 256, "hidden_features": [width] * 4, "out_features": 8},
        dataset="synthetic_classification",
        dataset_config={"num_samples": 40_000, "in_features": 256, "num_classes": 8},
        batch_size=64,
        max_steps=60 if quick else 240,
        optimizer=OptimizerConfig(name="sgd", lr=0.01),
    )


def _speed(result: dict[str, Any], batch: int) -> tuple[float, float, int, float]:
    firsts = [m for m in result["metrics"] if m["stage"] == 0]
    speeds = [m["step"] * batch / max(m["train_wall_s"], 1e-9) for m in firsts]
    rounds = min(m["averaging_rounds"] for m in result["metrics"])
    round_s = max((m["last_round_s"] or 0.0) for m in result["metrics"])
    return sum(speeds) / len(speeds), min(speeds), rounds, round_s


def main(quick: bool = False) -> None:
    if os.geteuid() != 0:
        print("bench_overlap needs root (network namespaces); skipped", flush=True)
        return
    job = _job(quick)
    split = [(0, 3), (3, 5)]
    period = 10
    rows = []
    for link_mbps in [50.0] if quick else [25.0, 100.0]:
        with tempfile.TemporaryDirectory(prefix="ravnest-ov-") as tmp:
            results = run_jobs(
                num_peers=4,
                link_mbps=link_mbps,
                job=job,
                split=split,
                runs=["async_1f1b:4:0", f"async_1f1b:4:{period}"],
                workdir=Path(tmp),
            )
        without, with_avg = (_speed(r, job.batch_size) for r in results)
        row = {
            "link_mbps": link_mbps,
            "micro_batches": job.max_steps,
            "period_steps": period,
            "samples_per_s_without": without[0],
            "samples_per_s_with": with_avg[0],
            "with_over_without": with_avg[0] / without[0],
            "rounds_with": with_avg[2],
            "last_round_s": with_avg[3],
        }
        print(row, flush=True)
        rows.append(row)
    record(
        "overlap",
        rows,
        notes=(
            "2 clusters x 2 stages of an MLP (4 peers, 1 namespace each, htb links, equal cgroup CPU caps), "
            "window 4. 'without': only the closing averaging round; 'with': a background ring round every "
            f"{period} micro-batches (delayed averaging), sharing the links with the pipeline. samples/s "
            "from the first stages' time inside `train` (mean of the two clusters). "
            "Goal: with/without >= 0.9."
        ),
    )


if __name__ == "__main__":
    main()
