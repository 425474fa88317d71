"""Results of the churn soak: markdown + JSON under benchmarks/results/, and the loss-vs-time plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["plot_soak", "write_kill_results", "write_soak_results"]

_PHASES = ("detected_s", "plan_active_s", "state_arrived_s", "resumed_s")
_COLOURS = {"kill": "tab:red", "term": "tab:orange", "join": "tab:green"}


def plot_soak(payload: dict[str, Any], path: Path) -> None:
    """Held-out loss (top) and samples in the model (bottom) vs time since t0, churn events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, style in (("undisturbed", "tab:blue"), ("churn", "tab:purple")):
        run = payload[name]
        if run["loss"]:
            xs, ys = zip(*run["loss"], strict=True)
            top.plot(xs, ys, ".", ms=3, color=style, label=f"{name} (first stages' evaluations)")
        if run["useful_curve"]:
            xs, ys = zip(*run["useful_curve"], strict=True)
            bottom.plot(xs, ys, color=style, label=name)
    seen = set()
    for ev in payload["churn"]["events"]:
        label = (
            None
            if ev["action"] in seen
            else {"kill": "SIGKILL", "term": "SIGTERM", "join": "join"}[ev["action"]]
        )
        seen.add(ev["action"])
        for ax in (top, bottom):
            ax.axvline(
                ev["t_s"], color=_COLOURS[ev["action"]], lw=1, ls="--", label=label if ax is top else None
            )
    top.set_yscale("log")
    top.set_ylabel("held-out loss")
    top.legend(fontsize=8)
    bottom.set_ylabel("samples in the model")
    bottom.set_xlabel("seconds since the first plan trained")
    bottom.legend(fontsize=8)
    fig.suptitle(
        f"churn soak: {payload['num_peers']} lab peers, one change per ~60 s; "
        f"useful-compute fraction {payload['useful_compute_fraction']:.3f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_soak_results(payload: dict[str, Any], out_dir: Path) -> None:
    churn, calm = payload["churn"], payload["undisturbed"]
    (out_dir / "churn_soak.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    keys: tuple[str, ...] = ("useful_samples", "trained_samples", "rolled_back_samples", "plan_epochs")
    keys += ("stalled_s", "spurious_failures", "final_accuracy", "done", "mean_loadavg")
    lines = [
        "## churn_soak",
        "",
        f"{payload['num_peers']} peers in lab namespaces (htb, {payload['link_mbps']:.0f} Mbit/s), an "
        "until_stopped digits job planned by the swarm (2 clusters, >= 3 stages), "
        f"{payload['duration_s']:.0f} s from the first plan's start, churn on average every 60 s (seed "
        f"{payload['seed']}: leave by SIGKILL / SIGTERM alternating, then the peer rejoins with its "
        "identity), "
        "and the same job undisturbed for the same wall time in a second lab "
        f"({'at the same time' if payload.get('concurrent') else 'afterwards'}). Samples in the model: the "
        "progress records' positions per plan epoch and cluster, capped at the next plan's start, minus one "
        "averaging period per cluster whose replica was not carried over (docs/churn-soak.md). "
        "Plot: churn_soak.png.",
        "",
        f"**Useful-compute fraction: {payload['useful_compute_fraction']:.3f}** (goal >= 0.85)",
        "",
        "| run | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for name, run in (("churn", churn), ("undisturbed", calm)):
        lines.append(f"| {name} | " + " | ".join(_fmt(run[k]) for k in keys) + " |")
    b = payload["breakdown"]
    lines += [
        "",
        "Shortfall, as fractions of the undisturbed samples (they add up to 1 - fraction): "
        + ", ".join(f"{k} {v:.3f}" for k, v in b.items()),
        "",
        "spurious_failures: stage failures blaming a neighbour that never left (a starved peer answering "
        "late). Per event, seconds from it to the first log line of each phase (peers' logs, whole "
        "seconds) and to the first progress on a newer plan (the researcher's polls):",
        "",
        "| t_s | action | peer | " + " | ".join(_PHASES) + " | training again after s |",
        "|---|---|---|" + "---|" * len(_PHASES) + "---|",
    ]
    for ev in churn["events"]:
        phases = " | ".join(_fmt(ev.get(k)) for k in _PHASES)
        lines.append(
            f"| {ev['t_s']:.0f} | {ev['action']} | {ev['peer']} | {phases} | {_fmt(ev['training_again_s'])} |"
        )
    (out_dir / "churn_soak.md").write_text("\n".join(lines) + "\n")


def write_kill_results(payload: dict[str, Any], out_dir: Path) -> None:
    (out_dir / "kill_vs_undisturbed.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    keys = ("final_accuracy", "done", "useful_samples", "trained_samples", "plan_epochs", "wall_s")
    lines = [
        "## kill_vs_undisturbed",
        "",
        "8 lab peers (2 clusters), the churn soak's digits job stopped at "
        f"{payload['max_steps']} micro-batches per cluster; once with a SIGKILL of cluster 1's last stage "
        "at 40 % of it, once undisturbed "
        f"({'two labs side by side' if payload.get('concurrent') else 'one after the other'}). "
        "final_accuracy: mean of the first stages' last held-out accuracy.",
        "",
        "| run | " + " | ".join(keys) + " | training again after s |",
        "|---|" + "---|" * (len(keys) + 1),
    ]
    for name in ("kill", "undisturbed"):
        run = payload[name]
        again = ", ".join(_fmt(ev["training_again_s"]) for ev in run["events"])
        lines.append(f"| {name} | " + " | ".join(_fmt(run[k]) for k in keys) + f" | {again} |")
    (out_dir / "kill_vs_undisturbed.md").write_text("\n".join(lines) + "\n")
