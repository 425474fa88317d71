"""The dashboard's JSON snapshot of a run, built from what a DHT client reads: pure functions, no I/O.

Everything here comes from strangers' signed records. The records are already validated (numbers
range-checked, strings length-capped), and the snapshot is bounded on top of that: at most
`MAX_PEERS` peers, `MAX_STAGES` stage metrics and `MAX_POINTS` history points per cluster, so a
swarm cannot make the page (or the JSON) grow without limit. Strings are passed through as data; the
page renders them with ``textContent`` only, never as markup.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ravnest_p2p.client_watch import summarize
from ravnest_p2p.discovery import PeerRecord
from ravnest_p2p.discovery.records import Serving
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import StageMetrics
from ravnest_p2p.training.placement import job_serving
from ravnest_p2p.training.progress import ProgressView

__all__ = [
    "MAX_CLUSTERS",
    "MAX_PEERS",
    "MAX_POINTS",
    "MAX_STAGES",
    "History",
    "build_state",
    "peer_row",
    "unfit_for",
]

MAX_PEERS = 500
MAX_STAGES = 500
MAX_POINTS = 600  # per cluster: 20 min of 2 s polls
MAX_CLUSTERS = 64  # plotted


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def unfit_for(r: PeerRecord, serving: Serving) -> str | None:
    """Why the peer cannot serve the job `serving` describes (None: it can), as planners judge it
    (`Serving.met_by`): it said so itself, or it does not list a plugin model or data set the job names."""
    if r.unfit_job == serving.job_id:
        return r.unfit_reason or "it says it cannot serve this job"
    missing = [f"plugin model {m}" for m in sorted(serving.plugin_models - set(r.plugin_models))]
    missing += [f"plugin data set {d}" for d in sorted(serving.plugin_datasets - set(r.plugin_datasets))]
    return "lacks " + ", ".join(missing) if missing else None


def peer_row(r: PeerRecord, now: float, serving: Serving | None = None) -> dict[str, Any]:
    """One peer as the page shows it: its measured figures, state, place, record age, the plugin models
    and data sets it serves, and (with the active job's `serving`) why it is unfit for that job."""
    return {
        "peer_id": r.peer_id,
        "state": str(r.state),
        "client": r.client_mode,
        "device": r.device,
        "version": r.software_version,
        "gflops": _round(r.flops / 1e9, 2),
        "mem_gb": _round(r.free_memory_bytes / 2**30, 2),
        "up_mbps": _round(r.upload_mbps, 1),
        "down_mbps": _round(r.download_mbps, 1),
        "rtt_ms": _round(r.rtt_ms, 1),
        "epoch": r.epoch,
        "cluster": r.cluster,
        "stage": r.stage,
        "age_s": _round(max(0.0, now - r.updated_at), 1),
        "plugin_models": list(r.plugin_models),
        "plugin_datasets": list(r.plugin_datasets),
        "unfit_job": r.unfit_job,
        "unfit_reason": r.unfit_reason,
        # None without an active job; "" when the peer can serve it
        "unfit": None if serving is None else (unfit_for(r, serving) or ""),
    }


def _clusters(records: Sequence[PeerRecord], epoch: int) -> list[dict[str, Any]]:
    """The plan of `epoch` as the peers' records place themselves: cluster -> stages -> peer."""
    by_cluster: dict[int, dict[int, str]] = {}
    for r in records:
        if r.epoch == epoch and r.cluster is not None and r.stage is not None:
            by_cluster.setdefault(r.cluster, {})[r.stage] = r.peer_id
    return [
        {"cluster": c, "stages": [{"stage": s, "peer_id": p} for s, p in sorted(by_cluster[c].items())]}
        for c in sorted(by_cluster)
    ]


def _stage_row(m: StageMetrics, now: float) -> dict[str, Any]:
    return {
        "cluster": m.cluster,
        "stage": m.stage,
        "peer_id": m.peer_id,
        "epoch": m.epoch,
        "step": m.step,
        "optimizer_steps": m.optimizer_steps,
        "loss": _round(m.loss, 4),
        "samples_per_s": _round(m.samples_per_s, 1),
        "eval_accuracy": _round(m.eval_accuracy, 4),
        "averaging_rounds": m.averaging_rounds,
        "last_round": m.last_round,
        "last_round_s": _round(m.last_round_s, 3),
        "last_round_participants": m.last_round_participants,
        "averaging_mb_sent": _round(m.averaging_bytes_sent / 1e6, 2),
        "done": m.done,
        "failed": m.failed,
        "age_s": _round(max(0.0, now - m.updated_at), 1),
    }


@dataclass
class History:
    """Per-cluster points of one job over the dashboard's polls (bounded), for the page's plots."""

    job_id: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    points: dict[int, deque[dict[str, Any]]] = field(default_factory=dict)

    def add(self, job_id: str, metrics: Sequence[StageMetrics], *, now: float | None = None) -> None:
        if job_id != self.job_id:  # a new job: start over
            self.job_id, self.points, self.started_at = job_id, {}, time.monotonic()
        t = round((time.monotonic() if now is None else now) - self.started_at, 1)
        for c in summarize(metrics, job_id).clusters:
            if c.cluster not in self.points and len(self.points) >= MAX_CLUSTERS:
                continue
            series = self.points.setdefault(c.cluster, deque(maxlen=MAX_POINTS))
            point = {
                "t": t,
                "step": c.step,
                "loss_step": c.loss_step,
                "loss": _round(c.loss, 4),
                "samples_per_s": _round(c.samples_per_s, 1),
                "averaging_rounds": c.averaging_rounds,
            }
            if not series or {**series[-1], "t": t} != point:  # keep points where something changed
                series.append(point)

    def as_json(self) -> dict[str, list[dict[str, Any]]]:
        return {str(c): list(points) for c, points in sorted(self.points.items())}


def _averaging(stages: Sequence[StageMetrics]) -> dict[str, Any]:
    """Averaging health: rounds done, the slowest last round and how many joined it."""
    rounds = [m.averaging_rounds for m in stages]
    times = [m.last_round_s for m in stages if m.last_round_s is not None]
    joined = [m.last_round_participants for m in stages if m.last_round_participants is not None]
    return {
        "min_rounds": min(rounds, default=0),
        "max_rounds": max(rounds, default=0),
        "slowest_round_s": _round(max(times, default=None), 3) if times else None,
        "min_participants": min(joined) if joined else None,
        "mb_sent": _round(sum(m.averaging_bytes_sent for m in stages) / 1e6, 2),
    }


def build_state(
    *,
    run_id: str,
    now: float,
    records: Sequence[PeerRecord],
    epoch: int,
    digests: Mapping[str, str],
    job: JobSpec | None,
    progress: ProgressView | None,
    metrics: Sequence[StageMetrics],
    history: History | None = None,
) -> dict[str, Any]:
    """The page's snapshot (JSON-ready) of the run at DHT time `now`."""
    top = Counter(digests.values()).most_common(1)
    stages = sorted(metrics, key=lambda m: (m.cluster, m.stage))[:MAX_STAGES]
    summary = summarize(stages, job.job_id if job else None)
    job_json: dict[str, Any] | None = None
    if job is not None:
        job_json = {
            "job_id": job.job_id,
            "model": job.model,
            "dataset": job.dataset,
            "mode": str(job.mode),
            "batch_size": job.batch_size,
            "max_steps": job.max_steps,
            "done": summary.done or bool(progress and progress.done),
            "ended": bool(progress and progress.ended),
            "reason": progress.reason if progress else None,
            "micro_batches": progress.micro_batches if progress else None,
            "optimizer_steps": progress.optimizer_steps if progress else None,
            "train_wall_s": _round(progress.train_wall_s, 1) if progress else None,
            "epoch": summary.epoch,
            "clusters": [
                {
                    "cluster": c.cluster,
                    "num_stages": c.num_stages,
                    "step": c.step,
                    "samples_per_s": _round(c.samples_per_s, 1),
                    "loss": _round(c.loss, 4),
                    "eval_accuracy": _round(c.eval_accuracy, 4),
                    "averaging_rounds": c.averaging_rounds,
                    "done": c.done,
                }
                for c in summary.clusters
            ],
        }
    shown = sorted(records, key=lambda r: r.peer_id)[:MAX_PEERS]
    serving = job_serving(job) if job is not None else None
    return {
        "run_id": run_id,
        "time": round(now, 3),
        "num_peers": len(records),
        "peers": [peer_row(r, now, serving) for r in shown],
        "plan": {
            "epoch": epoch,
            "digest": top[0][0][:16] if top else None,
            "agree": top[0][1] if top else 0,
            "published": len(digests),
            "clusters": _clusters(shown, epoch),
        },
        "job": job_json,
        "stages": [_stage_row(m, now) for m in stages],
        "averaging": _averaging(stages),
        "history": history.as_json() if history is not None and job is not None else {},
    }
