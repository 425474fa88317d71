"""What one pipeline stage holds in memory: the model the planner budgets and a peer checks its role against.

Problem. A peer that takes a stage it cannot hold is OOM-killed mid-run (or, without a cap, swaps the
host to a crawl); a planner that over-budgets leaves big models unplanned. The estimate must therefore
cover everything the runtime (`runtime.stage.StageExecutor`, async 1F1B with weight stashing) keeps, for
the window the runtime really uses (`planning.window`, one definition for both), and nothing else.

Per layer, with ``W`` the window (micro-batches in flight) and ``B`` the micro-batch size:
  * parameters: the live weights (``param_bytes``);
  * stash: up to ``W`` copies of the trainable weights, one per weight version an in-flight micro-batch
    was forwarded with (a version is freed when its last micro-batch is done and the weights moved on);
  * gradients: one copy of the trainable weights (the accumulated ``.grad``; the executor keeps the last
    micro-batch's gradient as the same tensor, so not a second copy);
  * optimizer state: slots per trainable element (Adam: 2, SGD with momentum: 1; `models.profile`);
  * activations: ``W * B`` samples of what autograd saves in the layer's forward (measured by the
    profiler with saved-tensor hooks, parameters excluded) plus the layer's output.
Per peer, added once: the framework overhead (interpreter, torch, hivemind, the p2p daemon), measured
by the peer at start-up (`measurement.memory.framework_overhead_bytes`) and subtracted from the memory it
announces, so the planner compares stage needs against what is really left.

`memory_headroom` multiplies the per-layer sum for planning and for a peer's own check (allocator slack,
transient buffers of the optimizer step); `StageMemory.total_bytes` is the raw prediction we compare
with measured peaks (docs/memory.md).

Known limits: evaluation forwards (no grad, ``eval_batch_size`` samples) are transient and not counted;
recompute mode is budgeted as if it stored activations (an over-estimate); tied weights shared inside a
stage are counted twice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ravnest_p2p.planning.types import JobParams, PeerCapacity
from ravnest_p2p.types import LayerProfile

__all__ = ["StageMemory", "layer_memory_bytes", "memory_shortfall", "stage_memory"]

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """The parts of one stage's memory (bytes, no headroom); `total_bytes` is their sum."""

    param_bytes: int
    stash_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.stash_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
        )


def stage_memory(layers: Sequence[LayerProfile], job: JobParams) -> StageMemory:
    """The raw (headroom-free) memory of a stage holding ``layers`` for the job's window."""
    window, batch = job.max_in_flight, job.micro_batch_size
    trainable = sum(
        layer.param_bytes if layer.trainable_bytes is None else layer.trainable_bytes for layer in layers
    )
    return StageMemory(
        param_bytes=sum(layer.param_bytes for layer in layers),
        stash_bytes=window * trainable,
        grad_bytes=trainable,
        optimizer_bytes=sum(layer.optimizer_state_bytes for layer in layers),
        activation_bytes=window
        * batch
        * sum(layer.saved_bytes_per_sample + layer.activation_bytes_per_sample for layer in layers),
    )


def layer_memory_bytes(layer: LayerProfile, job: JobParams) -> int:
    """Memory one layer needs on its stage, headroom included (see the module docstring)."""
    return math.ceil(stage_memory([layer], job).total_bytes * job.memory_headroom)


def memory_shortfall(
    peers: Sequence[PeerCapacity], layers: Sequence[LayerProfile], job: JobParams
) -> str | None:
    """Why ``peers`` cannot hold the model, in words, or None when memory alone does not rule it out.

    Two necessary conditions: the peers' memory together covers every layer's need, and the peer with the
    most memory holds the largest layer (a layer is never split). A plan with no cluster for a model that
    passes both failed for another reason (e.g. contiguity, too few peers for ``min_stages``).
    """
    needs = [layer_memory_bytes(layer, job) for layer in layers]
    offered = [peer.memory_bytes for peer in peers]
    total_need, total_offered = sum(needs), sum(offered)
    largest_need, largest_offered = max(needs, default=0), max(offered, default=0)
    window = (
        f"window {job.max_in_flight}, micro-batch {job.micro_batch_size}, headroom x{job.memory_headroom}"
    )
    if total_need > total_offered:
        return (
            f"the model needs {total_need / _GIB:.2f} GiB to train ({window}) but the {len(peers)} peers "
            f"offer {total_offered / _GIB:.2f} GiB together"
        )
    if largest_need > largest_offered:
        return (
            f"the model's largest layer needs {largest_need / _GIB:.2f} GiB ({window}) but no peer offers "
            f"more than {largest_offered / _GIB:.2f} GiB"
        )
    return None
