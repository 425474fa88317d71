"""IST against data parallel and local SGD on real peer processes behind shaped links (issue 13).

For each cell (n workers, link rate) of the grid — n = 2 and 4, 25 and 100 Mbit/s by default — one lab
session: n `python -m ravnest_p2p.peer` processes, one namespace each behind htb-shaped links (upload
and download at the rate), each CPU-capped by cgroup to `--cpus` / n CPU with one compute thread, and a
researcher in its own namespace (`benchmarks.ist_lab_driver`) that publishes, one after the other on
the same peers, the three jobs of the cell:

- ``ist``: mode ist, n workers, K local steps per round;
- ``dp``: synchronous data parallel = mode sync_backup with N = n, b = 0 (every step each worker pushes
  its gradient's pieces to their owners, gets the averaged update back, and as an owner receives the
  others' pieces of its shard and sends the update: 2(n - 1)/n of the model each way per step, what a
  ring all-reduce moves too);
- ``local``: local SGD with the same K = mode sync_backup with N = n, b = 0 and local_steps K (model
  averaging every K steps).

Same model (`wide_mlp` 64-W-W-10, W = 2048), data (digits, batch 32 per worker, the same batch slots),
optimizer (plain SGD, lr 0.05) and epochs in every job. Measured on the lab: each worker's per-step /
per-round times (the ``sync timing`` / ``ist timing`` log lines), the held-out accuracy of the final
model, the bytes every worker's interface sent and received during the job. Accuracy after each sync
comes from an in-process replay of the same job (`benchmarks.ist_lab_replay`; the lab's final accuracy
is the check). Report and plot: `benchmarks.ist_lab_report`.

Needs root. ``python -m benchmarks.bench_ist_lab [--epochs 4] [--cells 2x100 4x100 2x25 4x25]
[--cpus 1.0]`` writes benchmarks/results/ist_lab.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR
from benchmarks.ist_lab_replay import cached_replays
from benchmarks.ist_lab_report import write_report
from benchmarks.labrun import run_driver, start_lab_peers
from ravnest_p2p.lab import NetnsLab, parse_profile
from ravnest_p2p.lab.peer_presets import FAST_MEMBERSHIP_PEER_CONFIG
from ravnest_p2p.lab.throttle import ComputeThrottle
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.modes import IstConfig
from ravnest_p2p.transport import load_or_create_identity

PORT = 31391
RUN_ID = "ist-modes2"
LOCAL_STEPS = 5
LR = 0.05
_FROM_RAW = "--from-raw"
_TIMING = re.compile(r"(sync|ist) timing (\{.*\})")


def bench_job(width: int, epochs: int) -> JobSpec:
    return JobSpec(
        job_id="modes2",
        model="wide_mlp",
        model_params={"in_features": 64, "hidden_features": [width, width], "out_features": 10},
        dataset="digits",
        batch_size=32,
        num_epochs=epochs,
        seed=0,
        optimizer=OptimizerConfig(name="sgd", lr=LR),
        mode="ist",
        ist=IstConfig(local_steps=LOCAL_STEPS, peer_timeout_s=60, round_timeout_s=600),
    )


def run_cell(
    workdir: Path, *, n: int, rate_mbps: float, job: JobSpec, runs: list[str], cpus: float
) -> dict[str, Any]:
    """One lab session: n peers at `rate_mbps`, the driver publishes `runs`; results, timings, load."""
    link = {"upload_mbps": rate_mbps, "download_mbps": rate_mbps}
    peers = [{"name": f"w{i}", **link} for i in range(n)]
    profile = parse_profile(
        {"run_id": RUN_ID, "shaping": "htb", "peers": [*peers, {"name": "researcher", **link}]},
        source="bench",
    )
    ids = [load_or_create_identity(workdir / f"id{i}.key") for i in range(n)]
    config = workdir / "peer.toml"
    config.write_text(FAST_MEMBERSHIP_PEER_CONFIG)
    out = workdir / "driver.json"
    loadavg: list[float] = []
    began = time.time()
    with NetnsLab(profile, prefix="modes2" + os.urandom(1).hex()) as lab:
        throttles: list[ComputeThrottle] = []
        try:
            maddrs = start_lab_peers(
                lab,
                ids,
                run_id=RUN_ID,
                port=PORT,
                base_cpus=cpus / n,
                workdir=workdir,
                config_path=config,
                throttles=throttles,
            )
            ifaces = [f"{lab.namespace_of(i)}:{lab.interface_of(i)}" for i in range(n)]
            argv = [sys.executable, "-m", "benchmarks.ist_lab_driver", "--initial-peers", *maddrs]
            argv += ["--run-id", RUN_ID, "--workers", *[i.peer_id for i in ids], "--ifaces", *ifaces]
            argv += ["--job", job.model_dump_json(), "--runs", *runs, "--out", str(out)]
            loadavg = run_driver(lab, n, argv, workdir=workdir)
        finally:
            for throttle in throttles:
                throttle.close()
    timings = []
    for i in range(n):
        for kind, line in _TIMING.findall((workdir / f"peer{i}.log").read_text(errors="replace")):
            timings.append({**json.loads(line), "kind": kind, "lab_index": i})
    return {
        "n": n,
        "rate_mbps": rate_mbps,
        "results": json.loads(out.read_text()),
        "timings": timings,
        "loadavg": loadavg,
        "cpus_per_peer": cpus / n,
        "wall_s": time.time() - began,
    }


def main(quick: bool = False, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ist_lab")
    parser.add_argument("--epochs", type=int, default=1 if quick else 4)
    parser.add_argument("--width", type=int, default=512 if quick else 2048)
    parser.add_argument(
        "--cells", nargs="+", default=["2x100"] if quick else ["2x100", "4x100", "2x25", "4x25"]
    )
    parser.add_argument("--runs", nargs="+", default=["ist", "dp", "local"])
    parser.add_argument("--cpus", type=float, default=1.0, help="CPU the n peers' quotas take together")
    parser.add_argument("--name", default="ist_lab")
    parser.add_argument(_FROM_RAW, action="store_true", help="report from <name>_raw.json, no lab")
    parser.add_argument("--replay-cache", type=Path, help="replays of this job (`ist_lab_replay --out`)")
    args = parser.parse_args(argv if argv is not None else [])
    if os.geteuid() != 0 and not args.from_raw:
        print("bench_ist_lab needs root (network namespaces); skipped", flush=True)
        return
    job = bench_job(args.width, args.epochs)
    started = time.time()
    raw = RESULTS_DIR / f"{args.name}_raw.json"
    cells = json.loads(raw.read_text())["cells"] if args.from_raw else []
    for cell in [] if args.from_raw else args.cells:
        n, rate = (float(x) for x in cell.split("x"))
        with tempfile.TemporaryDirectory(prefix="ravnest-modes2-") as tmp:
            cells.append(
                run_cell(Path(tmp), n=int(n), rate_mbps=rate, job=job, runs=args.runs, cpus=args.cpus)
            )
        load = cells[-1]["loadavg"]
        print(json.dumps({"cell": cell, "wall_s": round(cells[-1]["wall_s"]), "load": max(load)}), flush=True)
    lab_s = time.time() - started
    if not args.from_raw:  # the lab's raw results first: the report can be redone from them
        raw.write_text(json.dumps({"cells": cells}) + "\n")
    sizes = sorted({c["n"] for c in cells})
    curves = cached_replays(job, args.runs, sizes, LOCAL_STEPS, args.replay_cache)
    load = [x for c in cells for x in c["loadavg"]]
    flags = [a for a in argv or [] if a != _FROM_RAW]
    meta = {
        "job": json.loads(job.model_dump_json()),
        "local_steps": LOCAL_STEPS,
        "cpus": args.cpus,
        "lab_s": round(sum(c["wall_s"] for c in cells)),
        "replay_s": round(time.time() - started - lab_s),
        "load_median": statistics.median(load) if load else None,
        "load_max": max(load) if load else None,
        "command": " ".join(["python -m benchmarks.bench_ist_lab", *flags]),
    }
    write_report(args.name, cells, curves, meta)


if __name__ == "__main__":
    main(argv=sys.argv[1:])
