"""How fast this peer computes: matmul FLOP/s in the training dtype on the chosen device.

A square matmul is the dominant cost of the layers we train, so its rate is the planner's unit of
compute. The probe grows the matrix until one multiply takes a measurable time, then measures the
*sustained* rate: total FLOPs over the wall time of back-to-back multiplies for several scheduler
periods. A best-of-N single multiply would be wrong on a CPU-capped peer (a cgroup quota lets a short
burst run at full speed and then stalls the process for the rest of its 100 ms period), and volunteers
do run peers in containers with CPU limits. It stays under about a second and the result is cached per
host + device + dtype + thread count + CPU quota, so a restarted peer does not pay for it again but a
re-limited one measures afresh.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import torch

__all__ = ["cpu_quota", "measure_matmul_flops"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ravnest_p2p" / "compute.json"


def cpu_quota(
    proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> str:
    """This process's cgroup CPU limit as text, for the cache key ('max' when it has none).

    When the limit cannot be read but the process sits in a CPU cgroup of its own, the answer names that
    group instead: ``ip netns exec`` (the lab, and many container tools) mounts a fresh ``/sys`` without
    the cgroup file systems, and reporting 'max' there let every throttled lab peer reuse an unthrottled
    peer's cached figure (all eight hetero8 peers advertised the same FLOP/s).
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return "max"
    unreadable_group = None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        group = group.lstrip("/")
        if controllers == "":  # cgroup v2
            paths = [cgroup_root / group / "cpu.max"]
        elif "cpu" in controllers.split(","):
            paths = [cgroup_root / d / group / "cpu.cfs_quota_us" for d in ("cpu", "cpu,cpuacct")]
        else:
            continue
        value = None
        for path in paths:
            try:
                value = path.read_text().strip()
                break
            except OSError:
                continue
        if value is None:
            if group and unreadable_group is None:
                unreadable_group = f"{controllers or 'v2'}:/{group}"
            continue
        if value not in ("-1", "max") and not value.startswith("max "):
            return value
    return "max" if unreadable_group is None else f"unknown in {unreadable_group}"


def _cache_key(device: str, dtype: str) -> str:
    return (
        f"{socket.gethostname()}|{device}|{dtype}|threads={torch.get_num_threads()}|quota={cpu_quota()}"
        f"|torch={torch.__version__}"
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench(device: torch.device, dtype: torch.dtype, budget_s: float) -> float:
    # 1. size: grow until one multiply takes ~10 ms (a third of the budget at most)
    size = 128
    sizing_deadline = time.perf_counter() + budget_s / 3
    while True:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up: allocator, kernels
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= 0.01 or size >= 4096 or time.perf_counter() > sizing_deadline:
            break
        size *= 2
    # 2. sustained: back-to-back multiplies over several 100 ms scheduler periods
    flops_each = 2 * size**3
    count = 0
    start = time.perf_counter()
    while True:
        torch.matmul(a, b)
        count += 1
        if count % 4 == 0:
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s * 2 / 3:
                return count * flops_each / elapsed


def measure_matmul_flops(
    device: str = "cpu", dtype: str = "float32", *, budget_s: float = 0.9, use_cache: bool = True
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
