"""Does a stage fit this peer? The planner's memory model (`planning.memory`) applied to one role.

A peer checks every role before it builds the stage and refuses one that does not fit its memory
(`StageDoesNotFit`, which the supervisor reports as the run's failure reason) instead of being
OOM-killed half-way through building it or in its first backward. The planner already plans with the
same model, so on an agreed plan the check only fails when a peer's own figures changed; on an explicit
assignment it is the only guard.

The profiles come from `training.placement.stage_profiles`, which builds only the stage's layers.
"""

from __future__ import annotations

from ravnest_p2p.errors import RavnestError
from ravnest_p2p.planning import JobParams
from ravnest_p2p.planning.memory import StageMemory, layer_memory_bytes, stage_memory
from ravnest_p2p.types import LayerProfile

__all__ = ["StageDoesNotFit", "check_stage_fits", "describe"]

_GIB = 2**30


class StageDoesNotFit(RavnestError):
    """This peer was given a stage its memory cannot hold."""


def describe(memory: StageMemory) -> str:
    """The parts of a stage's memory, in GiB, for messages and reports."""
    parts = {
        "params": memory.param_bytes,
        "stash": memory.stash_bytes,
        "grads": memory.grad_bytes,
        "optimizer": memory.optimizer_bytes,
        "activations": memory.activation_bytes,
    }
    return ", ".join(f"{name} {value / _GIB:.2f}" for name, value in parts.items())


def check_stage_fits(layers: list[LayerProfile], job: JobParams, *, available_bytes: int, what: str) -> int:
    """Raise `StageDoesNotFit` unless ``layers`` fit in ``available_bytes``; return the need (headroom in).

    Args:
        layers: the stage's layer profiles.
        job: the planner's view of the job (window, micro-batch, headroom).
        available_bytes: what this peer has for stages (its cap minus its own overhead).
        what: names the stage in the message.
    """
    need = sum(layer_memory_bytes(layer, job) for layer in layers)
    if need > available_bytes:
        raw = stage_memory(layers, job)
        raise StageDoesNotFit(
            f"{what} needs {need / _GIB:.2f} GiB ({describe(raw)} GiB, x{job.memory_headroom} headroom, "
            f"window {job.max_in_flight}) but this peer has {available_bytes / _GIB:.2f} GiB under its cap"
        )
    return need
