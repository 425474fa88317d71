"""End to end on the lab: the planner's placement vs a random one, same peers, same job, one run.

Eight real peers run a `peers/scenario_*.toml` profile (DT-FM's scenarios scaled down: per-destination
htb rates, every peer CPU-capped to the same share) and probe each other until every record reports
its links to the other seven. A researcher in its own namespace (`benchmarks.plan_vs_random_driver`)
then plans a pipeline + data-parallel job with `RunClient.plan(records, job)` (the measured link matrix,
the planner the peers' agreement runs) and trains, interleaved A B C A B C A B C on the same peers:
A = the planned placement, B = a seeded random placement of the same peers into the same clusters x
stages (same layer ranges), C = the planner without the link matrix (`use_links=False`: each peer's own
up/down figures), which tells what the measured matrix itself earns (``--no-unlinked``: A B A B A B).
Interleaving makes the drift of the shared host's load hit every arm.

Workload: an MLP of 3 hidden layers of width 128 + head (4 cuttable layers, so 2 clusters x 4 stages),
micro-batches of 2048 samples: every stage boundary carries 2048 x 128 x 4 B = 1 MiB forward and the
same gradient back. The profiles' scaled pipeline messages are 10.1 MB (multi_datacenter), 50.6 MB
(regional) and 86.0 MB (world_wide); ours is about 1/10, 1/50 and 1/80 of those, so that a run of 60
micro-batches fits in minutes, and the model is kept narrow so that at the fast rate (200 Mbit/s: 44 ms
per MiB) compute per stage is of the same order as a transfer while a slow cross-site hop dominates
(multi_datacenter's 22.4 Mbit/s: 390 ms; world_wide's slowest, seoul-ireland 57 Mbit/s: 147 ms): the
regime of DT-FM's comparison (communication-bound geo-distributed training). Averaging between the two
clusters every 10 micro-batches: its payload (one stage's weights, <= 66 KB) is small, unlike the
paper's. The same job runs on every profile.

A run rewrites only its own profiles' rows in `results/plan_vs_random.json`: the other profiles' rows
and runs are kept from the file (each row says when it ran, ``run_utc``, and its host load).

Usage (root; about 10 min per profile on the shared 2-core host)::

    python -m benchmarks.bench_plan_vs_random --profiles multi_datacenter regional world_wide
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import RESULTS_DIR, machine_facts, record
from ravnest_p2p.lab import load_profile
from ravnest_p2p.lab.launcher import Swarm
from ravnest_p2p.lab.profiles import SwarmProfile
from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.swarm import poll_until
from ravnest_p2p.training.job import JobSpec

COLORS = {"A": "tab:blue", "B": "tab:orange", "C": "tab:gray"}
REPO = Path(__file__).resolve().parents[1]
DTFM_WORLD_WIDE_SPEEDUP = 2.7  # DT-FM (Yuan et al., NeurIPS 2022): up to 2.7x over random, world-wide case
ORDER = ["A", "B", "C"] * 3
SEEDS = [11, 12, 13]
PROFILES = ["multi_datacenter", "regional", "world_wide"]

# Probes: the defaults (every 30 s, 2 peers a round, every 2 s until each peer was probed once) already
# measure all 7 pairs within a minute; fanout 4 halves that, and a long period keeps probe traffic out
# of the timed runs. Jobs are picked up within 0.5 s.
PEER_CONFIG = """
job_poll_s = 0.5
check_identity_free = false

[probe]
period_s = 120.0
fanout = 4
"""


def job(*, max_steps: int) -> JobSpec:
    return JobSpec(
        job_id="pvr",
        model="mlp",
        model_params={"in_features": 128, "hidden_features": [128, 128, 128], "out_features": 8},
        dataset="synthetic_classification",
        dataset_config={"num_samples": 40_000, "in_features": 128, "num_classes": 8},
        batch_size=2048,
        num_epochs=50,  # a cluster's half of the train split is 7 micro-batches: wrap
        max_steps=max_steps,
        averaging_period_steps=10,
        optimizer=OptimizerConfig(name="sgd", lr=0.01),
    )


def true_rate_mbps(profile: SwarmProfile, src: str, dst: str) -> float:
    """The emulated rate src -> dst: its per-destination (else total) upload, capped by dst's download."""
    a, b = profile.peers[profile.index_of(src)], profile.peers[profile.index_of(dst)]
    up = a.upload_to_mbps.get(dst, a.upload_mbps) if a.upload_to_mbps else a.upload_mbps
    rates = [r for r in (up, b.download_mbps) if r is not None]
    return min(rates) if rates else float("inf")


def slowed(profile: SwarmProfile, factor: float) -> SwarmProfile:
    """`profile` with every rate (and its `scale`) times `factor`: the same contrasts, slower wires."""

    def rate(mbps: float | None) -> float | None:
        return None if mbps is None else mbps * factor

    peers = [
        p.model_copy(
            update={
                "upload_mbps": rate(p.upload_mbps),
                "download_mbps": rate(p.download_mbps),
                "upload_to_mbps": {k: v * factor for k, v in p.upload_to_mbps.items()},
            }
        )
        for p in profile.peers
    ]
    return profile.model_copy(update={"peers": peers, "scale": profile.scale * factor})


def samples_per_s(run: dict[str, Any], batch: int) -> float:
    """The job's rate: each cluster's first stage, micro-batches x batch / its training wall time, summed."""
    firsts = [m for m in run["metrics"] if m["stage"] == 0]
    return sum(m["step"] * batch / max(m["train_wall_s"], 1e-9) for m in firsts)


def _slowest_hops(placement: list[list[dict[str, Any]]], names: dict[str, str], profile: SwarmProfile) -> str:
    """Per cluster, the slowest emulated rate along its pipeline (either direction), Mbit/s."""
    out = []
    for cluster in placement:
        ids = [names[s["peer_id"]] for s in cluster]
        hops = [
            min(true_rate_mbps(profile, a, b), true_rate_mbps(profile, b, a))
            for a, b in itertools.pairwise(ids)
        ]
        out.append(f"{min(hops):g}" if hops else "-")
    return "/".join(out)


def run_profile(
    name: str, *, max_steps: int, order: list[str], workdir: Path, rate_factor: float = 1.0
) -> dict[str, Any]:
    """One lab of `peers/scenario_<name>.toml` (rates x `rate_factor`): measure links, train `order`."""
    path = REPO / "peers" / f"scenario_{name}.toml"
    profile = slowed(load_profile(path), rate_factor)
    config = workdir / "peer.toml"
    config.write_text(PEER_CONFIG)
    spec = job(max_steps=max_steps)
    prefix = "lp" + os.urandom(2).hex()
    out = workdir / f"{name}.json"
    started = time.monotonic()
    with Swarm(profile, netns=True, prefix=prefix, profile_path=str(path), peer_config=config) as swarm:
        assert swarm.lab is not None
        names = {m.peer_id: m.name for m in swarm.peers if m.peer_id}
        argv = [sys.executable, "-m", "benchmarks.plan_vs_random_driver", "--run-id", swarm.run_id]
        argv += ["--initial-peers", *swarm.initial_peers, "--num-peers", str(len(profile.peers))]
        argv += ["--min-links", str(len(profile.peers) - 1), "--min-stages", "4"]
        argv += ["--job", spec.model_dump_json(), "--out", str(out), "--order", *order]
        argv += ["--seeds", *map(str, SEEDS)]
        log = workdir / f"{name}-driver.log"
        driver = swarm.lab.run_in_ns(len(profile.peers), argv, log_path=log, cwd=str(REPO))
        try:
            poll_until(lambda: driver.poll() is not None, 2400, what="the driver", interval_s=2)
        finally:
            if driver.poll() is None:
                driver.kill()  # our own child, by pid; the swarm's stop removes the rest
        if driver.returncode != 0:
            raise RuntimeError(log.read_text(errors="replace")[-4000:])
        result: dict[str, Any] = json.loads(out.read_text())
    result["profile"] = name if rate_factor == 1 else f"{name} (rates x{rate_factor:g})"
    result["rate_factor"] = rate_factor
    result["prefix"] = prefix
    result["names"] = names
    result["elapsed_s"] = time.monotonic() - started
    result["run_utc"] = machine_facts()["time_utc"]
    for run in result["runs"]:
        run["samples_per_s"] = samples_per_s(run, spec.batch_size)
        run["slowest_hop_mbps"] = _slowest_hops(result["placements"][run["placement"]], names, profile)
    return result


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    runs = result["runs"]
    planned = [r["samples_per_s"] for r in runs if r["kind"] == "A"]
    rand = [r["samples_per_s"] for r in runs if r["kind"] == "B"]
    unlinked = [r["samples_per_s"] for r in runs if r["kind"] == "C"]
    pairs = [a / b for a, b in zip(planned, rand, strict=True)]
    loads = [r["load_before"][0] for r in runs] + [r["load_after"][0] for r in runs]
    return {
        "profile": result["profile"],
        "planned_samples_per_s": "/".join(f"{x:.0f}" for x in planned),
        "random_samples_per_s": "/".join(f"{x:.0f}" for x in rand),
        "random_seeds": "/".join(str(r["seed"]) for r in runs if r["kind"] == "B"),
        "planned_over_random": statistics.mean(planned) / statistics.mean(rand),
        "pair_ratios": "/".join(f"{x:.2f}" for x in pairs),
        "unlinked_samples_per_s": "/".join(f"{x:.0f}" for x in unlinked) or "-",
        "planned_over_unlinked": statistics.mean(planned) / statistics.mean(unlinked) if unlinked else "-",
        "planned_slowest_hop_mbps": next(r["slowest_hop_mbps"] for r in runs if r["kind"] == "A"),
        "unlinked_slowest_hop_mbps": next((r["slowest_hop_mbps"] for r in runs if r["kind"] == "C"), "-"),
        "random_slowest_hop_mbps": "; ".join(r["slowest_hop_mbps"] for r in runs if r["kind"] == "B"),
        "load_1min": f"{min(loads):.1f}-{max(loads):.1f}",
        "links_wait_s": result["links_wait_s"],
        "dtfm_world_wide": DTFM_WORLD_WIDE_SPEEDUP,
        "run_utc": result["run_utc"],
    }


def plot(rows: list[dict[str, Any]], results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3 + 2.5 * len(results), 4))
    num_runs = max(len(r["runs"]) for r in results)
    width = 0.8 / num_runs
    for p, result in enumerate(results):
        for i, run in enumerate(result["runs"]):
            color = COLORS[run["kind"]]
            ax.bar(p + (i - (num_runs - 1) / 2) * width, run["samples_per_s"], width * 0.9, color=color)
        top = max(run["samples_per_s"] for run in result["runs"])
        ax.text(p, top * 1.02, f"planned / random = {rows[p]['planned_over_random']:.2f}x", ha="center")
    ax.set_xticks(range(len(results)), [r["profile"] for r in results])
    ax.set_ylabel("samples/s (2 clusters x 4 stages)")
    order = " ".join(run["kind"] for run in results[0]["runs"])
    ax.set_title(f"A planned (blue), B random (orange), C planned without links (grey): {order}", fontsize=9)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


NOTES = (
    "8 peer processes in lab namespaces running a DT-FM scenario profile (scaled, per-destination htb "
    "rates, CPU-capped equally), researcher in its own namespace. After every record reported links "
    "to the 7 others, one job (MLP 128-128-128-8, micro-batch 2048 = 1 MiB per stage boundary, 60 "
    "micro-batches per cluster, 2 clusters x 4 stages, averaging every 10) trained in the order "
    "A B C A B C A B C: A = RunClient.plan(records, job) with the measured link matrix; B = the same "
    "shape filled with a seeded shuffle of the same peers; C = RunClient.plan(records, job, "
    "use_links=False). samples/s = sum over clusters of first-stage micro-batches x batch / training "
    "wall time. planned_over_random = mean(A) / mean(B); pair_ratios = A_i / B_i; "
    "planned_over_unlinked = mean(A) / mean(C). slowest_hop = per cluster, the slowest emulated rate "
    "between consecutive stages. load_1min = the host's 1-minute load average over the runs (2 CPUs). "
    "DT-FM reports up to 2.7x over random in its world-wide case. "
    "world_wide = peers/scenario_world_wide.toml "
    "(DT-FM's 8 regions, one peer each, scale 0.17: 57-197 Mbit/s); '(rates x0.25)' = the same profile "
    "with every rate x0.25 (--rate-factor 0.25: 14-49 Mbit/s), slow enough that the wire, not this "
    "host's CPU (~230 ms per micro-batch), bounds a stage. Rows are kept across runs: each says when it "
    "ran (run_utc) and its load. "
    "Command: python -m benchmarks.bench_plan_vs_random [--profiles NAME ...] [--rate-factor F]"
)


def merge(
    old: dict[str, Any] | None, rows: list[dict[str, Any]], results: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows and runs to keep: the previous file's profiles not run now, then this run's.

    A profile run again replaces its old row and runs; rows of earlier runs keep their own date
    (``run_utc``, taken from the old file's machine facts when the row predates the column) and load.
    """
    if not old:
        return rows, results
    fresh = {r["profile"] for r in rows}
    old_date = old.get("machine", {}).get("time_utc", "")
    kept_rows = [
        {**r, "run_utc": r.get("run_utc", old_date)} for r in old["rows"] if r["profile"] not in fresh
    ]
    kept_runs = [r for r in old.get("runs", []) if r["profile"] not in fresh]
    return kept_rows + rows, kept_runs + results


def main(
    quick: bool = False, profiles: list[str] | None = None, unlinked: bool = True, rate_factor: float = 1.0
) -> None:
    profiles = profiles or PROFILES
    order = ORDER if unlinked else [k for k in ORDER if k != "C"]
    max_steps = 30 if quick else 60
    results = []
    with tempfile.TemporaryDirectory(prefix="ravnest-lp-") as tmp:
        for name in profiles:
            result = run_profile(
                name, max_steps=max_steps, order=order, workdir=Path(tmp), rate_factor=rate_factor
            )
            results.append(result)
            print(json.dumps(summarise(results[-1])), flush=True)
    json_path = RESULTS_DIR / "plan_vs_random.json"
    old = json.loads(json_path.read_text()) if json_path.exists() else None
    rows, results = merge(old, [summarise(r) for r in results], results)
    record("plan_vs_random", rows, notes=NOTES)
    payload = json.loads(json_path.read_text())
    payload["runs"] = results
    json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    plot(rows, results, RESULTS_DIR / "plan_vs_random.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_plan_vs_random")
    parser.add_argument("--profiles", nargs="+", default=PROFILES, help="peers/scenario_<name>.toml")
    parser.add_argument("--quick", action="store_true", help="30 micro-batches per run instead of 60")
    parser.add_argument(
        "--no-unlinked", action="store_true", help="only A and B (no C: planned with use_links=False)"
    )
    parser.add_argument(
        "--rate-factor",
        type=float,
        default=1.0,
        help="multiply every rate of the profiles (rows are named '<profile> (rates x<factor>)')",
    )
    cli = parser.parse_args()
    main(quick=cli.quick, profiles=cli.profiles, unlinked=not cli.no_unlinked, rate_factor=cli.rate_factor)
