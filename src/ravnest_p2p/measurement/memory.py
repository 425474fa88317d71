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
import functools
import resource

import psutil
import torch

__all__ = ["framework_overhead_bytes", "free_memory_bytes", "peak_rss_bytes", "release_free_memory"]


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


def framework_overhead_bytes() -> int:
    """Resident memory of this process and its children (e.g. the p2p daemon) now, in bytes."""
    me = psutil.Process()
    total = int(me.memory_info().rss)
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += int(child.memory_info().rss)
    return total


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
