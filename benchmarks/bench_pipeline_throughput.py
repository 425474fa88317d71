"""Throughput: the async 1F1B pipeline vs its slowest stage's bound vs a GPipe fill-drain schedule.

Three stage peers run in lab network namespaces with shaped links and a capped CPU each (cgroups);
a fourth namespace runs the researcher (`benchmarks.pipeline_driver`). In one run the same cluster
trains the same job twice: asynchronously (no flushes) and with GPipe's synchronous fill-drain.

The bound: in steady state a pipeline can go no faster than its slowest stage, where a stage's time per
micro-batch is the larger of its compute (forward + backward, measured on that peer in this run) and
the traffic on its shaped link (its output activations and its input's gradient share the uplink;
payload rate = 0.957 x the htb rate, the TCP/IP header overhead measured by the lab). samples/s bound
= batch / max over stages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import record
from benchmarks.lab_training import run_jobs
from ravnest_p2p.models import build_model, sample_input, trace_output_specs
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.runtime.service import default_window
from ravnest_p2p.training.job import JobSpec

PAYLOAD_FACTOR = 0.957
PORT = 31337


def _job(quick: bool) -> tuple[JobSpec, list[tuple[int, int]]]:
    width = 768
    job = JobSpec(
        job_id="tp",
        model="mlp",
        model_params={"in_features": 256, "hidden_features": [width] * 5, "out_features": 8},
        dataset="synthetic_classification",
        dataset_config={"num_samples": 40_000, "in_features": 256, "num_classes": 8},
        batch_size=64,
        max_steps=60 if quick else 200,
        optimizer=OptimizerConfig(name="sgd", lr=0.01),
    )
    return job, [(0, 2), (2, 4), (4, 6)]


def _boundary_bytes(job: JobSpec, split: list[tuple[int, int]]) -> list[int]:
    layers = build_model(job.model, job.model_params)
    specs = trace_output_specs(layers, sample_input(job.model, job.model_params))
    out = []
    for _, end in split[:-1]:
        spec = specs[end - 1]
        numel = 1
        for d in spec.shape:
            numel *= d
        out.append(numel * 4 * job.batch_size)
    return out


def _run_once(link_mbps: float, quick: bool, workdir: Path) -> dict[str, Any]:
    job, split = _job(quick)
    window = default_window(len(split))
    started = time.monotonic()
    results = run_jobs(
        num_peers=len(split),
        link_mbps=link_mbps,
        job=job,
        split=split,
        runs=[f"async_1f1b:{len(split)}", f"async_1f1b:{window}", "async_1f1b:auto", f"gpipe:{window}"],
        workdir=workdir,
    )
    return {"results": results, "job": job, "split": split, "elapsed_s": time.monotonic() - started}


_SINGLE_PROCESS = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import build_stage, load_dataset, num_layers, train_batches
job = JobSpec.model_validate_json(sys.argv[1])
train, _ = load_dataset(job)
stage = build_stage(job, 0, num_layers(job), max_in_flight=1)
start = time.perf_counter()
n = 0
for mb, (x, y) in enumerate(train_batches(job, train, cluster_index=0, num_clusters=1)):
    stage.forward_loss(mb, x, y)
    n += x.shape[0]
elapsed = time.perf_counter() - start
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "samples_per_s": n / elapsed}))
"""


def _single_process(job: JobSpec) -> dict[str, float]:
    """Peak RSS (and speed, one unthrottled thread) of training the whole model in one process."""
    proc = subprocess.run(
        [sys.executable, "-c", _SINGLE_PROCESS, job.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def link_seconds(boundary_bytes: list[int], link_mbps: float) -> list[float]:
    """Per stage peer, the busier direction of its link per micro-batch.

    A stage uploads its output activations (to the next stage) *and* the gradient of its input (to the
    previous one) on the same uplink, and downloads both on its downlink: a middle stage moves two
    boundary tensors each way per micro-batch. Payload rate = 0.957 x the htb rate.
    """
    rate = link_mbps * 1e6 * PAYLOAD_FACTOR / 8
    out = []
    for i in range(len(boundary_bytes) + 1):
        upload = (boundary_bytes[i] if i < len(boundary_bytes) else 0) + (
            boundary_bytes[i - 1] if i > 0 else 0
        )
        out.append(upload / rate)
    return out


def _summarise(run: dict[str, Any], link_mbps: float) -> dict[str, Any]:
    job: JobSpec = run["job"]
    boundary = _boundary_bytes(job, run["split"])
    row: dict[str, Any] = {"link_mbps": link_mbps, "batch": job.batch_size, "micro_batches": job.max_steps}
    link_s = link_seconds(boundary, link_mbps)
    for result in run["results"]:
        metrics = sorted(result["metrics"], key=lambda m: m["stage"])
        first = metrics[0]
        samples_per_s = first["step"] * job.batch_size / max(first["train_wall_s"], 1e-9)
        compute_per_mb = [m["compute_s"] / max(m["step"], 1) for m in metrics]
        stage_s = [max(c, link) for c, link in zip(compute_per_mb, link_s, strict=True)]
        bound = job.batch_size / max(stage_s)
        key = f"{'async' if result['schedule'] == 'async_1f1b' else 'gpipe'}_w{result['window']}"
        row[f"{key}_samples_per_s"] = samples_per_s
        row[f"{key}_bound_samples_per_s"] = bound
        row[f"{key}_over_bound"] = samples_per_s / bound
        row[f"{key}_peak_rss_mb"] = max(m["peak_memory_bytes"] for m in metrics) / 2**20
        row[f"{key}_stage_compute_ms"] = "/".join(f"{c * 1000:.1f}" for c in compute_per_mb)
        if result["window"] == "auto":
            row[f"{key}_settled_window"] = first.get("window", 0)
    row["link_ms"] = "/".join(f"{s * 1000:.1f}" for s in link_s)
    single = _single_process(job)
    row["single_process_peak_rss_mb"] = single["peak_rss_mb"]
    window = default_window(len(run["split"]))
    row["async_over_gpipe"] = row[f"async_w{window}_samples_per_s"] / row[f"gpipe_w{window}_samples_per_s"]
    return row


def main(quick: bool = False) -> None:
    if os.geteuid() != 0:
        print("bench_pipeline_throughput needs root (network namespaces); skipped", flush=True)
        return
    rows = []
    for link_mbps in [50.0] if quick else [25.0, 100.0]:
        with tempfile.TemporaryDirectory(prefix="ravnest-tp-") as tmp:
            row = _summarise(_run_once(link_mbps, quick, Path(tmp)), link_mbps)
        print(row, flush=True)
        rows.append(row)
    record(
        "pipeline_throughput",
        rows,
        notes=(
            "3-stage MLP pipeline, one peer process per lab namespace (htb links, CPU capped by cgroup), "
            "researcher in a 4th namespace. async_wN = 1F1B without flushes, N micro-batches in flight "
            "(N=3: PipeDream's window = stages; N=7: the default 3S-2); async_wauto = the experimental "
            "adaptive window (delivery rate x min round trip, between 3 and 7; settled_window: its value at "
            "the end); gpipe_w7 = fill-drain of 7 micro-batches at a time, one optimizer step each. bound = "
            "batch / slowest stage, stage time = max(measured compute per micro-batch on that peer in this "
            "run, link time: a stage's uplink carries its activations and its input's gradient, at 0.957 x "
            "htb rate). Goal: async_w7_over_bound >= 0.9; async_over_gpipe uses async_w7. Peak RSS is per "
            "stage process (max over stages)."
        ),
    )


if __name__ == "__main__":
    main()
