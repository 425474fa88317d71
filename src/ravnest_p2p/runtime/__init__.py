"""Pipeline runtime: the per-stage executor (weight stashing), its optimizer, and pipeline schedules."""

from ravnest_p2p.runtime.optim import OptimizerConfig, build_optimizer, lr_factor
from ravnest_p2p.runtime.stage import LossResult, PipelineFull, StageConfig, StageExecutor

__all__ = [
    "LossResult",
    "OptimizerConfig",
    "PipelineFull",
    "StageConfig",
    "StageExecutor",
    "build_optimizer",
    "lr_factor",
]
