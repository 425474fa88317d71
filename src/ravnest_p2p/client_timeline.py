"""Where each stage's time goes: compute, send and idle per stage over a run, from the metrics it publishes.

Problem: a pipeline is as fast as its slowest stage, and the researcher needs to see which one that is
and why — busy computing (give it fewer layers), busy sending (a slow link), or idle (waiting on a
neighbour). Each stage already publishes cumulative counters in its `StageMetrics`: ``compute_s``
(forward, backward and optimizer time), ``send_busy_s`` (time with an activation or gradient send in
progress) and its own timestamp ``updated_at``. Two successive records of the same stage give the
fractions of the interval between them; `RunClient.watch` keeps every record it polls, so a finished
watch draws the timeline without asking the peers anything more.

Sends run beside compute (another task), so the two fractions can overlap; the plot stacks compute,
then the part of sending that did not overlap compute (``min(send, 1 - compute)``), then idle (the
rest), so a band never exceeds the interval. Alternatives rejected: per-micro-batch event traces from
every stage (exact, but a new wire message and DHT load for a picture the counters already give to a
poll's resolution).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ravnest_p2p.training.metrics import StageMetrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["StageInterval", "StageSample", "stage_intervals", "stage_sample", "timeline_figure"]

StageKey = tuple[int, int, int, str]  # (plan epoch, cluster, stage, peer id)


@dataclass(frozen=True)
class StageSample:
    """One stage's cumulative counters as one poll saw them (`elapsed_s` after the watch began)."""

    elapsed_s: float
    epoch: int
    cluster: int
    stage: int
    peer_id: str
    updated_at: float
    compute_s: float
    send_busy_s: float
    samples_per_s: float
    averaging_rounds: int

    @property
    def key(self) -> StageKey:
        return (self.epoch, self.cluster, self.stage, self.peer_id)


def stage_sample(metrics: StageMetrics, elapsed_s: float) -> StageSample:
    return StageSample(
        elapsed_s=elapsed_s,
        epoch=metrics.epoch,
        cluster=metrics.cluster,
        stage=metrics.stage,
        peer_id=metrics.peer_id,
        updated_at=metrics.updated_at,
        compute_s=metrics.compute_s,
        send_busy_s=metrics.send_busy_s,
        samples_per_s=metrics.samples_per_s,
        averaging_rounds=metrics.averaging_rounds,
    )


@dataclass(frozen=True)
class StageInterval:
    """The share of one stage's time between two of its records spent computing, sending and idle.

    `start_s`/`end_s` are the watch's clock (the polls that first saw each record); the shares come from
    the stage's own clock (its `updated_at`), so a slow poll does not distort them. They sum to 1.
    """

    key: StageKey
    start_s: float
    end_s: float
    compute: float
    send: float
    idle: float


def stage_intervals(samples: Iterable[StageSample]) -> dict[StageKey, list[StageInterval]]:
    """Per stage (by epoch, cluster, stage and peer), the intervals between its successive records.

    A record seen again unchanged (same `updated_at`) is skipped; counters that went backwards (a new
    runner on the same plan) start a new series instead of a negative interval.
    """
    series: dict[StageKey, list[StageSample]] = {}
    for sample in samples:
        seen = series.setdefault(sample.key, [])
        if not seen or sample.updated_at > seen[-1].updated_at:
            seen.append(sample)
    intervals: dict[StageKey, list[StageInterval]] = {}
    for key, seen in series.items():
        out = intervals.setdefault(key, [])
        for before, after in itertools.pairwise(seen):
            wall = after.updated_at - before.updated_at
            compute = after.compute_s - before.compute_s
            send = after.send_busy_s - before.send_busy_s
            if wall <= 0 or compute < 0 or send < 0:
                continue
            compute_share = min(1.0, compute / wall)
            send_share = min(send / wall, 1.0 - compute_share)
            out.append(
                StageInterval(
                    key=key,
                    start_s=before.elapsed_s,
                    end_s=after.elapsed_s,
                    compute=compute_share,
                    send=send_share,
                    idle=max(0.0, 1.0 - compute_share - send_share),
                )
            )
    return {key: value for key, value in intervals.items() if value}


def _label(key: StageKey, num_epochs: int) -> str:
    epoch, cluster, stage, peer_id = key
    text = f"cluster {cluster} stage {stage} ({peer_id[-6:]})"
    return f"epoch {epoch} {text}" if num_epochs > 1 else text


def timeline_figure(samples: Sequence[StageSample], title: str = "pipeline timeline") -> Figure:
    """A row per stage: compute, send and idle shares over time as stacked bars (needs matplotlib)."""
    from matplotlib.figure import Figure  # the ``dev`` extra: only plotting needs it

    intervals = stage_intervals(samples)
    keys = sorted(intervals)
    rows = max(1, len(keys))
    fig = Figure(figsize=(9, 0.9 + 0.75 * rows), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    epochs = len({key[0] for key in keys})
    colours = {"compute": "tab:blue", "send": "tab:orange", "idle": "lightgrey"}
    for ax, key in zip(axes, keys, strict=False):
        spans = intervals[key]
        lefts = [s.start_s for s in spans]
        widths = [max(s.end_s - s.start_s, 1e-3) for s in spans]
        bottom = [0.0] * len(spans)
        for part, colour in colours.items():
            heights = [getattr(s, part) for s in spans]
            ax.bar(lefts, heights, width=widths, bottom=bottom, align="edge", color=colour, label=part)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_ylabel(_label(key, epochs), rotation=0, ha="right", va="center", fontsize="small")
    if not keys:
        axes[0].text(0.5, 0.5, "no stage reported twice yet", ha="center", va="center")
    fig.suptitle(title)
    axes[-1].set_xlabel("seconds since the watch began")
    if keys:
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", fontsize="small", ncols=3)
    return fig
