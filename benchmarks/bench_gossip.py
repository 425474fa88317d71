"""Gossip agreement at scale: rounds and bytes until 10^3 / 10^4 simulated views agree after churn."""

from __future__ import annotations

import time

from benchmarks.harness import record
from ravnest_p2p.membership.simulate import simulate


def main(quick: bool) -> None:
    cases = (
        [(1000, None), (1000, 256)] if quick else [(1000, None), (1000, 256), (10_000, None), (10_000, 1024)]
    )
    rows = []
    for num_peers, num_buckets in cases:
        started = time.perf_counter()
        r = simulate(num_peers, fanout=3, churn=0.01, num_buckets=num_buckets, seed=0)
        rows.append(
            {
                "peers": r.num_peers,
                "buckets": r.num_buckets,
                "fanout": r.fanout,
                "churn_events": r.churn_events,
                "rounds": r.rounds_to_agree,
                "round_goal_2log2N": round(r.round_goal, 1),
                "rounds_vs_goal": r.rounds_to_agree / r.round_goal,
                "total_MB": r.bytes_total / 1e6,
                "kB_per_peer_per_round": r.bytes_per_peer_per_round / 1e3,
                "record_fetch_MB": r.record_fetch_bytes / 1e6,
                "converged": r.converged,
                "sim_wall_s": time.perf_counter() - started,
            }
        )
    record(
        "gossip",
        rows,
        notes=(
            "Pure-core simulation (`ravnest_p2p.membership.simulate`): a swarm that agrees, then 1% graceful "
            "leaves + 1% joins at once; synchronous push-pull rounds, fanout 3; bytes = gossip_view message "
            "sizes (measured from the real pydantic types) + one signed record (~520 B) per adopted item. "
            "Joiners pull the whole view once. Not modelled: loss, latency, planning time."
        ),
    )
