"""Curves and results of `bench_bytes_to_target`: loss over bytes and wall time, bytes to the target.

A run's curve comes from the driver's trace (every 0.5 s poll of the stages' metrics): a stage's
evaluation is the first poll that shows its new held-out loss, with the step, `averaging_bytes_sent` and
`train_wall_s` published beside it (right after the evaluation, unless the poll missed that record; then
the next periodic record, up to 2 s later: bytes and wall a little late, never early). Per evaluation
(step // eval_every) the clusters' losses are averaged (each cluster evaluates its own replica), bytes
are the mean per peer (= per cluster: one stage each) and wall is the slowest cluster's. The last point
is the final metrics, after the closing round.

Seeds: every run carries its job's `seed` (data order and initial weights); each seed's runs are compared
with that seed's "every step" (its target), and the per-mode table gives the spread over seeds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import _markdown_table, record

__all__ = ["by_mode", "curve", "summarise", "to_target", "write_results"]


def curve(result: dict[str, Any], every: int) -> dict[str, Any]:
    """One run's evaluations (mean over clusters) and its final point, from `pipeline_driver --trace`."""
    seen: dict[int, float | None] = {}  # cluster -> last held-out loss seen
    evals: dict[int, dict[int, tuple[float, int, float]]] = {}  # step // every -> cluster -> point
    loads = [row["load"] for row in result["trace"] if "load" in row]
    for row in result["trace"]:
        for cluster, _stage, step, loss, sent, _rounds, wall in row["stages"]:
            if loss is None or seen.get(cluster) == loss:
                continue
            seen[cluster] = loss
            evals.setdefault(step // every, {}).setdefault(cluster, (loss, sent, wall))
    final = result["metrics"]
    num = len(final)
    points = []
    for index in sorted(evals):
        got = evals[index]
        if index == 0 or len(got) < num:  # a cluster's record was missed: leave the evaluation out
            continue
        losses = [p[0] for p in got.values()]
        points.append(
            {
                "step": index * every,
                "loss": sum(losses) / num,
                "loss_max": max(losses),
                "bytes_per_peer": sum(p[1] for p in got.values()) / num,
                "wall_s": max(p[2] for p in got.values()),
            }
        )
    last = {
        "step": min(m["step"] for m in final),
        "loss": sum(m["eval_loss"] for m in final) / num,
        "loss_max": max(m["eval_loss"] for m in final),
        "bytes_per_peer": sum(m["averaging_bytes_sent"] for m in final) / num,
        "wall_s": max(m["train_wall_s"] for m in final),
        "final": True,
    }
    return {
        "points": [*points, last],
        "final_loss": last["loss"],
        "final_bytes_per_peer": last["bytes_per_peer"],
        "wall_s": last["wall_s"],
        "rounds": min(m["averaging_rounds"] for m in final),
        "load_1min": sum(loads) / len(loads) if loads else None,
    }


def to_target(points: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first point at or below `target`, or None."""
    return next((p for p in points if p["loss"] <= target), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else round(a / b, 1)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: final loss vs its seed's every step, bytes and wall to that final loss, and the ratios."""
    seeds: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        seeds.setdefault(r.get("seed", 0), []).append(r)
    return [{"seed": seed, **row} for seed, group in seeds.items() for row in _summarise_seed(group)]


def _spread(values: list[float | None], digits: int = 3) -> str | None:
    """'mean (min-max)' of the values, or None if any is missing (a seed did not get there)."""
    if not values or any(v is None for v in values):
        return None
    got = [float(v) for v in values if v is not None]
    mean = round(sum(got) / len(got), digits)
    return (
        f"{mean:g}"
        if len(got) == 1
        else f"{mean:g} ({round(min(got), digits):g}-{round(max(got), digits):g})"
    )


def by_mode(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode, over seeds: mean (min-max) of the final loss ratio, bytes and the x-fewer figures."""
    modes: dict[str, list[dict[str, Any]]] = {}
    for row in summary:
        modes.setdefault(row["mode"], []).append(row)
    out = []
    for mode, runs in modes.items():
        out.append(
            {
                "mode": mode,
                "seeds": len(runs),
                "final_vs_every_step": _spread([r["final_vs_every_step"] for r in runs], 4),
                "final_mb_per_peer": _spread([r["final_mb_per_peer"] for r in runs]),
                "mb_to_2pct": _spread([r["mb_to_2pct"] for r in runs], 4),
                "x_vs_every_step_2pct": _spread([r["x_vs_every_step_2pct"] for r in runs], 1),
                "x_vs_periodic_2pct": _spread([r["x_vs_periodic_2pct"] for r in runs], 1),
                "mb_to_target": _spread([r["mb_to_target"] for r in runs], 4),
                "x_vs_every_step": _spread([r["x_vs_every_step"] for r in runs], 1),
                "x_vs_periodic": _spread([r["x_vs_periodic"] for r in runs], 1),
                "wall_s_to_2pct": _spread([r["wall_s_to_2pct"] for r in runs], 1),
                "rounds_all_replicas": ", ".join(str(r["rounds_all_replicas"]) for r in runs),
                "load_1min": _spread([r["load_1min"] for r in runs], 1),
            }
        )
    return out


def _summarise_seed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    every = next(r for r in rows if r["mode"] == "every step")
    target = every["final_loss"]
    reached = {r["mode"]: to_target(r["points"], target) for r in rows}
    base = reached["every step"]
    periodic = next((reached[r["mode"]] for r in rows if r["mode"].startswith("periodic")), None)
    # a round really after every step: every step's mean bytes per round x the steps to the target
    per_round = every["final_bytes_per_peer"] / max(every["rounds"], 1)
    ideal = None if base is None else per_round * base["step"]
    # within 2 % of the target: the goal's tolerance, and the target's own spread from run to run
    near = {r["mode"]: to_target(r["points"], 1.02 * target) for r in rows}
    near_base = near["every step"]
    near_periodic = next((near[r["mode"]] for r in rows if r["mode"].startswith("periodic")), None)
    out = []
    for r in rows:
        hit = reached[r["mode"]]
        close = near[r["mode"]]
        close_sent = None if close is None else close["bytes_per_peer"]
        sent = None if hit is None else hit["bytes_per_peer"]
        out.append(
            {
                "mode": r["mode"],
                "final_val_loss": round(r["final_loss"], 4),
                "final_vs_every_step": round(r["final_loss"] / target, 4),
                "rounds": r["rounds"],
                "rounds_all_replicas": r.get("rounds_all_replicas"),
                "final_mb_per_peer": round(r["final_bytes_per_peer"] / 1e6, 3),
                "mb_to_target": None if sent is None else round(sent / 1e6, 4),
                "step_to_target": None if hit is None else hit["step"],
                "wall_s_to_target": None if hit is None else round(hit["wall_s"], 1),
                "wall_s": round(r["wall_s"], 1),
                "x_vs_every_step": _ratio(base["bytes_per_peer"] if base else None, sent),
                "x_vs_periodic": _ratio(periodic["bytes_per_peer"] if periodic else None, sent),
                "x_vs_a_round_every_step": _ratio(ideal, sent),
                "mb_to_2pct": None if close_sent is None else round(close_sent / 1e6, 4),
                "wall_s_to_2pct": None if close is None else round(close["wall_s"], 1),
                "x_vs_every_step_2pct": _ratio(
                    near_base["bytes_per_peer"] if near_base else None, close_sent
                ),
                "x_vs_periodic_2pct": _ratio(
                    near_periodic["bytes_per_peer"] if near_periodic else None, close_sent
                ),
                "load_1min": None if r["load_1min"] is None else round(r["load_1min"], 1),
            }
        )
    return out


def _plot(rows: list[dict[str, Any]], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_bytes, by_wall) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r["mode"] for r in rows))}
    for r in rows:
        pts = r["points"]
        seed = r.get("seed", 0)
        style: dict[str, Any] = {
            "color": colours[r["mode"]],
            "marker": ".",
            "label": f"{r['mode']} (seed {seed})",
        }
        style["linestyle"] = ("-", ":", "-.", "--")[seed % 4]
        if r["mode"].startswith("every step"):
            style.update(color="black")
        by_bytes.plot([max(p["bytes_per_peer"], 1e3) for p in pts], [p["loss"] for p in pts], **style)
        by_wall.plot([p["wall_s"] for p in pts], [p["loss"] for p in pts], **style)
    for ax in (by_bytes, by_wall):
        ax.axhline(target, color="red", linestyle=":", label="target (every step's final, first seed)")
        ax.set_ylabel("held-out loss (mean of clusters)")
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("cross-cluster bytes sent per peer (averaging payload; 0 drawn at 1e3)")
    by_wall.set_xlabel("wall time in training, s (slowest cluster)")
    by_wall.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(rows: list[dict[str, Any]], config: dict[str, Any], *, name: str) -> None:
    """`<name>.{json,md,png}` in benchmarks/results: the summary, the config, every run's curve."""
    summary = summarise(rows)
    targets = {r.get("seed", 0): round(r["final_loss"], 4) for r in rows if r["mode"] == "every step"}
    target = next(iter(targets.values()))
    notes = (
        f"{config['clusters']} clusters x 1 stage of {config['model']} on char_corpus, lab namespaces, htb "
        f"{config['link_mbps']:g} Mbit/s per peer up and down, equal cgroup CPU caps (1.8 CPUs in all), "
        f"batch 16 x 64 tokens, {config['steps']} micro-batches per cluster in every run (the token "
        f"budget), held-out loss (128 windows) every {config['eval_every']} micro-batches; runs one after "
        f"the other in one lab, in this order: {config['order']}, for seeds {config.get('seeds', [0])} "
        "(the job's seed: data order and initial weights; the second seed's runs in reversed order). "
        f"Target per seed: that seed's every step's final held-out loss, {targets}. Bytes: each "
        "stage's averaging_bytes_sent (tensor payload of its finished rounds), mean per peer; wall: "
        "train_wall_s of the slowest cluster at that evaluation. The final point (after the closing "
        "round: fp32, or the Δ codec where the anchors agree) counts that round's bytes. "
        "x_vs_a_round_every_step: against every step's mean bytes per round x the steps it took to the "
        "target. rounds: the fewest finished rounds of a peer (closing round included); "
        "rounds_all_replicas: peer-rounds (closing excluded) in which all 4 replicas averaged, of those "
        "started (peers' logs). A round's bytes include its failed attempts' (a ring retries without a "
        "member that fell behind). "
        "_2pct columns: the same to 1.02 x the target (the goal's tolerance). "
        "Loads: the host's 1-minute load "
        f"average sampled by the driver during each run; at start / end {config['load_1min_start_end']}. "
        f"Took {config['took_s']} s. First table: per mode over seeds, mean (min-max); then every run."
    )
    json_path = record(name, by_mode(summary), notes=notes)
    md_path = json_path.with_suffix(".md")
    md_path.write_text(md_path.read_text() + "\n### Every run\n\n" + _markdown_table(summary))
    payload = json.loads(json_path.read_text())
    payload["per_run"] = summary
    payload["config"] = config
    payload["runs"] = rows
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    title = f"{config['clusters']} clusters at {config['link_mbps']:g} Mbit/s, {config['model']}"
    _plot(rows, target, json_path.with_suffix(".png"), title)
    print(json.dumps(summary, indent=1), flush=True)


def main() -> None:
    """Write `<name>.{md,png}` again from `<name>.json` (its stored runs and config)."""
    import sys

    from benchmarks.harness import RESULTS_DIR

    name = sys.argv[1] if len(sys.argv) > 1 else "bytes_to_target"
    path = RESULTS_DIR / f"{name}.json"
    payload = json.loads(path.read_text())
    write_results(payload["runs"], payload["config"], name=name)
    again = json.loads(path.read_text())
    again["machine"] = payload["machine"]  # the run's machine facts and time, not this rewrite's
    path.write_text(json.dumps(again, indent=1) + "\n")


if __name__ == "__main__":
    main()
