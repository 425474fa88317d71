"""Free memory a peer may use for training: what the OS reports available, capped by the volunteer.

With a cap (``--max-memory-gb``, enforced in the lab by a cgroup) the peer's own baseline -- the
interpreter, torch, hivemind and its p2p daemon, all charged to the same cgroup -- is not available for
stages. `framework_overhead_bytes` measures it once at start-up and `free_memory_bytes` subtracts it from
the cap, so the planner's per-stage model (`planning.memory`) is compared with what is really left.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import resource
from pathlib import Path

import psutil
import torch

__all__ = [
    "MemorySnapshot",
    "framework_overhead_bytes",
    "free_memory_bytes",
    "limit_heap_retention",
    "memory_snapshot",
    "peak_rss_bytes",
    "release_free_memory",
    "steady_memory_bytes",
]

MEMORY_HYSTERESIS_RATIO = 2 ** (1 / 8)
"""A published free-memory figure moves only past this ratio: two of the view's memory buckets."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``); False where unavailable.

    Why: tensors between glibc's mmap threshold (raised dynamically up to 32 MiB after a large free) and
    that limit come from the heap, and freed heap memory stays resident. A peer that profiles a model
    layer by layer (every peer does, to plan) kept ~180 MiB of such garbage for a 300M model -- memory
    under its cap that no stage could use. Called after each dry run.
    """
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
HEAP_LIMIT_BYTES = 1 << 20
"""Allocations from this size up get their own mapping, returned to the OS when freed."""


def limit_heap_retention(threshold_bytes: int = HEAP_LIMIT_BYTES) -> bool:
    """Serve allocations of `threshold_bytes` and more by ``mmap`` for good (glibc); False elsewhere.

    Why: glibc raises its mmap threshold after every large free, up to 32 MiB, so after the first
    optimizer step the weight-stash clones, gradients and optimizer temporaries of a transformer stage
    (tensors of 4-16 MiB) come from the heap; freed in another order than allocated they leave holes,
    and the process grew 120-370 MiB above its live tensors within a few steps (bench_big_model, where
    it was the whole gap between predicted and measured peaks). A fixed threshold turns that off: a
    tensor's pages go back to the OS when it is freed, so resident memory follows the live tensors the
    memory model counts. Cost: fresh pages are zero-filled on each large allocation, about 0.5 s of
    CPU per optimizer step for a 144 MiB stage (docs/memory.md). Call once, early, before the big
    allocations.
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))


def framework_overhead_bytes() -> int:
    """Resident memory of this process and its children (e.g. the p2p daemon) now, in bytes."""
    me = psutil.Process()
    total = int(me.memory_info().rss)
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += int(child.memory_info().rss)
    return total


@dataclasses.dataclass(frozen=True)
class MemorySnapshot:
    """Resident memory of this process (and its children, e.g. the p2p daemon) from ``/proc``, bytes.

    ``hwm`` is the kernel's high-water mark of ``rss`` (``VmHWM``); ``anon`` and ``file`` split ``rss``
    into heap/tensors and mapped files (shared libraries). Used to find where a peer's peak comes from.
    """

    rss: int
    anon: int
    file: int
    hwm: int
    children_rss: int
    children_hwm: int

    def describe(self) -> str:
        mib = 2**20
        return (
            f"rss {self.rss / mib:.0f} MiB (anon {self.anon / mib:.0f}, file {self.file / mib:.0f}), "
            f"high-water {self.hwm / mib:.0f} MiB; children rss {self.children_rss / mib:.0f}, "
            f"high-water {self.children_hwm / mib:.0f} MiB"
        )


def _status_kb(pid: int | str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            out[key] = int(value.split()[0])
    return out


def memory_snapshot() -> MemorySnapshot:
    """This process's `MemorySnapshot` now (zeros where ``/proc`` is unavailable)."""
    own = _status_kb("self")
    children_rss = children_hwm = 0
    for child in psutil.Process().children(recursive=True):
        status = _status_kb(child.pid)
        children_rss += status.get("VmRSS", 0)
        children_hwm += status.get("VmHWM", 0)
    k = 1024
    return MemorySnapshot(
        rss=own.get("VmRSS", 0) * k,
        anon=own.get("RssAnon", 0) * k,
        file=own.get("RssFile", 0) * k,
        hwm=own.get("VmHWM", 0) * k,
        children_rss=children_rss * k,
        children_hwm=children_hwm * k,
    )


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``VmHWM``), in bytes."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def free_memory_bytes(device: str = "cpu", *, cap_gb: float | None = None, overhead_bytes: int = 0) -> int:
    """Memory left for training stages.

    Args:
        device: ``cpu`` or a CUDA device.
        cap_gb: the volunteer's cap in GB (10**9 bytes, as the lab's cgroup limit); None: no cap.
        overhead_bytes: what the peer itself holds under the cap (`framework_overhead_bytes`); only
            subtracted from a cap (the OS's available figure already excludes it).
    """
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        available = int(free)
    else:
        available = int(psutil.virtual_memory().available)
    if cap_gb is not None:
        if cap_gb <= 0:
            raise ValueError("the memory cap must be positive")
        available = min(available, max(0, int(cap_gb * 1e9) - overhead_bytes))
    return available


def steady_memory_bytes(published: int | None, measured: int) -> int:
    """The free memory to publish: `published` unless `measured` left the hysteresis band around it.

    The membership view buckets memory in sixteenths of an octave (`membership.view`); the OS's
    available figure moves by a few percent all the time, and every bucket change restarts a forming
    plan's stability count. Two buckets of slack (9 %) absorb that jitter; a real change is published.
    """
    if published is None or published <= 0 or measured <= 0:
        return measured
    ratio = measured / published
    return published if 1 / MEMORY_HYSTERESIS_RATIO <= ratio <= MEMORY_HYSTERESIS_RATIO else measured
