"""What the trust work costs in throughput: this tree vs. the commit before it, ABBA blocks in one sitting.

The trust wave (wire budgets and deadlines, validated DHT records, pipeline refusals and ledgers, signed
epochs) adds checks to every message. Its cost is measured as a ratio, never as absolute numbers: the base
commit (`BASE`, the commit before the wave) is checked out into a temporary `git worktree`, and the same
worker (this file, ``--worker``) runs with ``PYTHONPATH`` pointing at the base tree's ``src`` (A) or this
tree's (B), in blocks A B B A, so a drift of the shared host's load over the sitting hits both sides alike.
Each worker measures, in one process on loopback p2p daemons:

- pipeline: samples/s of a 3-stage digits CNN pipeline (`training.local.local_pipeline`, the stages in
  one process, so every per-message check is on the critical path), the best of a few passes over the
  training set after one warm-up pass; and the process's CPU time per sample (all threads, the median
  pass): on a loaded host wall time mostly measures the other jobs, CPU time much less so;
- ring: the best time of an all-reduce round of 4 peers (`averaging.RingAllReduce`, one ring), after a
  warm-up round.

Both paths exist with the same API in both trees. Alternatives rejected: the lab (cgroups and shaped
links): too slow for a couple of minutes on a shared 2-core host, and its link shaping would hide a CPU
cost; comparing against stored results of another run: the host's load changes from hour to hour.
Known limits: on a busy shared host a block's ratio moves by several percent, more than a 2 % effect;
the report gives the spread next to the mean and says when the spread is larger than the effect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BASE = "96d0c19"  # the commit before the trust wave
_ROOT = Path(__file__).resolve().parents[1]
_RING_PEERS = 4


async def _pipeline_samples_per_s(transports: list[Any], passes: int) -> tuple[float, float]:
    from ravnest_p2p.runtime.optim import OptimizerConfig
    from ravnest_p2p.training.job import JobSpec
    from ravnest_p2p.training.local import local_pipeline
    from ravnest_p2p.training.stages import load_dataset, train_batches

    job = JobSpec(
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        max_steps=10_000,
        seed=3,
        optimizer=OptimizerConfig(name="adam", lr=3e-3),
    )
    train, _ = load_dataset(job)
    data = list(train_batches(job, train, cluster_index=0, num_clusters=1))
    async with local_pipeline(job, transports, max_in_flight=3) as services:
        await services[0].train(data)  # warm-up: connections, allocator, first-call costs
        samples = sum(len(y) for _, y in data)
        rates, cpu_us = [], []
        for _ in range(passes):
            started, cpu_started = time.perf_counter(), time.process_time()
            await services[0].train(data)
            rates.append(samples / (time.perf_counter() - started))
            cpu_us.append((time.process_time() - cpu_started) / samples * 1e6)
        assert all(s.failure is None for s in services)
    # the best pass: another job's burst on the shared host only ever slows a pass down; CPU time (of
    # this process, all threads) is the median pass's, less sensitive to the host's load than wall time
    return max(rates), statistics.median(cpu_us)


async def _ring_round_s(transports: list[Any], numel: int, rounds: int) -> float:
    import torch

    from ravnest_p2p.averaging import RingAllReduce, build_shard_map
    from ravnest_p2p.transport import RpcEndpoint

    shard_map = build_shard_map([[(t.peer_id, [("0.weight", numel)])] for t in transports], epoch=0)
    tensors = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(len(transports))]
    servers = [RingAllReduce(RpcEndpoint(t, "bench-trust")) for t in transports]
    for server in servers:
        await server.start()
    try:
        times = []
        for r in range(rounds + 1):
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    s.all_reduce(shard_map, {"0.weight": tensors[i]}, round_index=r)
                    for i, s in enumerate(servers)
                )
            )
            if r > 0:  # the first round warms connections up
                times.append(time.perf_counter() - started)
    finally:
        for server in servers:
            await server.aclose()
    return min(times)  # the best round, as for the pipeline


async def _measure(passes: int, numel: int, rounds: int) -> dict[str, float]:
    from ravnest_p2p.training.local import local_hosts

    async with local_hosts(_RING_PEERS) as transports:
        rate, cpu_us = await _pipeline_samples_per_s(transports[:3], passes)
        return {
            "pipeline_samples_per_s": rate,
            "pipeline_cpu_us_per_sample": cpu_us,
            "ring_round_s": await _ring_round_s(transports, numel, rounds),
        }


def _worker(passes: int, numel: int, rounds: int) -> None:
    import torch

    import ravnest_p2p

    torch.set_num_threads(1)  # stages and peers share one process; no intra-op pools on a shared host
    out = {
        "src": str(Path(ravnest_p2p.__file__).resolve().parents[1]),
        **asyncio.run(_measure(passes, numel, rounds)),
    }
    print("RESULT " + json.dumps(out), flush=True)


def _run_worker(src: Path, passes: int, numel: int, rounds: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    args = ["--worker", "--passes", str(passes), "--numel", str(numel), "--rounds", str(rounds)]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tempfile.gettempdir(),  # not this tree's root: nothing but PYTHONPATH picks the tree
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker on {src} failed ({done.returncode}): {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    if Path(result["src"]) != src.resolve():
        raise RuntimeError(f"the worker imported {result['src']}, not {src}")
    return result


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.mean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def main(
    quick: bool = False, blocks: int | None = None, passes: int | None = None, rounds: int | None = None
) -> None:
    from benchmarks.harness import machine_facts

    blocks = blocks or (2 if quick else 3)
    default_passes, numel, default_rounds = (4, 1 << 19, 6) if quick else (8, 1 << 19, 10)
    passes, rounds = passes or default_passes, rounds or default_rounds
    base = Path(tempfile.mkdtemp(prefix="trust-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), BASE], cwd=_ROOT, check=True)
    rows: list[dict[str, Any]] = []
    try:
        trees = {"A": base / "src", "B": _ROOT / "src"}
        for block in range(blocks):
            got: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
            load_1m = os.getloadavg()[0]
            for side in "ABBA":
                result = _run_worker(trees[side], passes, numel, rounds)
                got[side].append(result)
                print(f"block {block} {side}: {result}", flush=True)

            def mean_of(side: str, key: str, got: dict[str, list[dict[str, Any]]] = got) -> float:
                return statistics.mean(r[key] for r in got[side])

            rows.append(
                {
                    "block": block,
                    "load_1m": load_1m,  # the host's load average when the block started
                    "pipeline_before_samples_per_s": mean_of("A", "pipeline_samples_per_s"),
                    "pipeline_after_samples_per_s": mean_of("B", "pipeline_samples_per_s"),
                    # after / before: 1.0 = no cost; 0.98 = 2 % slower
                    "pipeline_ratio": mean_of("B", "pipeline_samples_per_s")
                    / mean_of("A", "pipeline_samples_per_s"),
                    # CPU time per sample, before / after: 1.0 = no cost (the load-robust view)
                    "pipeline_cpu_ratio": mean_of("A", "pipeline_cpu_us_per_sample")
                    / mean_of("B", "pipeline_cpu_us_per_sample"),
                    "ring_before_s": mean_of("A", "ring_round_s"),
                    "ring_after_s": mean_of("B", "ring_round_s"),
                    # throughput ratio (before time / after time): 1.0 = no cost
                    "ring_ratio": mean_of("A", "ring_round_s") / mean_of("B", "ring_round_s"),
                }
            )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=_ROOT, check=False)
        shutil.rmtree(base.parent, ignore_errors=True)
    _write(rows, blocks, passes, numel, rounds, machine_facts())


def _write(
    rows: list[dict[str, Any]], blocks: int, passes: int, numel: int, rounds: int, machine: dict[str, Any]
) -> None:
    from benchmarks.harness import RESULTS_DIR

    keys = {"pipeline_ratio": "pipeline", "pipeline_cpu_ratio": "pipeline CPU time", "ring_ratio": "ring"}
    summary = {key: _spread([r[key] for r in rows]) for key in keys}
    verdicts = []
    for key, label in keys.items():
        s = summary[key]
        cost = 1.0 - s["mean"]
        # the block ratios are independent samples of the same cost: its 95 % interval is the mean's
        # (about 2 standard errors), which narrows with more blocks, unlike one block's own spread
        half = 2 * s["stdev"] / math.sqrt(len(rows)) if len(rows) > 1 else math.inf
        lo, hi = cost - half, cost + half
        interval = f"cost {cost * 100:+.1f} %, 95 % interval {lo * 100:+.1f} % .. {hi * 100:+.1f} %"
        if hi <= 0.02:
            verdict = "within the 2 % budget"
        elif lo > 0.02:
            verdict = "OVER the 2 % budget"
        else:
            verdict = "cannot tell from the host's noise whether it is within the 2 % budget (add blocks)"
        verdicts.append(
            f"{label}: mean ratio {s['mean']:.3f} over {len(rows)} blocks (stdev {s['stdev']:.3f}; "
            f"{interval}): {verdict}"
        )
    payload = {
        "benchmark": "trust_cost",
        "base_commit": BASE,
        "machine": machine,
        "config": {
            "blocks": blocks,
            "order": "ABBA",
            "passes": passes,
            "ring_numel": numel,
            "rounds": rounds,
        },
        "rows": rows,
        "summary": summary,
        "verdicts": verdicts,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "trust_cost.json").write_text(json.dumps(payload, indent=2) + "\n")
    cols = list(rows[0])
    lines = [
        "## trust_cost",
        "",
        f"Throughput of this tree (B, commit {machine.get('git_commit', '?')}) vs. the commit before the "
        f"trust wave (A, `{BASE}`), {blocks} blocks A B B A in one sitting, each side a fresh process on "
        "loopback "
        f"p2p daemons (not the lab: the lab's shaped links and CPU caps would not fit a couple of minutes "
        f"on this host). Pipeline: samples/s of a 3-stage digits CNN in one process (best of {passes} "
        f"passes of the training set after a warm-up), and its CPU time per sample (median pass; "
        f"pipeline_cpu_ratio is before/after CPU time, so 1.0 costs nothing, like the others). "
        f"Ring: best round time of 4 peers averaging "
        f"{numel * 4 >> 20} MiB "
        f"(fp32, {rounds} rounds after a warm-up). Ratios are after/before throughput: 1.0 costs nothing, "
        "0.98 is 2 % slower. The host is 2 cores shared with other jobs.",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for row in rows:
        lines.append(
            "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()) + " |"
        )
    lines += ["", *[f"- {v}" for v in verdicts], ""]
    (RESULTS_DIR / "trust_cost.md").write_text("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--passes", type=int, default=None, help="pipeline passes (default 8; worker 3)")
    parser.add_argument("--numel", type=int, default=1 << 19)
    parser.add_argument("--rounds", type=int, default=None, help="ring rounds (default 10; worker 6)")
    parser.add_argument("--blocks", type=int, default=None, help="ABBA blocks (default 3; quick 2)")
    cli = parser.parse_args()
    if cli.worker:
        _worker(cli.passes or 3, cli.numel, cli.rounds or 6)
    else:
        sys.path.insert(0, str(_ROOT))
        main(quick=cli.quick, blocks=cli.blocks, passes=cli.passes, rounds=cli.rounds)
