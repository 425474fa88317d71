"""How fast this peer computes: matmul FLOP/s in the training dtype on the chosen device.

A square matmul is the dominant cost of the layers we train, so its rate is the planner's unit of
compute. The probe grows the matrix until one multiply takes a measurable time, then measures the
*sustained* rate: total FLOPs over the wall time of back-to-back multiplies for several scheduler
periods. A best-of-N single multiply would be wrong on a CPU-capped peer (a cgroup quota lets a short
burst run at full speed and then stalls the process for the rest of its 100 ms period), and volunteers
do run peers in containers with CPU limits. It stays under about a second and the result is cached per
host + device + dtype + thread count + CPU quota, so a restarted peer does not pay for it again but a
re-limited one measures afresh.

The cache must not poison itself: one reading taken on a loaded host (0.047 GFLOP/s) was once cached
and reused by every later peer on that host. So a cached figure expires (`CACHE_MAX_AGE_S`) and a fresh
reading replaces it; a reading is cached only if it is plausible (`MIN_PLAUSIBLE_FLOPS`) and the
process got most of the CPUs it was allowed while it ran (CPU time over wall time: a CPU quota is a real
limit, another process eating our cores is not); otherwise the probe is repeated and the median is
advertised, uncached. Known limit: a host that stays busy throughout yields a low, uncached figure.

One reading is noisy (turbo, a neighbour's burst that the CPU-share check misses), so the cache keeps
the last `_KEEP_READINGS` clean readings and the advertised figure is their median. A running peer adds
readings in the background (`remeasure_matmul_flops`, driven by `compute_refresh.ComputeRefresher` while
the peer is not training), so the figure follows the host and never expires from under a long-lived peer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CACHE_MAX_AGE_S",
    "MIN_PLAUSIBLE_FLOPS",
    "ComputeReading",
    "cpu_quota",
    "measure_matmul_flops",
    "quota_cpus",
    "remeasure_matmul_flops",
    "take_reading",
]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

CACHE_MAX_AGE_S = 6 * 3600.0  # a cached figure is re-measured after this: hosts change, loads come and go
# Below this no device we could train on computes (a 2010 laptop core does ~10 GFLOP/s): such a reading
# says the process was starved, e.g. a peer that measured 0.047 GFLOP/s on a loaded host and cached it
MIN_PLAUSIBLE_FLOPS = 0.5e9
_MIN_CPU_SHARE = 0.6  # a probe that got under this fraction of its allowed CPUs ran on a busy host
_MAX_READINGS = 3  # readings one measurement takes at most while they are not clean
_KEEP_READINGS = 5  # clean readings the cache keeps per key; the figure is their median


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


@dataclass(frozen=True)
class ComputeReading:
    """One probe: its FLOP/s and the CPUs the process actually got while it ran."""

    flops: float
    cpu_share: float  # process CPU seconds / wall seconds during the probe
    allowed_cpus: float | None  # CPUs it could have used (threads, affinity, quota); None: not a CPU

    @property
    def contended(self) -> bool:
        """Whether other work on the host took the CPUs this process was allowed (a busy host).

        A CPU quota is not contention: a capped process gets its quota, and its reading is its real
        speed. A process that got well under what it was allowed shared the CPUs with someone else.
        """
        if self.allowed_cpus is None:
            return False
        return self.cpu_share < _MIN_CPU_SHARE * self.allowed_cpus

    @property
    def plausible(self) -> bool:
        return self.flops >= MIN_PLAUSIBLE_FLOPS

    @property
    def cacheable(self) -> bool:
        return self.plausible and not self.contended


def quota_cpus(quota: str) -> float | None:
    """CPUs allowed by a `cpu_quota` text (``50000 100000`` or a v1 quota in µs of 100 ms): None if none."""
    parts = quota.split()
    try:
        if len(parts) == 2:
            return int(parts[0]) / int(parts[1])
        if len(parts) == 1:
            return int(parts[0]) / 100_000  # cgroup v1's default cfs period
    except ValueError:
        return None
    return None


def _allowed_cpus(device: torch.device) -> float | None:
    if device.type != "cpu":
        return None
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cpus = float(os.cpu_count() or 1)
    cpus = min(cpus, float(torch.get_num_threads()))
    quota = quota_cpus(cpu_quota())
    return min(cpus, quota) if quota is not None else cpus


def take_reading(device: str = "cpu", dtype: str = "float32", *, budget_s: float = 0.9) -> ComputeReading:
    """One sustained matmul probe, with the CPU share the process got meanwhile."""
    torch_device = torch.device(device)
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    flops = _bench(torch_device, _DTYPES[dtype], budget_s)
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    return ComputeReading(
        flops=flops, cpu_share=cpu_s / max(wall_s, 1e-9), allowed_cpus=_allowed_cpus(torch_device)
    )


def _load_cache(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _entry_readings(entry: object) -> list[tuple[float, float]]:
    """(flops, measured_at) pairs of one cache entry; the one-reading format before lists is read too."""
    if not isinstance(entry, dict):
        return []  # a bare number: the format before readings had an age
    pairs = entry.get("readings")
    if pairs is None:
        pairs = [[entry.get("flops"), entry.get("measured_at")]]
    out = []
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int | float) for v in pair):
            out.append((float(pair[0]), float(pair[1])))
    return out


def _read_cache(path: Path, key: str, *, max_age_s: float, now: float) -> list[float]:
    """The fresh, plausible cached readings for `key` (expired, future or absurd ones are dropped)."""
    return [
        flops
        for flops, measured_at in _entry_readings(_load_cache(path).get(key))
        if flops >= MIN_PLAUSIBLE_FLOPS and 0 <= now - measured_at <= max_age_s
    ]


def _write_cache(
    path: Path, key: str, flops: float, *, now: float, max_age_s: float = CACHE_MAX_AGE_S
) -> None:
    """Add a clean reading to `key`'s list, keeping the newest `_KEEP_READINGS` fresh ones."""
    cache = _load_cache(path)
    kept = [
        [f, t]
        for f, t in _entry_readings(cache.get(key))
        if f >= MIN_PLAUSIBLE_FLOPS and 0 <= now - t <= max_age_s
    ]
    cache[key] = {"readings": [*kept, [flops, now]][-_KEEP_READINGS:]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.debug("cannot cache compute measurement: %s", exc)


def measure_matmul_flops(
    device: str = "cpu",
    dtype: str = "float32",
    *,
    budget_s: float = 0.9,
    use_cache: bool = True,
    max_age_s: float = CACHE_MAX_AGE_S,
    reader: Callable[[], ComputeReading] | None = None,
) -> float:
    """Measured FLOP/s of a matmul in `dtype` on `device`, cached per host/device/dtype/threads/quota.

    The figure is the median of the cached clean readings younger than `max_age_s`; without any, the
    probe runs and a clean reading joins the cache. A reading taken while the host was busy
    (`contended`) or below `MIN_PLAUSIBLE_FLOPS` is never cached; the probe is repeated up to
    `_MAX_READINGS` times and the median of those readings is returned (a clean one ends the repetition).

    Args:
        reader: takes one reading (tests); default `take_reading` with `budget_s`.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    key = _cache_key(device, dtype)
    path = _cache_path()
    if use_cache:
        cached = _read_cache(path, key, max_age_s=max_age_s, now=time.time())
        if cached:
            return statistics.median(cached)
    read = reader or (lambda: take_reading(device, dtype, budget_s=budget_s))
    readings = [read()]
    while not readings[-1].cacheable and len(readings) < _MAX_READINGS:
        logger.info(
            "compute reading %.2f GFLOP/s with %.2f of %s CPUs: %s; measuring again",
            readings[-1].flops / 1e9,
            readings[-1].cpu_share,
            readings[-1].allowed_cpus,
            "host busy" if readings[-1].contended else "implausibly low",
        )
        readings.append(read())
    if readings[-1].cacheable:
        flops = readings[-1].flops
        if use_cache:
            _write_cache(path, key, flops, now=time.time(), max_age_s=max_age_s)
    else:
        flops = statistics.median(r.flops for r in readings)
        logger.warning(
            "compute measured on a busy host or implausibly low (median %.2f GFLOP/s of %d readings): "
            "advertised, not cached",
            flops / 1e9,
            len(readings),
        )
    return flops


def remeasure_matmul_flops(
    device: str = "cpu",
    dtype: str = "float32",
    *,
    budget_s: float = 0.9,
    max_age_s: float = CACHE_MAX_AGE_S,
    reader: Callable[[], ComputeReading] | None = None,
) -> float | None:
    """One more reading for a running peer: if clean, cache it and return the new median; else None.

    A busy or implausible reading teaches nothing about the device and is dropped (the caller keeps
    advertising what it has), so a background re-measurement can only refine the figure, never poison it.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    reading = (reader or (lambda: take_reading(device, dtype, budget_s=budget_s)))()
    if not reading.cacheable:
        logger.info(
            "background compute reading %.2f GFLOP/s with %.2f of %s CPUs dropped (%s)",
            reading.flops / 1e9,
            reading.cpu_share,
            reading.allowed_cpus,
            "host busy" if reading.contended else "implausibly low",
        )
        return None
    key, path, now = _cache_key(device, dtype), _cache_path(), time.time()
    _write_cache(path, key, reading.flops, now=now, max_age_s=max_age_s)
    return statistics.median(_read_cache(path, key, max_age_s=max_age_s, now=now) or [reading.flops])
