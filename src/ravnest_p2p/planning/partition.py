"""Stage partition: contiguous layers per stage, minimising the slowest stage, subject to memory.

Problem. A cluster is an ordered chain of peers ``p_0 .. p_{S-1}`` (see `ordering`). Cut the model's
``n`` profiled layers into ``S`` non-empty contiguous ranges, range ``j`` on peer ``p_j``, so that the
asynchronous pipeline's period -- the slowest stage's time per micro-batch -- is minimal::

    time_j = B * sum(flops[l] for l in range_j) / flops_per_s(p_j)          # compute
           + B * activation_bytes(last layer of range_j) / link(p_j, p_j+1)  # send to the next stage
    memory_j = sum(layer_memory_bytes(l) for l in range_j) <= memory_bytes(p_j)

with ``B`` the micro-batch size, ``link(a, b) = min(upload(a), download(b))`` and no send for the last
stage. In a 1F1B pipeline with no flush, throughput is one micro-batch per slowest-stage time, so the
min-max objective is the right one (PipeDream, Narayanan et al. 2019, uses the same).

Method. Exact dynamic programming over (stage, layers consumed), ``best[j][b] = min_a max(best[j-1][a],
time_j(a, b))``, vectorised with numpy over ``a`` and ``b``: O(S n^2) work, microseconds for real models.

Alternatives rejected. Ravnest splits by parameter count, which ignores both compute speed and the
activation sizes at the cut; greedy "fill until the budget" splits are not optimal for min-max; binary
search on the bottleneck plus a greedy feasibility check is exact only without the per-stage send term
(which depends on where the cut lands) -- the DP handles both.

With a measured `links.LinkMatrix` the send term is ``latency(p_j, p_j+1) + bytes / rate(p_j, p_j+1)``
instead (pairwise, measured where known); without one the expressions above are evaluated unchanged.

Known limits. ``flops_per_sample`` is taken as forward+backward work; the backward gradient travels the
reverse link and is assumed symmetric to the forward activation; compute and communication are added,
not overlapped (a conservative estimate); per-peer memory is the only constraint (no global one).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ravnest_p2p.planning.links import LinkMatrix
from ravnest_p2p.planning.memory import layer_memory_bytes
from ravnest_p2p.planning.types import InfeasiblePlan, JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = [
    "evaluate_partition",
    "layer_memory_bytes",
    "model_memory_bytes",
    "partition_layers",
]


def model_memory_bytes(layers: Sequence[LayerProfile], job: JobParams) -> int:
    """Memory a cluster needs in total to hold the whole model (sum over layers)."""
    return sum(layer_memory_bytes(layer, job) for layer in layers)


def _link_bytes_per_s(sender: PeerCapacity, receiver: PeerCapacity) -> float:
    return min(sender.upload_bytes_per_s, receiver.download_bytes_per_s)


def evaluate_partition(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    cuts: Sequence[int],
    links: LinkMatrix | None = None,
) -> tuple[list[float], list[int]]:
    """Per-stage times and memory for explicit cut points (``0 < cuts[0] < ... < n``, ``S - 1`` of them).

    Returns:
        ``(times_s, memory_bytes)``, one entry per stage; the caller checks memory against the peers.
    """
    bounds = [0, *cuts, len(layers)]
    if len(bounds) != len(peers) + 1 or any(a >= b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cuts {list(cuts)} do not split {len(layers)} layers into {len(peers)} stages")
    batch = job.micro_batch_size
    times: list[float] = []
    memory: list[int] = []
    for j, peer in enumerate(peers):
        a, b = bounds[j], bounds[j + 1]
        compute_s = batch * sum(layer.flops_per_sample for layer in layers[a:b]) / peer.flops_per_s
        send_s = 0.0
        if j + 1 < len(peers):
            send_bytes = batch * layers[b - 1].activation_bytes_per_sample
            if links is None:
                send_s = send_bytes / _link_bytes_per_s(peer, peers[j + 1])
            else:
                sender, receiver = peer.peer_id, peers[j + 1].peer_id
                send_s = send_bytes / links.rate(sender, receiver) + links.latency_s(sender, receiver)
        times.append(compute_s + send_s)
        memory.append(sum(layer_memory_bytes(layer, job) for layer in layers[a:b]))
    return times, memory


def partition_layers(
    peers: Sequence[PeerCapacity],
    layers: Sequence[LayerProfile],
    job: JobParams,
    links: LinkMatrix | None = None,
) -> tuple[tuple[int, ...], float]:
    """Optimal contiguous split of ``layers`` over the ordered ``peers`` (exact DP).

    Args:
        peers: the stages' peers in pipeline order; each gets at least one layer.
        layers: the model's cuttable layers in forward order.
        job: micro-batch size and memory knobs.
        links: pairwise rates and latencies for the send term; None: per-peer up/down figures.

    Returns:
        ``(cuts, bottleneck_s)``: the ``S - 1`` cut indices (stage ``j`` holds layers
        ``[cuts[j-1], cuts[j])``) and the slowest stage's time per micro-batch. Ties are broken by
        ``argmin`` (smallest start index), so the answer is deterministic.

    Raises:
        InfeasiblePlan: fewer layers than peers, or no split fits every peer's memory.
    """
    num_stages, num_layers = len(peers), len(layers)
    if num_stages == 0:
        raise InfeasiblePlan("no peers to place layers on")
    if num_layers < num_stages:
        raise InfeasiblePlan(f"{num_layers} layers cannot fill {num_stages} non-empty stages")
    batch = job.micro_batch_size
    flops_prefix = np.concatenate([[0.0], np.cumsum([layer.flops_per_sample for layer in layers])])
    # Memory in exact integers (object dtype would be slow; float64 is exact below 2**53 bytes = 8 PiB).
    memory_prefix = np.concatenate(
        [[0.0], np.cumsum([float(layer_memory_bytes(layer, job)) for layer in layers])]
    )
    activation = np.array([float(layer.activation_bytes_per_sample) for layer in layers])

    start = np.arange(num_layers + 1)[:, None]  # a: layers consumed before this stage
    end = np.arange(num_layers + 1)[None, :]  # b: layers consumed after it
    valid_range = start < end
    send_bytes = np.concatenate([[0.0], batch * activation])[None, :]  # output of layer b - 1

    best = np.full(num_layers + 1, np.inf)
    best[0] = 0.0
    choices: list[np.ndarray] = []
    for j, peer in enumerate(peers):
        compute_s = batch * (flops_prefix[None, :] - flops_prefix[:, None]) / peer.flops_per_s
        if j + 1 < num_stages:
            if links is None:
                times = compute_s + send_bytes / _link_bytes_per_s(peer, peers[j + 1])
            else:
                sender, receiver = peer.peer_id, peers[j + 1].peer_id
                rate, latency_s = links.rate(sender, receiver), links.latency_s(sender, receiver)
                times = compute_s + (send_bytes / rate + latency_s)
        else:
            times = compute_s
        fits = (memory_prefix[None, :] - memory_prefix[:, None]) <= peer.memory_bytes
        times = np.where(valid_range & fits, times, np.inf)
        candidates = np.maximum(best[:, None], times)  # [a, b]
        choice = np.argmin(candidates, axis=0)
        best = candidates[choice, np.arange(num_layers + 1)]
        choices.append(choice)
    bottleneck = float(best[num_layers])
    if not math.isfinite(bottleneck):
        raise InfeasiblePlan("no contiguous split fits every peer's memory")
    cuts: list[int] = []
    b = num_layers
    for j in range(num_stages - 1, 0, -1):
        b = int(choices[j][b])
        cuts.append(b)
    return tuple(reversed(cuts)), bottleneck
