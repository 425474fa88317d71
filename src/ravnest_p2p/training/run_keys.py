"""The run's DHT key registry with every schema the training layer knows, for the composition roots.

`discovery` checks sizes, expiries and signatures of the run's fixed key names but cannot import the
models defined above it; this fills them in. `node.py`, `RunClient` and the status tool build their DHT
with `run_keys()`. A helper adding a run key's model registers its schema here.
"""

from __future__ import annotations

from typing import Any

from ravnest_p2p.discovery import KeyRegistry, discovery_keys
from ravnest_p2p.membership import PLAN_KEY, SUSPECTS_KEY, SuspectReport, parse_plan
from ravnest_p2p.membership.suspects import parse_report
from ravnest_p2p.training.checkpoint_announce import CHECKPOINTS_KEY, parse_announcement
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.metrics import METRICS_KEY, parse_metrics
from ravnest_p2p.training.progress import PROGRESS_KEY, parse_progress

__all__ = ["run_keys"]


def _parse_job(value: Any, signer_peer_id: str) -> JobSpec:
    return JobSpec.model_validate(value)


def _parse_suspects(value: Any, signer_peer_id: str) -> SuspectReport:
    report = parse_report(value)
    if report is None:
        raise ValueError("not a suspect report of this schema version")
    return report


def run_keys() -> KeyRegistry:
    """The default registry with the schemas of every run key set (``peers``, ``owners``: discovery's own)."""
    return (
        discovery_keys()
        .with_schema("job", _parse_job)
        .with_schema(METRICS_KEY, parse_metrics)
        .with_schema(PLAN_KEY, parse_plan)
        .with_schema(PROGRESS_KEY, parse_progress)
        .with_schema(CHECKPOINTS_KEY, parse_announcement)
        .with_schema(SUSPECTS_KEY, _parse_suspects)
    )
