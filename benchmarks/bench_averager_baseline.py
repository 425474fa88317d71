"""Baseline for our ring: hivemind's `DecentralizedAverager` all-reducing 64 MB among 4 lab peers.

Four namespaces (htb links, symmetric), one `benchmarks.hivemind_averager_peer` process each, every
daemon connected to every other first. Per round: the all-reduce time (last end - last trigger across
the group; matchmaking excluded) and its ratio to the bandwidth bound 2(C-1)/C * S / B, with B the
slowest link's wire rate (for heterogeneous links this equal-split bound is the one a ring must meet;
hivemind balances its parts by the advertised `bandwidth`, so it may come in under 1 there).
"""

from __future__ import annotations

import statistics
import sys

from benchmarks.harness import record
from benchmarks.labrun import LabRun

SIZE_BYTES = 64_000_000
PEER = [sys.executable, "-m", "benchmarks.hivemind_averager_peer"]


def _run(rates: list[float], rounds: int, size_bytes: int) -> dict[str, object]:
    group = len(rates)
    with LabRun(rates) as lab:
        maddrs: list[str] = []
        for i, rate in enumerate(rates):
            argv = [
                *PEER,
                "--host",
                lab.addresses[i],
                "--group-size",
                str(group),
                "--size-bytes",
                str(size_bytes),
            ]
            argv += ["--rounds", str(rounds), "--bandwidth-mbps", str(rate)]
            if maddrs:
                argv += ["--initial-peers", *maddrs]
            lab.start(i, argv)
            maddrs += lab.wait_json(i, "maddrs", timeout_s=120)[0]["maddrs"]
        bound_s = 2 * (group - 1) / group * size_bytes * 8 / (min(rates) * 1e6)
        timeout_s = 120 + rounds * (bound_s * 4 + 30)
        lines = [lab.wait_json(i, "round", timeout_s=timeout_s, count=rounds) for i in range(group)]
        finals = [lab.wait_json(i, "final_mean", timeout_s=60)[0]["final_mean"] for i in range(group)]
    times = []
    for r in range(rounds):
        per_peer = [peer_lines[r] for peer_lines in lines]
        assert all(p["ok"] and p["group"] == group for p in per_peer), per_peer
        times.append(max(p["end_t"] for p in per_peer) - max(p["trigger_t"] for p in per_peer))
    round_s = statistics.median(times)
    return {
        "links_mbps": "/".join(f"{r:g}" for r in rates),
        "peers": group,
        "size_mb": size_bytes / 1e6,
        "allreduce_s": round_s,
        "bound_s": bound_s,
        "ratio_to_bound": round_s / bound_s,
        "ratio_to_goodput_bound": round_s / (bound_s / 0.957),
        "rounds": rounds,
        "round_times_s": [round(t, 2) for t in times],
        "final_mean": statistics.mean(finals),
    }


def main(quick: bool) -> None:
    rounds = 1 if quick else 2
    rows = [_run([100.0] * 4, rounds, SIZE_BYTES), _run([25.0, 50.0, 100.0, 200.0], rounds, SIZE_BYTES)]
    for row in rows:
        print(
            f"  {row['links_mbps']}: {row['allreduce_s']:.1f} s/round = {row['ratio_to_bound']:.2f} x bound"
        )
    record(
        "averager_baseline",
        rows,
        notes=(
            "hivemind 1.1.12 DecentralizedAverager, 4 peers in lab namespaces (htb, symmetric links), "
            "64 MB fp32, "
            "all-reduce time per round (matchmaking excluded; median of rounds) / bound 2(C-1)/C*S/B_min at "
            "the wire rate; goodput bound uses 0.957 B. Our ring must beat this ratio in the same lab."
        ),
    )
