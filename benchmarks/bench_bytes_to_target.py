"""Bytes (and wall time) to a target validation loss on the lab: every mode in one run, one token budget.

Issue 16's acceptance: char-GPT on 4 clusters of the lab with 25 Mbit/s links; the cross-cluster bytes
and the wall time needed to reach the loss that averaging after every step reaches at a fixed token
budget, for averaging every step, today's best periodic averaging (every 128 steps in fp16) and the
outer optimizer (DiLoCo) at H = 200 and 500, uncompressed and int4, and H = 50 int4 (`--order`: any of
`MODES`, e.g. H = 10 or the clock). `--seeds`: the job's seed (data order, initial weights) per pass; every
mode runs once per seed, the second seed's runs in reversed order (load drift), and each seed's runs are
compared with that seed's "every step".

Setup: `bench_utilisation`'s lab (`lab_training.run_jobs`): 4 peer processes, one lab namespace each, htb
25 Mbit/s up and down per peer, equal cgroup CPU caps, one stage per cluster (the whole model), one
researcher namespace running `pipeline_driver --trace`. Every mode is one job of the same `--steps`
micro-batches per cluster (the token budget), one after the other in one lab. Each job evaluates on the
same held-out windows every `--eval-every` micro-batches; the driver polls the stages' metrics every
0.5 s and keeps every poll, so each evaluation's loss comes with that stage's `averaging_bytes_sent`
(tensor payload bytes of its finished averaging rounds, headers excluded: `RoundMetrics`) and its
`train_wall_s`. The final point is after the closing round (fp32, or under a Δ codec where the replicas'
anchors agree: `averaging/outer_averager.py`), so its bytes include that round. Analysis and plots:
`bytes_target_report.py`.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_utilisation import _participation
from benchmarks.bytes_target_report import curve, write_results
from benchmarks.lab_training import run_jobs
from benchmarks.labrun import run_dir
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec

LINK_MBPS = 25.0
NUM_CLUSTERS = 4
NUM_LAYERS = 2
EMBED_DIM = 64
PERIODIC = 128  # outer_optimizer.md: the best periodic averaging reached the target every 128 steps (fp16)


def _job(steps: int, eval_every: int, seed: int = 0) -> JobSpec:
    return JobSpec(
        job_id="bytes5",
        model="char_gpt",
        model_params={"block_size": 64, "num_layers": NUM_LAYERS, "embed_dim": EMBED_DIM, "num_heads": 4},
        dataset="char_corpus",
        dataset_config={"block_size": 64, "max_eval_samples": 128},
        batch_size=16,
        num_epochs=50,  # max_steps decides: a cluster's quarter of the corpus is ~103 batches of 16 x 64
        max_steps=steps,
        eval_every_steps=eval_every,
        seed=seed,
        optimizer=OptimizerConfig(name="adamw", lr=2e-3),
    )


def _outer(h: int, codec: str) -> dict[str, Any]:
    # outer_optimizer.md's best (lr, momentum) per H: 0.7 / 0.8 below H = 100, 1 / 0.5 from it on
    lr, momentum = (0.7, 0.8) if h < 100 else (1.0, 0.5)
    return {
        "averaging_period_steps": h,
        "outer_optimizer": {"lr": lr, "momentum": momentum, "compression": codec},
    }


MODES: dict[str, dict[str, Any]] = {
    # rounds back to back: a round that comes due while one runs starts as the next index when it ends
    "every step": {"averaging_period_steps": 1, "outer_optimizer": None},
    # rounds on the clock: floor(time / 1 s) is the same round index at every replica (period 1 by step
    # starts each round at the step a peer is free at, and the peers' indices rarely meet)
    "every 1 s (clock)": {"averaging_period_steps": 0, "averaging_period_s": 1.0, "outer_optimizer": None},
    f"periodic {PERIODIC}": {"averaging_period_steps": PERIODIC, "outer_optimizer": None},
    f"periodic {PERIODIC} fp16": {
        "averaging_period_steps": PERIODIC,
        "averaging_compression": "fp16",
        "outer_optimizer": None,
    },
    **{
        f"outer H={h}" + ("" if codec == "none" else f" {codec}"): _outer(h, codec)
        for h in (10, 50, 200, 500)
        for codec in ("none", "int4")
    },
}
# interleaved so that a drift of the shared machine's load does not hit one kind of mode only
DEFAULT_ORDER = [
    "every step",
    "outer H=200 int4",
    f"periodic {PERIODIC} fp16",
    "outer H=500",
    "outer H=50 int4",
    "outer H=200",
    "outer H=500 int4",
]


def measure(
    steps: int,
    eval_every: int,
    order: list[str],
    prefix: str,
    keep: str | None = None,
    seeds: tuple[int, ...] = (0,),
) -> list[dict[str, Any]]:
    """Run every mode of `order` once per seed in one lab (the second seed in reversed order); per run
    its curve (`bytes_target_report.curve`) and, from the peers' logs, the periodic rounds in which all
    replicas averaged (`bench_utilisation`'s count)."""
    job = _job(steps, eval_every)
    plan = [(m, seed) for k, seed in enumerate(seeds) for m in (order if k % 2 == 0 else order[::-1])]
    loads = [os.getloadavg()[0]]
    with run_dir("ravnest-bytes5-", keep) as tmp:
        results = run_jobs(
            num_peers=NUM_CLUSTERS,
            link_mbps=LINK_MBPS,
            job=job,
            split=[(0, NUM_LAYERS + 2)],  # embedding, blocks, head: the whole model on one stage
            runs=["async_1f1b:2:0"] * len(plan),
            updates=[{**MODES[m], "seed": seed} for m, seed in plan],
            workdir=Path(tmp),
            timeout_s=600 * len(plan),
            run_id="bytes5run",
            prefix=prefix,
            trace=True,
        )
        full = _participation(Path(tmp))
    loads.append(os.getloadavg()[0])
    rows = []
    for (mode, seed), result in zip(plan, results, strict=True):
        all_in, started = full.get(result["metrics"][0]["job_id"], (0, 0))
        rows.append(
            {
                "mode": mode,
                "seed": seed,
                **curve(result, eval_every),
                "rounds_all_replicas": f"{all_in}/{started}",
            }
        )
    return [*rows, {"loads": loads}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500, help="micro-batches per cluster (token budget)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--order", default=",".join(DEFAULT_ORDER))
    parser.add_argument("--keep", help="keep the peers' logs in a new directory under this one")
    parser.add_argument("--name", default="bytes_to_target", help="results file stem")
    parser.add_argument("--seeds", default="0,1", help="job seeds, one pass of every mode each")
    args, _ = parser.parse_known_args()
    if os.geteuid() != 0:
        print("bench_bytes_to_target needs root (network namespaces); skipped", flush=True)
        return
    started = time.monotonic()
    seeds = tuple(int(s) for s in args.seeds.split(","))
    prefix = "bytes5" + os.urandom(1).hex()
    rows = measure(args.steps, args.eval_every, args.order.split(","), prefix, args.keep, seeds)
    loads = rows.pop()["loads"]
    config = {
        "steps": args.steps,
        "eval_every": args.eval_every,
        "order": args.order,
        "seeds": list(seeds),
        "load_1min_start_end": loads,
        "took_s": round(time.monotonic() - started),
        "model": f"char_gpt {NUM_LAYERS} blocks, width {EMBED_DIM}, 4 heads, block 64",
        "link_mbps": LINK_MBPS,
        "clusters": NUM_CLUSTERS,
    }
    write_results(rows, config, name=args.name)


if __name__ == "__main__":
    main()
