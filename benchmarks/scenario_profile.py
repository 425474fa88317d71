"""Turn a scenario of `benchmarks/data/networks.json` into a lab profile (`peers/scenario_<name>.toml`).

DT-FM's scenarios (Yuan et al., NeurIPS 2022) list groups of devices (AWS regions) with one intra-group
link and an inter-group [delay_ms, Gbit/s] table. The lab runs a few peers per group instead of the
paper's 64 devices, so every rate AND the [workload] message sizes are multiplied by one `scale` (the
fastest link in use becomes ~200 Mbit/s, which the shared host can shape): transfer times keep the
paper's proportions. Delays are listed in the header only: this kernel has no netem.

Usage (rewrites the world-wide profile)::

    python -m benchmarks.scenario_profile world_wide --peers-per-group 1 --scale 0.17
"""

from __future__ import annotations

import argparse
import itertools
import json
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.bench_placement import inter_link

REPO = Path(__file__).resolve().parents[1]
NETWORKS = REPO / "benchmarks" / "data" / "networks.json"


def scaled_mbps(gbps: float, scale: float) -> float:
    """A real rate in Gbit/s as the lab's Mbit/s (rounded to 1/1000 Mbit/s)."""
    return round(gbps * 1000 * scale, 3)


def render_profile(
    name: str, scenario: dict[str, Any], workload: dict[str, Any], *, peers_per_group: int, scale: float
) -> str:
    """The TOML text of `peers/scenario_<name>.toml` (header comment included)."""
    groups = [g for g, count in scenario["groups"]]
    intra = scaled_mbps(scenario["intra"]["bandwidth_gbps"], scale)
    pairs = list(itertools.combinations(groups, 2))
    fastest = max(pairs, key=lambda p: inter_link(scenario, *p)[1])
    slowest = min(pairs, key=lambda p: inter_link(scenario, *p)[1])
    delays = ", ".join(f"{a}-{b} {inter_link(scenario, a, b)[0]:g} ms" for a, b in pairs)
    total = sum(count for _, count in scenario["groups"])
    stages = workload["num_stages"] // 2
    header = (
        f"Scenario '{name}' from benchmarks/data/networks.json (Yuan et al., NeurIPS 2022), scaled down "
        f"by benchmarks/scenario_profile.py. SCALE FACTOR = {scale:g} (~ 200 Mbit/s / the fastest link "
        f"in use, {fastest[0]}-{fastest[1]} {inter_link(scenario, *fastest)[1]:g} Gbit/s), applied to "
        "every bandwidth AND to the message sizes in [workload], so every transfer takes as long as in "
        f"the paper. Devices: {total} -> {len(groups) * peers_per_group} peers ({len(groups)} regions "
        f"of {scenario['groups'][0][1]} become {len(groups)} regions of {peers_per_group}); links to "
        "other regions = upload_to_mbps (from "
        f"{scaled_mbps(inter_link(scenario, *slowest)[1], scale):g} Mbit/s, {slowest[0]}-{slowest[1]}, "
        f"to {scaled_mbps(inter_link(scenario, *fastest)[1], scale):g}); upload_mbps = the intra-region "
        f"rate ({scenario['intra']['bandwidth_gbps']:g} Gbit/s x scale), which "
        + (
            "only caps a peer's total (no two peers share a region)"
            if peers_per_group == 1
            else "is also the rate inside a region"
        )
        + f". Downloads are capped at the intra-region rate. The paper's {workload['num_stages']} "
        f"stages x {workload['num_replicas']} replicas become {stages} stages x 2 replicas. NOT "
        f"emulated (no netem in this kernel): round-trip delays, intra "
        f"{scenario['intra']['delay_ms']:g} ms, inter {delays}."
    )
    lines = [f"# {line}" for line in textwrap.wrap(header, 102, break_on_hyphens=False)]
    lines += [f'run_id = "scenario_{name}"', 'shaping = "htb"', f"scale = {scale:g}", "", "[workload]"]
    lines += [f"dp_message_bytes = {round(workload['c_dp_bytes'] * scale)}"]
    lines += [f"pp_message_bytes = {round(workload['c_pp_bytes'] * scale)}", f"num_stages = {stages}"]
    peers = [(g, f"{g}-{i}") for g in groups for i in range(peers_per_group)]
    for group, peer in peers:
        lines += ["", "[[peers]]", f'name = "{peer}"', f"upload_mbps = {intra:g}"]
        lines += [f"download_mbps = {intra:g}", "compute_slowdown = 1", "", "[peers.upload_to_mbps]"]
        for other_group, other in peers:
            if other_group != group:
                rate = scaled_mbps(inter_link(scenario, group, other_group)[1], scale)
                lines.append(f"{other} = {rate:g}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scenario_profile")
    parser.add_argument("scenario")
    parser.add_argument("--peers-per-group", type=int, default=1)
    parser.add_argument("--scale", type=float, required=True)
    cli = parser.parse_args()
    data = json.loads(NETWORKS.read_text())
    text = render_profile(
        cli.scenario,
        data["scenarios"][cli.scenario],
        data["workload"],
        peers_per_group=cli.peers_per_group,
        scale=cli.scale,
    )
    (REPO / "peers" / f"scenario_{cli.scenario}.toml").write_text(text)


if __name__ == "__main__":
    main()
