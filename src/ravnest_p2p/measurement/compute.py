"""How fast this peer computes: matmul FLOP/s in the training dtype on the chosen device.

A square matmul is the dominant cost of the layers we train, so its rate is the planner's unit of
compute. The probe grows the matrix until one multiply takes a measurable time, then takes the best of
a few repeats (the best, not the mean: other processes only ever slow us down). It stays under about a
second and the result is cached per host + device + dtype + thread count, because a volunteer restarting
a peer should not pay for it again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import torch

__all__ = ["measure_matmul_flops"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ravnest_p2p" / "compute.json"


def _cache_key(device: str, dtype: str) -> str:
    return (
        f"{socket.gethostname()}|{device}|{dtype}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    )


def _bench(device: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    size = 128
    best = 0.0
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up: allocator, kernels
        start = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * size**3 / max(elapsed, 1e-9))
        if elapsed < 0.02 and size < 4096:
            size *= 2
    return best


def measure_matmul_flops(
    device: str = "cpu", dtype: str = "float32", *, budget_s: float = 0.6, use_cache: bool = True
) -> float:
    """Measured FLOP/s of a matmul in `dtype` on `device` (cached per host/device/dtype/threads)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    key = _cache_key(device, dtype)
    path = _cache_path()
    cache: dict[str, float] = {}
    if use_cache:
        try:
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                cache = {k: float(v) for k, v in loaded.items() if isinstance(v, int | float)}
        except (OSError, ValueError):
            cache = {}
        if cache.get(key, 0) > 0:
            return cache[key]
    flops = _bench(torch.device(device), _DTYPES[dtype], budget_s)
    if use_cache and flops > 0:
        cache[key] = flops
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as exc:
            logger.debug("cannot cache compute measurement: %s", exc)
    return flops
