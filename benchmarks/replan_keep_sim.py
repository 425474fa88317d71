"""How often a re-plan keeps a cluster unchanged: fresh `make_plan` against the keeping re-plan.

The simulation of docs/elastic.md ("Clusters the new plan did not change keep training"): the digits
CNN, ``min_stages=2``, peers of equal capacity +-10 %, 20 trials per event. A trial plans epoch 1,
applies the event (one peer killed, or one peer joining), plans epoch 2 and counts the clusters of
epoch 1 found unchanged (same ordered peers, same layer ranges) in epoch 2: from scratch (before) and
with the previous plan's placements (`make_plan(previous=...)`, after).

Run: ``PYTHONPATH=src python -m benchmarks.replan_keep_sim [--trials 20]``
"""

from __future__ import annotations

import argparse

import numpy as np

from ravnest_p2p.planning import JobParams, PeerCapacity, Plan, make_plan
from ravnest_p2p.planning.replan import placed_stages
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.placement import job_params, layer_profiles

EVENTS = (("kill", 4), ("join", 4), ("kill", 8), ("join", 7), ("kill", 12), ("join", 12))


def _peer(rng: np.random.Generator, name: str) -> PeerCapacity:
    def jitter() -> float:
        return float(rng.uniform(0.9, 1.1))

    return PeerCapacity(
        peer_id=name,
        flops_per_s=2e10 * jitter(),
        memory_bytes=int(2**30 * jitter()),
        upload_bytes_per_s=12.5e6 * jitter(),
        download_bytes_per_s=12.5e6 * jitter(),
    )


def _shape(plan: Plan) -> set[tuple[tuple[str, int, int], ...]]:
    return {
        tuple((s.peer_id, s.first_layer, s.last_layer_exclusive) for s in c.stages) for c in plan.clusters
    }


def trial(rng, layers, job: JobParams, event: str, num_peers: int) -> tuple[int, int, int]:
    """(clusters before, unchanged from scratch, unchanged when keeping)."""
    peers = [_peer(rng, f"peer{i:02d}-{int(rng.integers(1 << 30)):08x}") for i in range(num_peers)]
    first = make_plan(peers, layers, job, epoch=1)
    if event == "kill":
        victim = str(rng.choice([pid for c in first.clusters for pid in c.peer_ids]))
        after = [p for p in peers if p.peer_id != victim]
    else:
        after = [*peers, _peer(rng, f"newcomer-{int(rng.integers(1 << 30)):08x}")]
    old = _shape(first)
    scratch = make_plan(after, layers, job, epoch=2)
    kept = make_plan(after, layers, job, epoch=2, previous=placed_stages(first))
    return len(old), len(old & _shape(scratch)), len(old & _shape(kept))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    spec = JobSpec(min_stages=2)
    layers = layer_profiles(spec)
    job = job_params(spec, num_layers=len(layers))
    print("| event | clusters before | trials keeping one: scratch / keep | clusters kept: scratch / keep |")
    print("|---|---|---|---|")
    for event, num_peers in EVENTS:
        rng = np.random.default_rng([num_peers, event == "kill"])
        totals = np.zeros(3, dtype=int)
        any_scratch = any_keep = 0
        for _ in range(args.trials):
            n, scratch, keep = trial(rng, layers, job, event, num_peers)
            totals += (n, scratch, keep)
            any_scratch += scratch > 0
            any_keep += keep > 0
        label = f"{event} {'among' if event == 'kill' else 'to'} {num_peers}"
        print(
            f"| {label} | {totals[0] / args.trials:.1f} "
            f"| {any_scratch}/{args.trials} / {any_keep}/{args.trials} "
            f"| {totals[1]}/{totals[0]} / {totals[2]}/{totals[0]} |"
        )


if __name__ == "__main__":
    main()
