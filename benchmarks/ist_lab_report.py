# ruff: noqa: E501  (the result text is long table rows and prose)
"""Tables and plots of `bench_ist_lab`: time- and bytes-to-accuracy of IST, data parallel and local SGD.

Per job: the training time is the workers' train loop (sync_backup: from the start barrier to the last
step; IST: every round without round 0's pull, which only waits for the others to start, plus the final
gather of the whole model), averaged over the workers; the time of sync i is the workers' mean
cumulative step (round) time. Bytes are what the worker's lab interface sent plus received during the
job (publication to the last worker's done; TCP/IP and libp2p framing and the swarm's background
traffic included), spread evenly over the job's syncs (IST's final gather included, which charges IST
a little early). The background column is an estimate for information only (the rate seen in 5 idle
seconds before the first job, start-up probes included, times the job's duration): it is not
subtracted. Accuracy after sync i comes from the replay.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
TARGETS = (0.95, 0.96, 0.97)
LABELS = {"ist": "IST", "dp": "data parallel", "local": "local SGD"}

__all__ = ["summarise", "write_report"]


def _wire_mb(result: dict[str, Any], n: int) -> tuple[float, float]:
    """(mean MB sent + received per worker during the job, of which background traffic)."""
    totals = [
        sum(after[k] - before[k] for k in ("rx_bytes", "tx_bytes"))
        for before, after in zip(result["counters_before"], result["counters_after"], strict=True)
    ]
    idle = result["idle"]
    idle_rate = statistics.fmean(
        sum(a[k] - b[k] for k in ("rx_bytes", "tx_bytes"))
        for b, a in zip(idle["before"], idle["after"], strict=True)
    ) / max(idle["seconds"], 1e-9)
    return statistics.fmean(totals) / 1e6, idle_rate * (result["ended"] - result["began"]) / 1e6


def _times(timings: list[dict[str, Any]], kind: str) -> tuple[list[float], float]:
    """(mean cumulative time after each sync, mean train time) over the workers."""
    if kind == "ist":
        series = [
            [t - w["round_pull_s"][0] for t in itertools.accumulate(w["round_s"])]
            for w in timings
            if w["round_s"]
        ]
        train = statistics.fmean(s[-1] + w["final_pull_s"] for s, w in zip(series, timings, strict=True))
    else:
        series = [list(itertools.accumulate(w["step_times_s"])) for w in timings]
        train = statistics.fmean(w["train_s"] for w in timings)
    length = min(len(s) for s in series)
    return [statistics.fmean(s[i] for s in series) for i in range(length)], train


def summarise(cell: dict[str, Any], curves: dict[str, list[tuple[int, float]]]) -> list[dict[str, Any]]:
    rows = []
    n = cell["n"]
    for result in cell["results"]:
        run = result["run"]
        kind = "ist" if run == "ist" else "sync"
        timings = [t for t in cell["timings"] if t["job_id"] == result["job_id"] and t["kind"] == kind]
        times, train_s = _times(timings, kind)
        wire_mb, idle_mb = _wire_mb(result, n)
        net_mb = wire_mb  # the background estimate is too rough to subtract (see module docstring)
        curve = curves[f"{run}/{n}"]
        syncs = len(times)
        points = []
        for sync, acc in curve:
            at = train_s if sync >= syncs else times[sync - 1]
            points.append(
                {"sync": sync, "s": round(at, 2), "mb": round(net_mb * sync / syncs, 2), "acc": acc}
            )
        done = [m for m in result["metrics"] if m["done"] and m["eval_accuracy"] is not None]
        row: dict[str, Any] = {
            "n": n,
            "rate_mbps": cell["rate_mbps"],
            "run": run,
            "syncs": syncs,
            "train_s": round(train_s, 1),
            "job_wall_s": round(result["ended"] - result["began"], 1),
            "wire_mb_per_worker": round(net_mb, 1),
            "background_mb_per_worker": round(idle_mb, 1),
            "lab_accuracy": round(statistics.fmean(m["eval_accuracy"] for m in done), 4) if done else None,
            "replay_accuracy": round(curve[-1][1], 4),
            "points": points,
        }
        for target in TARGETS:
            hit = next((p for p in points if p["acc"] >= target), None)
            row[f"s_to_{target}"] = hit["s"] if hit else None
            row[f"mb_to_{target}"] = hit["mb"] if hit else None
        rows.append(row)
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def comparisons(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: IST against data parallel and local SGD (ratios > 1: IST is faster / moves less)."""
    out = []
    for (n, rate), group in itertools.groupby(rows, key=lambda r: (r["n"], r["rate_mbps"])):
        by = {r["run"]: r for r in group}
        ist = by.get("ist")
        if ist is None:
            continue
        cmp: dict[str, Any] = {"n": n, "rate_mbps": rate}
        for other in ("dp", "local"):
            if other not in by:
                continue
            o = by[other]
            if ist["lab_accuracy"] is not None and o["lab_accuracy"] is not None:
                cmp[f"acc_ist_minus_{other}_points"] = round(
                    100 * (ist["lab_accuracy"] - o["lab_accuracy"]), 2
                )
            cmp[f"train_s_{other}_over_ist"] = _ratio(o["train_s"], ist["train_s"])
            cmp[f"mb_{other}_over_ist"] = _ratio(o["wire_mb_per_worker"], ist["wire_mb_per_worker"])
            for target in TARGETS:
                cmp[f"s_to_{target}_{other}_over_ist"] = _ratio(o[f"s_to_{target}"], ist[f"s_to_{target}"])
                cmp[f"mb_to_{target}_{other}_over_ist"] = _ratio(o[f"mb_to_{target}"], ist[f"mb_to_{target}"])
        out.append(cmp)
    return out


def _fmt(value: Any) -> str:
    return "—" if value is None else str(value)


def markdown(rows: list[dict[str, Any]], cmps: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    job = meta["job"]
    widths = job["model_params"]["hidden_features"]
    lines = [
        f"# IST vs data parallel vs local SGD on the lab (wide_mlp 64-{widths[0]}-{widths[1]}-10, digits)",
        "",
        f"{job['num_epochs']} epochs, batch {job['batch_size']} per worker, plain SGD lr {job['optimizer']['lr']},",
        f"K = {meta['local_steps']} (IST round, local SGD period). Peers CPU-capped to {meta['cpus']:g} CPU together",
        "(one compute thread each); htb links at the cell's rate both ways. Host load (1 min, 2 CPUs, other",
        f"sessions): median {meta['load_median']:.1f}, max {meta['load_max']:.1f}. Lab {meta['lab_s']} s, replay",
        f"{meta['replay_s']} s (cached). Definitions: benchmarks/ist_lab_report.py. MB: sent + received per worker.",
        "",
        "| n | Mbit/s | mode | syncs | train s | job wall s | MB / worker | background MB | acc (lab) | acc (replay) | "
        + " | ".join(f"s to {t}" for t in TARGETS)
        + " | "
        + " | ".join(f"MB to {t}" for t in TARGETS)
        + " |",
        "|" + "---|" * (10 + 2 * len(TARGETS)),
    ]
    for r in rows:
        cells = [r["n"], f"{r['rate_mbps']:g}", LABELS[r["run"]], r["syncs"], r["train_s"], r["job_wall_s"]]
        cells += [
            r["wire_mb_per_worker"],
            r["background_mb_per_worker"],
            r["lab_accuracy"],
            r["replay_accuracy"],
        ]
        cells += [r[f"s_to_{t}"] for t in TARGETS] + [r[f"mb_to_{t}"] for t in TARGETS]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += ["", "IST against the others (ratio > 1: IST faster / fewer bytes):", ""]
    keys = sorted({k for c in cmps for k in c if k not in ("n", "rate_mbps")})
    lines += ["| n | Mbit/s | " + " | ".join(keys) + " |", "|" + "---|" * (2 + len(keys))]
    for c in cmps:
        lines.append(f"| {c['n']} | {c['rate_mbps']:g} | " + " | ".join(_fmt(c.get(k)) for k in keys) + " |")
    lines += ["", f"Command: `{meta['command']}` (root).", ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["n"], r["rate_mbps"]) for r in rows})
    fig, axes = plt.subplots(2, len(cells), figsize=(4 * len(cells), 7), squeeze=False)
    colors = {"ist": "tab:red", "dp": "tab:blue", "local": "tab:green"}
    for col, (n, rate) in enumerate(cells):
        for r in (r for r in rows if (r["n"], r["rate_mbps"]) == (n, rate)):
            pts = r["points"]
            for row, key in ((0, "s"), (1, "mb")):
                axes[row][col].plot(
                    [p[key] for p in pts],
                    [p["acc"] for p in pts],
                    "o-",
                    ms=3,
                    color=colors[r["run"]],
                    label=LABELS[r["run"]],
                )
        axes[0][col].set_title(f"n = {n}, {rate:g} Mbit/s", fontsize=10)
        axes[0][col].set_xlabel("train time (s)")
        axes[1][col].set_xlabel("MB sent + received per worker")
        axes[1][col].set_xscale("log")
        for row in (0, 1):
            axes[row][col].set_ylim(0.85, 1.0)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out accuracy")
    axes[1][0].set_ylabel("held-out accuracy")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    name: str, cells: list[dict[str, Any]], curves: dict[str, list[tuple[int, float]]], meta: dict[str, Any]
) -> None:
    rows = [row for cell in cells for row in summarise(cell, curves)]
    cmps = comparisons(rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "comparisons": cmps, "cells": cells}, indent=1) + "\n"
    )
    (RESULTS / f"{name}.md").write_text(markdown(rows, cmps, meta))
    plot(rows, RESULTS / f"{name}.png")
    for row in rows:
        print({k: v for k, v in row.items() if k != "points"}, flush=True)
    for cmp in cmps:
        print(cmp, flush=True)
