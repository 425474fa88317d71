"""ravnest_p2p: train large models on volunteer computers over hivemind's P2P transport.

The public API, for researchers (notebooks, scripts) and volunteers who embed a peer::

    from ravnest_p2p import RunClient, JobSpec, OptimizerConfig, LocalSwarm

Names are loaded on first use: ``import ravnest_p2p`` stays cheap (no torch, no hivemind), submodules
never import a half-initialised package, and ``python -m ravnest_p2p.peer`` does not find its own
module imported twice. ``tests/unit/foundation/test_public_api.py`` pins this list.
"""

# private aliases: the package's namespace holds the public API only (the test checks `dir`)
import importlib as _importlib
import typing as _typing

from ravnest_p2p._version import __version__

if _typing.TYPE_CHECKING:
    from ravnest_p2p.client import RunClient
    from ravnest_p2p.client_watch import JobHistory, ProgressSnapshot, ProgressSummary, summarize
    from ravnest_p2p.discovery import PeerRecord
    from ravnest_p2p.errors import RavnestError
    from ravnest_p2p.lab import SwarmProfile, load_profile
    from ravnest_p2p.models import available_models
    from ravnest_p2p.node import Peer, PeerConfig
    from ravnest_p2p.runtime.optim import OptimizerConfig
    from ravnest_p2p.status import format_table
    from ravnest_p2p.swarm import LocalSwarm, Swarm
    from ravnest_p2p.training.job import InitCheckpoint, JobSpec, StagePlacement
    from ravnest_p2p.training.metrics import StageMetrics
    from ravnest_p2p.training.model_checkpoint import evaluate_model, load_model
    from ravnest_p2p.training.progress import ProgressView
    from ravnest_p2p.transport import load_or_create_identity

__all__ = [
    "InitCheckpoint",
    "JobHistory",
    "JobSpec",
    "LocalSwarm",
    "OptimizerConfig",
    "Peer",
    "PeerConfig",
    "PeerRecord",
    "ProgressSnapshot",
    "ProgressSummary",
    "ProgressView",
    "RavnestError",
    "RunClient",
    "StageMetrics",
    "StagePlacement",
    "Swarm",
    "SwarmProfile",
    "__version__",
    "available_models",
    "evaluate_model",
    "format_table",
    "load_model",
    "load_or_create_identity",
    "load_profile",
    "summarize",
]

_MODULE_OF = {
    "InitCheckpoint": "training.job",
    "JobHistory": "client_watch",
    "JobSpec": "training.job",
    "LocalSwarm": "swarm",
    "OptimizerConfig": "runtime.optim",
    "Peer": "node",
    "PeerConfig": "node",
    "PeerRecord": "discovery",
    "ProgressSnapshot": "client_watch",
    "ProgressSummary": "client_watch",
    "ProgressView": "training.progress",
    "RavnestError": "errors",
    "RunClient": "client",
    "StageMetrics": "training.metrics",
    "StagePlacement": "training.job",
    "Swarm": "swarm",
    "SwarmProfile": "lab",
    "available_models": "models",
    "evaluate_model": "training.model_checkpoint",
    "format_table": "status",
    "load_model": "training.model_checkpoint",
    "load_or_create_identity": "transport",
    "load_profile": "lab",
    "summarize": "client_watch",
}


def __getattr__(name: str) -> _typing.Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
