"""Free memory a peer may use for training: what the OS reports available, capped by the volunteer."""

from __future__ import annotations

import psutil
import torch

__all__ = ["free_memory_bytes"]


def free_memory_bytes(device: str = "cpu", *, cap_gb: float | None = None) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        available = int(free)
    else:
        available = int(psutil.virtual_memory().available)
    if cap_gb is not None:
        if cap_gb <= 0:
            raise ValueError("the memory cap must be positive")
        available = min(available, int(cap_gb * 2**30))
    return available
