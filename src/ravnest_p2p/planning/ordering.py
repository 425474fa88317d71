"""Stage ordering: which peer of a cluster runs stage 0, stage 1, ... of the pipeline.

Problem. The partition DP (`partition`) is exact for a *given* peer order; the order decides which link
each cut's activations cross and how much compute each position gets. We want the order whose optimal
partition has the smallest bottleneck: keep slow links off heavy boundaries (a peer with a slow uplink
is best placed last -- the last stage sends nothing forward -- or before a cut where activations are
small) and give the compute-heavy parts to fast peers.

Method. Clusters of up to `EXACT_LIMIT` peers: every permutation (in sorted peer-id order) scored with
the exact DP -- the joint optimum of order and partition. Larger clusters: start from the peers sorted
by link speed, fastest first (so the slowest uplink sits last) and improve by pairwise swaps evaluated
with the exact DP until no swap helps (a 2-exchange local optimum).

Speed (the planner calls this once per cluster: ~3,000 times at 10,000 peers). `_OrderScorer` runs the
same DP as `partition.partition_layers` with the same floating-point operations, but builds the
layer-only matrices once per cluster, each peer's compute/memory matrix once, and each ordered pair's
send term once, instead of once per permutation. The exhaustive search walks the permutation tree
depth first so permutations sharing a prefix share its DP rows, and prunes a prefix once the smallest
entry of its DP row is no better than the best complete order (DP rows only grow along a path, so no
completion can beat it). Both are exact: the chosen order, cuts and bottleneck are bit-identical to
the plain enumeration (the unit tests compare against it). Clusters of 1-2 peers keep the plain
enumeration (one or two DP runs do not repay the precomputation). Measured with the synthetic swarms of
``benchmarks/planner_swarms.py`` (``time.process_time``, same plan digest before and after): make_plan
at 1,000 peers 0.56 -> 0.31 s (medium model), 0.10 s (small, unchanged); at 10,000 peers 10.7 -> 7.2 s
(medium; ordering's share 15.2 -> 2.6 s under cProfile), 1.0 s (small, unchanged).

Measured links. Given a `links.LinkMatrix`, each ordered pair's send term is the pair's own
``latency + bytes / rate`` (measured, or estimated from the two peers' figures), in the scorer and in
the final `partition_layers` alike, so the search prefers orders whose consecutive stages are well
connected; the start order of the swap search is unchanged (link speed, fastest first).

Alternatives rejected. Ordering by a bottleneck path over link speeds alone (a bottleneck TSP) ignores
where cuts land and the peers' compute; enumerating is cheap up to 6 peers once pruned.
Limits: above `EXACT_LIMIT` the answer is a local optimum, not proven optimal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.partition import layer_memory_bytes, partition_layers
from ravnest_p2p.planning.types import InfeasiblePlan, JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["EXACT_LIMIT", "order_stages"]

EXACT_LIMIT = 6
_MAX_SWAP_ROUNDS = 50
_PLAIN_LIMIT = 2


class _OrderScorer:
    """The bottleneck of `partition_layers` for any order of one cluster's peers, with shared work.

    Every expression mirrors `partition_layers` operation for operation so the values are identical.
    """

    def __init__(
        self,
        peers: Sequence[PeerCapacity],
        layers: Sequence[LayerProfile],
        job: JobParams,
        links: LinkMatrix | None = None,
    ):
        self.peers = list(peers)
        self.links = links
        self.num_layers = n = len(layers)
        self.batch = batch = job.micro_batch_size
        flops_prefix = np.concatenate([[0.0], np.cumsum([layer.flops_per_sample for layer in layers])])
        memory_prefix = np.concatenate(
            [[0.0], np.cumsum([float(layer_memory_bytes(layer, job)) for layer in layers])]
        )
        activation = np.array([float(layer.activation_bytes_per_sample) for layer in layers])
        start = np.arange(n + 1)[:, None]
        end = np.arange(n + 1)[None, :]
        valid_range = start < end
        self._send_bytes = np.concatenate([[0.0], batch * activation])[None, :]
        self._flops_diff = flops_prefix[None, :] - flops_prefix[:, None]
        memory_diff = memory_prefix[None, :] - memory_prefix[:, None]
        self._compute: list[np.ndarray] = []
        self._allowed: list[np.ndarray] = []
        self._last: list[np.ndarray] = []
        for peer in self.peers:
            compute_s = batch * self._flops_diff / peer.flops_per_s
            allowed = valid_range & (memory_diff <= peer.memory_bytes)
            self._compute.append(compute_s)
            self._allowed.append(allowed)
            self._last.append(np.where(allowed, compute_s, np.inf))
        self._pair: dict[tuple[int, int], np.ndarray] = {}
        self._columns = np.arange(n + 1)
        start_row = np.full(n + 1, np.inf)
        start_row[0] = 0.0
        self.start_row = start_row

    def _times(self, peer: int, nxt: int | None) -> np.ndarray:
        if nxt is None:
            return self._last[peer]
        key = (peer, nxt)
        times = self._pair.get(key)
        if times is None:
            sender, receiver = self.peers[peer], self.peers[nxt]
            if self.links is None:
                link = min(sender.upload_bytes_per_s, receiver.download_bytes_per_s)
                raw = self._compute[peer] + self._send_bytes / link
            else:  # the same operations as `partition_layers` with a matrix
                rate = self.links.rate(sender.peer_id, receiver.peer_id)
                latency_s = self.links.latency_s(sender.peer_id, receiver.peer_id)
                raw = self._compute[peer] + (self._send_bytes / rate + latency_s)
            times = self._pair[key] = np.where(self._allowed[peer], raw, np.inf)
        return times

    def step(self, best: np.ndarray, peer: int, nxt: int | None) -> np.ndarray:
        """The DP row after stage ``peer`` (followed by ``nxt``, or last when None)."""
        candidates = np.maximum(best[:, None], self._times(peer, nxt))
        choice = np.argmin(candidates, axis=0)
        return candidates[choice, self._columns]

    def score(self, order: Sequence[int]) -> float:
        """Bottleneck of the order (``inf`` when infeasible), equal to `partition_layers`'s."""
        if not order or self.num_layers < len(order):
            return math.inf
        best = self.start_row
        for j, peer in enumerate(order):
            best = self.step(best, peer, order[j + 1] if j + 1 < len(order) else None)
        return float(best[self.num_layers])


def _exhaustive(scorer: _OrderScorer, size: int) -> tuple[float, tuple[int, ...] | None]:
    """The first permutation (itertools order) with the strictly smallest bottleneck, pruned DFS."""
    best_value = math.inf
    best_perm: tuple[int, ...] | None = None
    if scorer.num_layers < size:
        return best_value, None
    n = scorer.num_layers

    def visit(prefix: list[int], row: np.ndarray, remaining: list[int]) -> None:
        # ``row`` is the DP row after all but the last peer of ``prefix`` (whose successor is unknown).
        nonlocal best_value, best_perm
        last = prefix[-1]
        if not remaining:
            value = float(scorer.step(row, last, None)[n])
            if value < best_value:
                best_value, best_perm = value, tuple(prefix)
            return
        for i, nxt in enumerate(remaining):
            new_row = scorer.step(row, last, nxt)
            if float(new_row.min()) >= best_value:
                continue  # DP entries only grow along a path: nothing below can be strictly better
            visit([*prefix, nxt], new_row, remaining[:i] + remaining[i + 1 :])

    everyone = list(range(size))
    for first in everyone:
        visit([first], scorer.start_row, [p for p in everyone if p != first])
    return best_value, best_perm


def order_stages(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None = None,
) -> tuple[tuple[PeerCapacity, ...], tuple[int, ...], float]:
    """Choose the pipeline order of ``peers`` and the matching optimal partition.

    Args:
        peers: the cluster's peers, any order (they are sorted by id first for determinism).
        layers: the model's layers in forward order.
        job: micro-batch size and memory knobs.
        links: pairwise rates and latencies of the send terms; None: per-peer up/down figures.

    Returns:
        ``(ordered_peers, cuts, bottleneck_s)`` as in `partition.partition_layers`.

    Raises:
        InfeasiblePlan: no order admits a split that fits every peer's memory.
    """
    ordered = sorted(peers, key=lambda p: p.peer_id)
    if not ordered:
        raise InfeasiblePlan("empty cluster")
    if len(ordered) <= _PLAIN_LIMIT:  # too few orders to repay the shared precomputation
        found: tuple[tuple[PeerCapacity, ...], tuple[int, ...], float] | None = None
        for perm in itertools.permutations(ordered):
            try:
                cuts, value = partition_layers(perm, layers, job, links)
            except InfeasiblePlan:
                continue
            if found is None or value < found[2]:
                found = (perm, cuts, value)
        if found is None:
            raise InfeasiblePlan("no stage order fits the model in the cluster's memory")
        return found
    scorer = _OrderScorer(ordered, layers, job, links)
    if len(ordered) <= EXACT_LIMIT:
        best_value, best_perm = _exhaustive(scorer, len(ordered))
    else:
        index = {id(p): i for i, p in enumerate(ordered)}
        current = [index[id(p)] for p in sorted(ordered, key=lambda p: (-p.link_bytes_per_s, p.peer_id))]
        best_perm = tuple(current)
        best_value = scorer.score(best_perm)
        for _ in range(_MAX_SWAP_ROUNDS):
            improved = False
            for i, j in itertools.combinations(range(len(current)), 2):
                trial = list(best_perm)
                trial[i], trial[j] = trial[j], trial[i]
                value = scorer.score(trial)
                if value < best_value:
                    best_value, best_perm, improved = value, tuple(trial), True
            if not improved:
                break
        if not math.isfinite(best_value):
            best_perm = None
    if best_perm is None or not math.isfinite(best_value):
        raise InfeasiblePlan("no stage order fits the model in the cluster's memory")
    best_order = tuple(ordered[i] for i in best_perm)
    cuts, bottleneck = partition_layers(best_order, layers, job, links)
    return best_order, cuts, bottleneck
