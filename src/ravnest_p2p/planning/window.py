"""The pipeline window: how many micro-batches a cluster of S stages keeps in flight — one definition.

The planner budgets memory for the window (every stage stashes that many weight versions and that
many micro-batches of activations) and the runtime admits that many micro-batches. They used to
disagree: the planner assumed 4 while the runtime ran ``3 * S - 2`` (7 at three stages), so a plan could
fit memory that training then overran. Both now call `pipeline_window`; the planner, which fixes S only
while it plans, budgets for the largest window any cluster of the job may get (`planning_window`), so a
stage never runs a window bigger than the one its memory was planned for.

Why ``3 * S - 2`` (the default, when the job sets no `max_in_flight`): PipeDream admits S micro-batches,
which saturates a pipeline whose communication is free. Over volunteer links a transfer takes as long as
a stage's compute, so each link direction is a pipeline resource too: a micro-batch's round trip visits S
computes and 2(S-1) link directions, at most ``(3S - 2) x`` the slowest one's time; that many in flight
always reach the bottleneck's rate, but where compute and links are unbalanced fewer do, and more only
queue (measured: `benchmarks/results/pipeline_throughput.md`). The cost is up to that many stashed weight
versions on the first stage; set `max_in_flight` lower where memory is tight.

Pure: planning/ and runtime/ both import it (planning may not import runtime).
"""

from __future__ import annotations

__all__ = ["default_window", "pipeline_window", "planning_window"]


def default_window(num_stages: int) -> int:
    """The most micro-batches in flight a pipeline of `num_stages` may need: ``3 * num_stages - 2``."""
    if num_stages < 1:
        raise ValueError(f"a pipeline has at least one stage, not {num_stages}")
    return 3 * num_stages - 2


def pipeline_window(max_in_flight: int | None, num_stages: int) -> int:
    """The window a cluster of `num_stages` stages runs with: the job's `max_in_flight`, else the default.

    Args:
        max_in_flight: the job's explicit window (None: `default_window`).
        num_stages: stages of the cluster.
    """
    if max_in_flight is not None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight}")
        return max_in_flight
    return default_window(num_stages)


def planning_window(max_in_flight: int | None, max_stages: int) -> int:
    """The window the planner budgets memory for: the largest `pipeline_window` of up to `max_stages`.

    The planner cannot know a cluster's stage count before it has planned it, and a cluster never has
    more stages than the model has layers, so budgeting for `max_stages` (= the number of layers) never
    under-budgets. The window grows with S while each stage's share of the layers shrinks, so the stash
    of a stage stays near ``3 x`` its parameters.
    """
    return pipeline_window(max_in_flight, max(1, max_stages))
