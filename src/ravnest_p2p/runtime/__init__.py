"""Pipeline runtime: the per-stage executor (weight stashing), its optimizer, pipeline schedules, and the
network stage service (`runtime.service`, messages in `runtime.messages`, config in `runtime.pipeline`;
its receiving half in `runtime.receiving`, the first stage's driving in `runtime.driving`, sends in
`runtime.sender`, heartbeats in `runtime.liveness`, the id window in `runtime.admission`).

The executor is pure compute (no asyncio, no networking); the service runs it on the compute thread
and speaks the forward/backward RPCs.
"""

from ravnest_p2p.runtime.config import LossResult, NonFiniteResult, PipelineFull, StageConfig
from ravnest_p2p.runtime.optim import OptimizerConfig, build_optimizer, lr_factor
from ravnest_p2p.runtime.schedule import (
    Op,
    SimulationResult,
    gpipe_schedule,
    one_f_one_b_schedule,
    simulate_schedule,
)
from ravnest_p2p.runtime.stage import StageExecutor

__all__ = [
    "LossResult",
    "NonFiniteResult",
    "Op",
    "OptimizerConfig",
    "PipelineFull",
    "SimulationResult",
    "StageConfig",
    "StageExecutor",
    "build_optimizer",
    "gpipe_schedule",
    "lr_factor",
    "one_f_one_b_schedule",
    "simulate_schedule",
]
