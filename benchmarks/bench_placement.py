"""DT-FM placement: our search vs. best-known costs, vs. a plain annealer on hard cases, and its curve.

Part ``public``: each scenario of ``data/networks.json`` (a copy of the DT-FM paper's public settings)
gets its latency/bandwidth matrices with the conventions of ``data/placement_best_known.json`` (alpha =
RTT in seconds as given, beta = Gbit/s * 1e9 / 8 bytes/s, links symmetric; intra-group links inside a
device group, ``inter``/``inter_default`` between groups); the mean cost of random placements must
reproduce the file's ``random_matched_mean`` (this validates the conventions). Then `hybrid_search`
runs per seed within a CPU budget (``time.process_time``), with the structure-aware starts and -- the
ablation -- without them; costs are reported as ratios to the best-known value.

Part ``hard``: the noisy world-wide cases of `placement_cases` (no clean sites, no twins); ours and the
plain annealer of `placement_baseline` get the same CPU budget per seed; costs are ratios to the case's
reference (`data/placement_references.json`, the best any of our methods found with a long budget).
The best-so-far curves (CPU seconds vs. cost) of both go to ``results/placement.png``.

Full run (what the issue asks)::

    PYTHONPATH=src:. nice -n 19 python -m benchmarks.bench_placement --seeds 0 1 2 --budget-s 60

Each part is saved under ``results/placement_parts/`` and ``placement.{json,md}`` merge the parts that
exist, so the two parts can run as separate processes (``--parts public`` / ``--parts hard``). A run
replaces only the rows (case, method, seed) it repeats: ``--only NAME...`` limits it to some scenarios
or cases, ``--no-plain`` skips the plain annealer (its earlier rows and curves stay). Public runs stop
once within 0.1% of the best-known value (``SearchConfig.target_cost``): the time to reach it is the
row's ``time_to_best_cpu_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import RESULTS_DIR, record
from benchmarks.placement_baseline import plain_anneal
from benchmarks.placement_cases import default_cases, load_references, save_references
from ravnest_p2p.planning.dtfm import CostModel, Workload, random_placement
from ravnest_p2p.planning.dtfm_search import SearchConfig, hybrid_search

DATA_DIR = Path(__file__).resolve().parent / "data"
PARTS_DIR = RESULTS_DIR / "placement_parts"
RANDOM_SAMPLES = 200
TARGET_SLACK = 1.001  # best-known values are rounded to 0.01 s: within 0.1% counts as reaching them


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA_DIR / name).read_text())
    return data


def inter_link(scenario: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    """[delay_ms, Gbit/s] between groups named a and b of a networks.json scenario: its ``inter`` table
    (each unordered pair listed once), else its ``inter_default``; KeyError when it has neither."""
    pair = scenario.get("inter", {}).get(a, {}).get(b) or scenario.get("inter", {}).get(b, {}).get(a)
    if pair is None:
        if "inter_default" not in scenario:
            raise KeyError(f"no inter link between {a!r} and {b!r}")
        pair = (scenario["inter_default"]["delay_ms"], scenario["inter_default"]["bandwidth_gbps"])
    return float(pair[0]), float(pair[1])


def build_matrices(scenario: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(latency_s, bandwidth_bytes_per_s)`` for one scenario of networks.json."""
    group_of: list[int] = []
    name_of: list[str] = []
    for index, (name, count) in enumerate(scenario["groups"]):
        group_of += [index] * count
        name_of += [name] * count

    def link(i: int, j: int) -> tuple[float, float]:
        if group_of[i] == group_of[j]:
            return scenario["intra"]["delay_ms"], scenario["intra"]["bandwidth_gbps"]
        return inter_link(scenario, name_of[i], name_of[j])

    n = len(group_of)
    latency, bandwidth = np.zeros((n, n)), np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            delay_ms, gbps = link(i, j)
            latency[i, j] = delay_ms / 1000.0
            bandwidth[i, j] = gbps * 1e9 / 8
    return latency, bandwidth


def run_public(
    seeds: Sequence[int], budget_s: float, stall_s: float, only: Sequence[str] = ()
) -> list[dict[str, Any]]:
    networks = _load("networks.json")
    known = _load("placement_best_known.json")
    w = networks["workload"]
    workload = Workload(w["num_stages"], w["num_replicas"], w["c_dp_bytes"], w["c_pp_bytes"])
    rows: list[dict[str, Any]] = []
    for name, scenario in networks["scenarios"].items():
        if only and name not in only:
            continue
        model = CostModel(*build_matrices(scenario), workload)
        best_known = float(known["best_known"][name])
        rng = np.random.default_rng(12345)
        random_mean = float(
            np.mean([model.cost(random_placement(workload, rng)) for _ in range(RANDOM_SAMPLES)])
        )
        expected = float(known["random_matched_mean"][name])
        if abs(random_mean - expected) > 0.02 * expected:
            raise AssertionError(f"{name}: random mean {random_mean:.3f} != file's {expected}")
        for seed in seeds:
            for structure in (True, False):
                config = SearchConfig(
                    cpu_budget_s=budget_s,
                    stall_s=stall_s if structure else None,
                    seed=seed,
                    structure_seeds=structure,
                    target_cost=best_known * TARGET_SLACK,
                )
                started = time.process_time()
                result = hybrid_search(model, config)
                cpu_s = time.process_time() - started
                model.check(result.placement)
                rows.append(
                    {
                        "part": "public",
                        "case": name,
                        "method": "ours" if structure else "ours, no structure starts",
                        "seed": seed,
                        "reference_s": best_known,
                        "random_ratio": random_mean / best_known,
                        "cost_s": result.cost,
                        "ratio": result.cost / best_known,
                        "time_to_best_cpu_s": result.best_found_cpu_s,
                        "load_1min": round(os.getloadavg()[0], 1),
                        "cpu_s": cpu_s,
                        "cycles": result.generations,
                        "proposals": result.evaluations,
                    }
                )
                print(rows[-1], flush=True)
    return rows


def run_hard(
    seeds: Sequence[int], budget_s: float, *, plain: bool = True, only: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    refs = load_references()
    rows: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    for case in default_cases():
        if only and case.name not in only:
            continue
        model = case.model()
        reference = refs.get(case.name, {}).get("cost_s")
        for seed in seeds:
            started = time.process_time()
            ours = hybrid_search(model, SearchConfig(cpu_budget_s=budget_s, seed=seed))
            ours_cpu = time.process_time() - started
            runs = [("ours", ours.cost, ours_cpu, ours.placement)]
            plain_curve: list[tuple[float, float]] = []
            if plain:
                started = time.process_time()
                plain_placement, plain_cost, plain_curve = plain_anneal(model, budget_s, seed)
                runs.append(("plain annealing", plain_cost, time.process_time() - started, plain_placement))
            for method, cost, cpu_s, placement in runs:
                rows.append(
                    {
                        "part": "hard",
                        "case": case.name,
                        "method": method,
                        "seed": seed,
                        "reference_s": reference,
                        "cost_s": cost,
                        "ratio": cost / reference if reference else None,
                        "cpu_s": cpu_s,
                        "cycles": ours.generations if method == "ours" else None,
                        "proposals": ours.evaluations if method == "ours" else None,
                        "time_to_best_cpu_s": ours.best_found_cpu_s if method == "ours" else None,
                        "load_1min": round(os.getloadavg()[0], 1),
                        "placement": [[int(d) for d in group] for group in placement],
                    }
                )
                print(_without_placement(rows[-1]), flush=True)
            if seed == seeds[0]:
                curves[case.name] = {"ours": list(ours.curve), "reference": reference}
                if plain:
                    curves[case.name]["plain annealing"] = plain_curve
    return rows, curves


def _without_placement(row: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key != "placement"}


def _plot(curves: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not curves:
        return False
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 4), squeeze=False)
    for ax, (name, data) in zip(axes[0], sorted(curves.items()), strict=True):
        for label, style in (("ours", "-"), ("plain annealing", "--")):
            points = data.get(label) or []
            if points:
                xs = [max(p[0], 1e-2) for p in points]
                ys = [p[1] for p in points]
                ax.step(xs, ys, style, where="post", label=label)
        if data.get("reference"):
            ax.axhline(data["reference"], color="grey", linewidth=0.8, label="reference")
        ax.set_xscale("log")
        ax.set_xlabel("CPU seconds")
        ax.set_ylabel("best DT-FM cost so far (s/iteration)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def merge(settings: dict[str, Any]) -> None:
    """Write placement.{json,md} (+ png) from the part files that exist."""
    rows: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    ran: list[str] = []
    for part in ("public", "hard"):
        path = PARTS_DIR / f"{part}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            rows += data["rows"]
            curves.update(data.get("curves", {}))
            ran.append(f"{part}: {data['settings']}")
    # Hard-case references: the file's value, or any benchmark run that beat it (then saved back).
    refs = load_references()
    for row in rows:
        if row["part"] != "hard":
            continue
        ref = refs.get(row["case"])
        if ref is None or row["cost_s"] < ref["cost_s"]:
            refs[row["case"]] = {"cost_s": row["cost_s"], "method": f"bench_placement: {row['method']}",
                                 "seed": row["seed"], "budget_cpu_s": settings.get("budget_cpu_s"),
                                 "cpu_s": round(row["cpu_s"], 1),
                                 "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
            if row.get("placement"):  # rows of runs before session 14 did not keep it
                refs[row["case"]]["placement"] = row["placement"]
            # the history stays: the replaced entry (with its own previous) and the long runs
            if ref is not None:
                refs[row["case"]]["previous"] = {k: v for k, v in ref.items() if k != "long_runs"}
                if ref.get("long_runs"):
                    refs[row["case"]]["long_runs"] = ref["long_runs"]
    if refs:
        save_references(refs)
    rows = [_without_placement(row) for row in rows]  # placements stay in the part files
    for row in rows:
        if row["part"] == "hard":
            row["reference_s"] = refs[row["case"]]["cost_s"]
            row["ratio"] = row["cost_s"] / row["reference_s"]
    for name, data in curves.items():
        if name in refs:
            data["reference"] = refs[name]["cost_s"]
    plotted = _plot(curves, RESULTS_DIR / "placement.png")
    notes = (
        "DT-FM communication cost (s/iteration); `ratio` = cost / reference (public: the best-known value "
        "of data/placement_best_known.json; hard: data/placement_references.json, the best any of our "
        "searches found with a long budget). `ours` = `hybrid_search` (annealing with incremental swap "
        "evaluation, structure-aware starts; on the noisy hard cases racing compiled annealers over "
        "placement and stage order, planning/dtfm_kernel.py, after a search over the groups' site "
        "mixes, planning/dtfm_mix.py, where the matrix has 2-16 sites); `ours, no structure starts` = "
        "the same from a random start; "
        "`plain annealing` = benchmarks/placement_baseline.py with the same CPU budget. CPU time is "
        "time.process_time. Hard-case references: `python -m benchmarks.placement_cases "
        "--reference-cpu-s 600` (one run per case, seed 100+i), replaced by any run that beats them; the "
        "file records, per case, the method, its CPU budget and the CPU it used (the issue asks >= 600 s). "
        "networks.json holds the five DT-FM scenarios; public runs stop once within 0.1% of the best known "
        "(TARGET_SLACK). A run with --no-plain keeps the plain annealer's rows of an earlier run (the "
        "part file keeps every row a run did not repeat; `Runs` below names each part's last run, each "
        "row its load). Runs: " + "; ".join(ran) + (". Curves: placement.png." if plotted else ".")
    )
    json_path = record("placement", rows, notes=notes)
    payload = json.loads(json_path.read_text())
    payload["curves"] = curves
    payload["settings"] = settings
    json_path.write_text(json.dumps(payload, indent=1, default=str) + "\n")


def _save_part(
    part: str, rows: list[dict[str, Any]], curves: dict[str, Any], settings: dict[str, Any]
) -> None:
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    path = PARTS_DIR / f"{part}.json"
    if path.is_file():  # keep the rows this run did not repeat (seeds, cases, methods can run separately)
        old = json.loads(path.read_text())
        fresh = {(r["case"], r["method"], r["seed"]) for r in rows}
        rows = [r for r in old["rows"] if (r["case"], r["method"], r["seed"]) not in fresh] + rows
        old_curves = old.get("curves", {})
        curves = {**old_curves, **{name: {**old_curves.get(name, {}), **c} for name, c in curves.items()}}
        seeds = sorted({r["seed"] for r in rows})
        settings = {**settings, "seeds": seeds}
    payload = {"rows": rows, "curves": curves, "settings": settings}
    (PARTS_DIR / f"{part}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")


def main(
    quick: bool,
    seeds: Sequence[int] | None = None,
    budget_s: float | None = None,
    parts: str = "all",
    *,
    plain: bool = True,
    only: Sequence[str] = (),
) -> None:
    seeds = list(seeds) if seeds else ([0] if quick else [0, 1, 2])
    budget = budget_s if budget_s is not None else (10.0 if quick else 60.0)
    stall_s = max(budget / 4, 5.0)
    head = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(head, capture_output=True, text=True, check=False)
    settings = {"seeds": seeds, "budget_cpu_s": budget, "public_stall_cpu_s": stall_s,
                "commit": commit.stdout.strip(), "plain": plain}  # fmt: skip
    if parts in ("all", "public"):
        _save_part("public", run_public(seeds, budget, stall_s, only), {}, settings)
    if parts in ("all", "hard"):
        rows, curves = run_hard(seeds, budget, plain=plain, only=only)
        _save_part("hard", rows, curves, settings)
    merge(settings)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_placement")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--parts", choices=("all", "public", "hard", "none"), default="all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-plain", action="store_true", help="hard part: ours only (keep old plain rows)")
    parser.add_argument("--only", nargs="*", default=(), help="these scenario / case names only")
    args = parser.parse_args()
    main(args.quick, args.seeds, args.budget_s, args.parts, plain=not args.no_plain, only=args.only)
