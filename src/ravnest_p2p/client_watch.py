"""Readable progress for the researcher: one-line summaries, terminal lines, a live notebook plot.

`RunClient.wait_for_job` hands its ``on_progress`` callback a `ProgressSnapshot`: the newest
`StageMetrics` of every stage (a list, as before), whose printed form is one short line per poll —
job, plan epoch and, per cluster, step, samples/s, loss and held-out accuracy — instead of the 1.5 to 2.5 KB
of raw metrics objects that ``on_progress=print`` used to print. `RunClient.watch` keeps a `JobHistory`
of those summaries and renders it as it grows: compact lines in a terminal (printed only when something
changed), a plot in a Jupyter notebook that redraws in place. No rendering library is required:
matplotlib (the ``dev`` extra) and IPython are used when present, and a terminal needs neither.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

from ravnest_p2p.client_timeline import StageSample, stage_sample, timeline_figure
from ravnest_p2p.training.metrics import StageMetrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ClusterProgress",
    "Display",
    "HistoryPoint",
    "JobHistory",
    "LineRenderer",
    "NotebookRenderer",
    "ProgressRenderer",
    "ProgressSnapshot",
    "ProgressSummary",
    "in_notebook",
    "make_renderer",
    "summarize",
]

Display = Literal["auto", "lines", "plot", "none"]


@dataclass(frozen=True)
class ClusterProgress:
    """One cluster's pipeline, as its stages report it.

    Attributes:
        step: micro-batches the first stage has completed.
        samples_per_s: the first stage's completed-sample rate (the pipeline's throughput).
        loss: the training loss the last stage reports (None before its first backward).
        loss_step: micro-batches the stage that reported `loss` had finished (stages report apart).
    """

    cluster: int
    num_stages: int
    step: int
    samples_per_s: float
    loss: float | None
    loss_step: int
    eval_loss: float | None
    eval_accuracy: float | None
    averaging_rounds: int
    done: bool

    def line(self) -> str:
        loss = f"{self.loss:.3f}" if self.loss is not None else "-"
        text = f"c{self.cluster} step {self.step} {self.samples_per_s:.0f} samples/s loss {loss}"
        if self.eval_accuracy is not None:
            text += f" acc {self.eval_accuracy:.1%}"
        return text + (" done" if self.done else "")


@dataclass(frozen=True)
class ProgressSummary:
    """A job's progress in one line (`str`): job, plan epoch, then each cluster."""

    job_id: str
    epoch: int
    clusters: tuple[ClusterProgress, ...]

    @property
    def done(self) -> bool:
        return bool(self.clusters) and all(c.done for c in self.clusters)

    def __str__(self) -> str:
        if not self.clusters:
            return f"{self.job_id}: waiting for the first metrics"
        return f"{self.job_id} epoch {self.epoch} | " + " | ".join(c.line() for c in self.clusters)


def _cluster_progress(cluster: int, stages: Sequence[StageMetrics]) -> ClusterProgress:
    stages = sorted(stages, key=lambda m: m.stage)
    first, last = stages[0], stages[-1]
    # held-out figures: the first stage drives evaluation (stages are sorted); any stage's will do
    lossy = next((m for m in reversed(stages) if m.loss is not None), None)
    evaluated = next((m for m in stages if m.eval_accuracy is not None or m.eval_loss is not None), None)
    return ClusterProgress(
        cluster=cluster,
        num_stages=first.num_stages,
        step=first.step,
        samples_per_s=first.samples_per_s or last.samples_per_s,
        loss=lossy.loss if lossy else None,
        loss_step=lossy.step if lossy else 0,
        eval_loss=evaluated.eval_loss if evaluated else None,
        eval_accuracy=evaluated.eval_accuracy if evaluated else None,
        averaging_rounds=max(m.averaging_rounds for m in stages),
        done=first.done if first.stage == 0 else False,
    )


def summarize(metrics: Sequence[StageMetrics], job_id: str | None = None) -> ProgressSummary:
    """The summary of one poll's metrics (of one job; the newest plan epoch among them)."""
    if not metrics:
        return ProgressSummary(job_id=job_id or "job", epoch=0, clusters=())
    epoch = max(m.epoch for m in metrics)
    current = [m for m in metrics if m.epoch == epoch]
    by_cluster: dict[int, list[StageMetrics]] = {}
    for m in current:
        by_cluster.setdefault(m.cluster, []).append(m)
    clusters = tuple(_cluster_progress(c, by_cluster[c]) for c in sorted(by_cluster))
    return ProgressSummary(job_id=job_id or current[0].job_id, epoch=epoch, clusters=clusters)


class ProgressSnapshot(list[StageMetrics]):
    """The newest `StageMetrics` of each stage of a job: a list that prints as a one-line summary."""

    def __init__(self, metrics: Sequence[StageMetrics] = (), job_id: str | None = None) -> None:
        super().__init__(metrics)
        self.job_id = job_id

    @property
    def summary(self) -> ProgressSummary:
        return summarize(self, self.job_id)

    def __str__(self) -> str:
        return str(self.summary)


@dataclass(frozen=True)
class HistoryPoint:
    """One cluster at one poll, `elapsed_s` after the watch began."""

    elapsed_s: float
    epoch: int
    progress: ClusterProgress


@dataclass
class JobHistory:
    """What `RunClient.watch` saw: a point per cluster per poll, each stage's counters per poll (`stages`,
    for `timeline`), and the job's final metrics."""

    job_id: str
    points: list[HistoryPoint] = field(default_factory=list)
    final: list[StageMetrics] = field(default_factory=list)
    stages: list[StageSample] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def add(
        self,
        summary: ProgressSummary,
        *,
        now: float | None = None,
        metrics: Sequence[StageMetrics] = (),
    ) -> None:
        """Record one poll: its summary and (for the timeline) every stage's metrics it read."""
        elapsed_s = (time.monotonic() if now is None else now) - self.started_at
        for cluster in summary.clusters:
            self.points.append(HistoryPoint(elapsed_s=elapsed_s, epoch=summary.epoch, progress=cluster))
        self.stages.extend(stage_sample(m, elapsed_s) for m in metrics)

    @property
    def summary(self) -> ProgressSummary:
        """The final metrics' summary (empty before the job is done)."""
        return summarize(self.final, self.job_id)

    @property
    def eval_accuracy(self) -> float | None:
        """The best held-out accuracy a cluster reports at the end (None without evaluation)."""
        values = [c.eval_accuracy for c in self.summary.clusters if c.eval_accuracy is not None]
        return max(values) if values else None

    def series(self, cluster: int, name: str, *, x: str = "elapsed_s") -> tuple[list[float], list[float]]:
        """(x, values) of one `ClusterProgress` field, e.g. ``loss``; None values skipped.

        `x`: ``elapsed_s`` (seconds since the watch began) or a `ClusterProgress` field such as ``loss_step``.
        """
        xs, ys = [], []
        for point in self.points:
            value = getattr(point.progress, name)
            if point.progress.cluster == cluster and value is not None:
                xs.append(point.elapsed_s if x == "elapsed_s" else float(getattr(point.progress, x)))
                ys.append(float(value))
        return xs, ys

    def clusters(self) -> list[int]:
        return sorted({p.progress.cluster for p in self.points})

    def plot(self) -> Figure:
        """Loss against micro-batches and samples/s against time, one line per cluster, and the averaging
        rounds each cluster finished when there are several (needs matplotlib)."""
        from matplotlib.figure import Figure  # the ``dev`` extra: only plotting needs it

        averaged = any(p.progress.averaging_rounds for p in self.points)
        fig = Figure(figsize=(13.5 if averaged else 9, 3.2), layout="constrained")
        axes = list(fig.subplots(1, 3 if averaged else 2))
        loss_ax, rate_ax = axes[:2]
        for cluster in self.clusters():
            label = f"cluster {cluster}"
            loss_ax.plot(*self.series(cluster, "loss", x="loss_step"), marker=".", label=label)
            rate_ax.plot(*self.series(cluster, "samples_per_s"), marker=".", label=label)
            if averaged:
                axes[2].step(*self.series(cluster, "averaging_rounds"), where="post", label=label)
        loss_ax.set(title=f"{self.job_id}: training loss", xlabel="micro-batches", ylabel="loss")
        rate_ax.set(title="throughput", xlabel="seconds", ylabel="samples/s")
        if averaged:
            axes[2].set(title="averaging across clusters", xlabel="seconds", ylabel="rounds finished")
        for ax in axes:
            ax.grid(alpha=0.3)
            if self.clusters():
                ax.legend(loc="best", fontsize="small")
        return fig

    def png(self) -> bytes:
        """`plot` as PNG bytes."""
        return _png(self.plot())

    def timeline(self) -> Figure:
        """Each stage's compute, send and idle shares over time (`client_timeline`; needs matplotlib)."""
        return timeline_figure(self.stages, title=f"{self.job_id}: where each stage's time went")

    def timeline_png(self) -> bytes:
        """`timeline` as PNG bytes."""
        return _png(self.timeline())


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


class ProgressRenderer(Protocol):
    def update(self, history: JobHistory, summary: ProgressSummary) -> None: ...

    def close(self, history: JobHistory) -> None: ...


class LineRenderer:
    """A terminal: one timestamped summary line per change (not per poll)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._last = ""

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        stream.flush()

    def update(self, history: JobHistory, summary: ProgressSummary) -> None:
        text = str(summary)
        if text != self._last:
            self._last = text
            self._print(text)

    def close(self, history: JobHistory) -> None:
        if history.final:
            self._print(f"finished: {history.summary}")


class NotebookRenderer:
    """A Jupyter notebook: the `JobHistory` plot, redrawn in place at most every `min_interval_s`."""

    def __init__(self, *, min_interval_s: float = 2.0) -> None:
        from IPython.display import display

        self.min_interval_s = min_interval_s
        self._handle: Any = display(display_id=True)
        self._text: Any = display(display_id=True)
        self._drawn_at = -float("inf")

    def _draw(self, history: JobHistory, text: str) -> None:
        from IPython.display import Image

        self._handle.update(Image(data=history.png()))
        self._text.update({"text/plain": text}, raw=True)
        self._drawn_at = time.monotonic()

    def update(self, history: JobHistory, summary: ProgressSummary) -> None:
        if history.points and time.monotonic() - self._drawn_at >= self.min_interval_s:
            self._draw(history, str(summary))

    def close(self, history: JobHistory) -> None:
        if history.points:
            self._draw(history, f"finished: {history.summary}")


class _Silent:
    def update(self, history: JobHistory, summary: ProgressSummary) -> None:
        pass

    def close(self, history: JobHistory) -> None:
        pass


def in_notebook() -> bool:
    """Whether this code runs in a Jupyter kernel (not a plain IPython terminal)."""
    shell_module = sys.modules.get("IPython")
    if shell_module is None:
        return False
    shell = shell_module.get_ipython()  # type: ignore[attr-defined]
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def _can_plot() -> bool:
    try:
        import IPython.display  # noqa: F401
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def make_renderer(display: Display = "auto", *, stream: TextIO | None = None) -> ProgressRenderer:
    """``auto``: a plot in a notebook when matplotlib is installed, else lines; ``none``: nothing."""
    if display == "none":
        return _Silent()
    if display == "plot" or (display == "auto" and in_notebook() and _can_plot()):
        return NotebookRenderer()
    return LineRenderer(stream)
