"""Synthetic heterogeneous swarms and models for the planner benchmark (seeded, pure numpy).

Device classes stand for the volunteers we expect: CPU laptops, gaming GPUs, workstations and a few
datacenter cards. Each number is the class's typical value times a lognormal factor (FLOP/s, memory,
download) and the upload is the download times a lognormal asymmetry (home links upload slower).
Two models: ``small`` fits on every peer (so up to one cluster per peer, the k ~ n worst case of the
clustering) and ``medium`` needs about two to eight peers' memory (several-stage pipelines).
"""

from __future__ import annotations

import numpy as np

from ravnest_p2p.planning import JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["DEVICE_CLASSES", "JOB", "model_layers", "synthetic_swarm"]

GB = 1 << 30
MBIT = 1e6 / 8

# name: (share, FLOP/s, memory bytes, download bytes/s, upload/download ratio)
DEVICE_CLASSES: dict[str, tuple[float, float, float, float, float]] = {
    "cpu-laptop": (0.30, 2e11, 6 * GB, 30 * MBIT, 0.3),
    "gaming-gpu": (0.40, 2e13, 10 * GB, 100 * MBIT, 0.4),
    "workstation": (0.20, 6e13, 22 * GB, 300 * MBIT, 0.8),
    "datacenter": (0.10, 2e14, 70 * GB, 1000 * MBIT, 1.0),
}
SIGMA_FLOPS, SIGMA_MEMORY, SIGMA_LINK, SIGMA_ASYMMETRY = 0.35, 0.25, 0.6, 0.3

JOB = JobParams(micro_batch_size=4, max_in_flight=4, memory_headroom=1.2, min_stages=1, spare_ratio=0.25)


def synthetic_swarm(num_peers: int, seed: int) -> list[PeerCapacity]:
    """``num_peers`` peers drawn from `DEVICE_CLASSES` with lognormal spreads (seeded)."""
    rng = np.random.default_rng(seed)
    names = list(DEVICE_CLASSES)
    shares = np.array([DEVICE_CLASSES[n][0] for n in names])
    classes = rng.choice(len(names), size=num_peers, p=shares / shares.sum())
    peers = []
    for i, c in enumerate(classes):
        _, flops, memory, download, asymmetry = DEVICE_CLASSES[names[int(c)]]
        f, m, d, a = rng.lognormal(0.0, [SIGMA_FLOPS, SIGMA_MEMORY, SIGMA_LINK, SIGMA_ASYMMETRY])
        down = download * d
        peers.append(
            PeerCapacity(
                peer_id=f"{names[int(c)]}-{i:05d}-{int(rng.integers(1 << 40)):010x}",
                flops_per_s=float(flops * f),
                memory_bytes=int(memory * m),
                upload_bytes_per_s=float(down * min(asymmetry * a, 1.0)),
                download_bytes_per_s=float(down),
            )
        )
    return peers


def model_layers(kind: str) -> list[LayerProfile]:
    """``small``: ~0.5 GB with the job's stash and headroom; ``medium``: ~40 GB, 24 layers."""
    if kind == "small":
        count, params, act = 12, 2_000_000, 200_000
    elif kind == "medium":
        count, params, act = 24, 200_000_000, 4_000_000
    else:
        raise ValueError(f"unknown model {kind!r}")
    return [
        LayerProfile(
            name=f"block{i}",
            flops_per_sample=float(6 * params // 4 * 512),
            param_bytes=params,
            optimizer_state_bytes=2 * params,
            activation_bytes_per_sample=act,
        )
        for i in range(count)
    ]
