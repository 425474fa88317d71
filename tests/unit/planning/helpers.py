"""Random populations and models shared by the planning tests."""

from __future__ import annotations

import numpy as np

from ravnest_p2p.planning import CostModel, PeerCapacity, Workload
from ravnest_p2p.types import LayerProfile


def random_layers(rng: np.random.Generator, count: int) -> list[LayerProfile]:
    return [
        LayerProfile(
            name=f"layer{i}",
            flops_per_sample=float(rng.uniform(1e6, 1e8)),
            param_bytes=int(rng.integers(1_000, 100_000)),
            optimizer_state_bytes=int(rng.integers(0, 200_000)),
            activation_bytes_per_sample=int(rng.integers(100, 10_000)),
        )
        for i in range(count)
    ]


def random_peers(rng: np.random.Generator, count: int, memory_bytes: tuple[int, int]) -> list[PeerCapacity]:
    return [
        PeerCapacity(
            peer_id=f"peer-{i:03d}-{int(rng.integers(1 << 30)):x}",
            flops_per_s=float(10 ** rng.uniform(9, 12)),
            memory_bytes=int(rng.integers(*memory_bytes)),
            upload_bytes_per_s=float(10 ** rng.uniform(5, 8)),
            download_bytes_per_s=float(10 ** rng.uniform(5, 8)),
        )
        for i in range(count)
    ]


def heterogeneous_peers(
    rng: np.random.Generator, count: int, memory_scale_bytes: float
) -> list[PeerCapacity]:
    """Four device classes (laptop .. datacenter card) with lognormal spreads, like the benchmark's."""
    classes = [(2e11, 0.35, 4e6), (2e13, 0.6, 1.2e7), (6e13, 1.3, 4e7), (2e14, 4.0, 1.2e8)]
    peers = []
    for i in range(count):
        flops, memory, link = classes[int(rng.choice(4, p=[0.3, 0.4, 0.2, 0.1]))]
        f, m, d, a = rng.lognormal(0.0, [0.35, 0.25, 0.6, 0.3])
        peers.append(
            PeerCapacity(
                peer_id=f"p{i:05d}-{int(rng.integers(1 << 40)):010x}",
                flops_per_s=float(flops * f),
                memory_bytes=int(memory * m * memory_scale_bytes),
                upload_bytes_per_s=float(link * d * min(a * 0.5, 1.0)),
                download_bytes_per_s=float(link * d),
            )
        )
    return peers


def noisy_dtfm_model(seed: int, stages: int, replicas: int) -> CostModel:
    """A DT-FM cost model of devices in 3 sites with lognormal noise on every link (no twins)."""
    rng = np.random.default_rng(seed)
    n = stages * replicas
    site = rng.integers(0, 3, n)
    latency = np.where(site[:, None] == site[None, :], 0.002, 0.05) * rng.lognormal(0, 0.2, (n, n))
    bandwidth = np.where(site[:, None] == site[None, :], 1e9, 1e8) * rng.lognormal(0, 0.3, (n, n))
    latency, bandwidth = (latency + latency.T) / 2, (bandwidth + bandwidth.T) / 2
    np.fill_diagonal(latency, 0.0)
    return CostModel(latency, bandwidth, Workload(stages, replicas, c_dp_bytes=5e8, c_pp_bytes=1e8))


class Ticks:
    """A CPU clock that advances a fixed step per reading: a time-sliced search becomes reproducible."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now
