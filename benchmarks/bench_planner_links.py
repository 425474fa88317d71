"""Planner with a measured link matrix: CPU cost, and what the matrix buys on a swarm of cities.

Swarm: `planner_swarms.synthetic_swarm` (per-peer figures) spread over `NUM_CITIES` cities; a pair in
different cities gets `FAR_RATE_FACTOR` of its per-peer estimate and `FAR_LATENCY_S` one way, a pair
in one city its estimate and `NEAR_LATENCY_S` (lognormal noise on every rate). Each peer reports
`LINKS_PER_PEER` random pairs (as a record would, after probing), so the matrix is sparse.

Measured per size and model: `make_plan` CPU seconds without and with the matrix (the matrix's build
included), and each plan's modelled samples/s under the *true* links: every cluster's stages and cuts
evaluated with `evaluate_partition` on the true pairwise rates, samples/s = micro-batch / bottleneck
summed over clusters. A model, not a run: the lab comparison (real peers, shaped links) is still to do.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from benchmarks.harness import record
from benchmarks.planner_swarms import JOB, model_layers, synthetic_swarm
from ravnest_p2p.planning import LinkMatrix, LinkReport, PeerCapacity, Plan, evaluate_partition, make_plan
from ravnest_p2p.types import LayerProfile

NUM_CITIES = 8
LINKS_PER_PEER = 32
FAR_RATE_FACTOR = 0.1
NEAR_LATENCY_S, FAR_LATENCY_S = 0.002, 0.05
SEED = 5


class Cities:
    """The true pairwise links of a swarm spread over cities (seeded)."""

    def __init__(self, peers: list[PeerCapacity], seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.peers = {p.peer_id: p for p in peers}
        self.city = {p.peer_id: int(self.rng.integers(NUM_CITIES)) for p in peers}
        self._noise: dict[tuple[str, str], float] = {}

    def rate(self, a: str, b: str) -> float:
        noise = self._noise.setdefault((a, b), float(self.rng.lognormal(0.0, 0.15)))
        estimate = min(self.peers[a].upload_bytes_per_s, self.peers[b].download_bytes_per_s)
        return estimate * min(noise, 1.0) * (1.0 if self.city[a] == self.city[b] else FAR_RATE_FACTOR)

    def latency_s(self, a: str, b: str) -> float:
        return NEAR_LATENCY_S if self.city[a] == self.city[b] else FAR_LATENCY_S

    def reports(self) -> dict[str, list[LinkReport]]:
        ids = sorted(self.peers)
        out: dict[str, list[LinkReport]] = {}
        for i, pid in enumerate(ids):
            picks = [int(j) for j in self.rng.choice(len(ids), size=LINKS_PER_PEER + 1, replace=False)]
            others = [ids[j] for j in picks if j != i][:LINKS_PER_PEER]
            out[pid] = [
                LinkReport(o, self.rate(pid, o), self.rate(o, pid), 2 * self.latency_s(pid, o))
                for o in others
            ]
        return out


def true_samples_per_s(
    plan: Plan, peers: list[PeerCapacity], layers: list[LayerProfile], cities: Cities
) -> float:
    by_id = {p.peer_id: p for p in peers}
    total = 0.0
    for cluster in plan.clusters:
        order = [by_id[s.peer_id] for s in cluster.stages]
        truth = {
            (a.peer_id, b.peer_id): (
                cities.rate(a.peer_id, b.peer_id),
                cities.latency_s(a.peer_id, b.peer_id),
            )
            for a, b in itertools.pairwise(order)
        }
        cuts = [s.first_layer for s in cluster.stages[1:]]
        times, _ = evaluate_partition(order, layers, JOB, cuts, LinkMatrix(order, truth))
        total += JOB.micro_batch_size / max(times)
    return total


def main(quick: bool) -> None:
    sizes = [100, 1000] if quick else [100, 1000, 10_000]
    rows: list[dict[str, Any]] = []
    for kind in ("small", "medium"):
        layers = model_layers(kind)
        for num_peers in sizes:
            peers = synthetic_swarm(num_peers, SEED)
            cities = Cities(peers, SEED)
            reports = cities.reports()
            start = time.process_time()
            plain = make_plan(peers, layers, JOB, epoch=1)
            plain_s = time.process_time() - start
            start = time.process_time()
            links = LinkMatrix.build(peers, reports)
            matrix = make_plan(peers, layers, JOB, epoch=1, links=links)
            matrix_s = time.process_time() - start
            row = {
                "model": kind,
                "peers": num_peers,
                "measured_pairs": len(links),
                "plain_cpu_s": round(plain_s, 3),
                "matrix_cpu_s": round(matrix_s, 3),
                "plain_clusters": len(plain.clusters),
                "matrix_clusters": len(matrix.clusters),
                "plain_true_samples_per_s": round(true_samples_per_s(plain, peers, layers, cities), 1),
                "matrix_true_samples_per_s": round(true_samples_per_s(matrix, peers, layers, cities), 1),
            }
            rows.append(row)
            print(row, flush=True)
    notes = (
        f"Synthetic swarms over {NUM_CITIES} cities (far pairs: {FAR_RATE_FACTOR}x the per-peer estimate, "
        f"{FAR_LATENCY_S * 1000:.0f} ms one way; near: {NEAR_LATENCY_S * 1000:.0f} ms), "
        f"{LINKS_PER_PEER} reported links per peer. CPU = time.process_time of make_plan (matrix build "
        "included), one run each. true_samples_per_s: the plan's clusters evaluated on the true pairwise "
        "links (a model of the pipelines' rate, not a measured run)."
        + (" Quick mode: no 10,000-peer case." if quick else "")
    )
    record("planner_links", rows, notes=notes)
