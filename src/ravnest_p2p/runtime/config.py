"""Configuration and result types of a pipeline stage (see `ravnest_p2p.runtime.stage`)."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models.spec import LossName
from ravnest_p2p.runtime.optim import OptimizerConfig

__all__ = ["LossResult", "NonFiniteResult", "PipelineFull", "StageConfig"]


class PipelineFull(InvalidMessage):
    """A forward arrived while ``max_in_flight`` micro-batches were already waiting for backward."""

    code = "pipeline_full"


class NonFiniteResult(InvalidMessage):
    """A loss or gradient computed from a neighbour's input is NaN/inf: the micro-batch is dropped.

    Raised before anything is accumulated or stepped, so the weights never see it.
    """

    code = "non_finite"


class StageConfig(BaseModel):
    """How one stage runs.

    Attributes:
        first_layer_index: global index of the stage's first layer (0 = first stage); prefixes names.
        is_last: the stage computes the loss (`StageExecutor.forward_loss`).
        max_in_flight: micro-batches forwarded but not yet backwarded that the stage admits.
        update_every: optimizer step after this many backwards (gradients averaged).
        recompute: keep only inputs and recompute the forward in backward.
        loss: loss of the last stage.
        optimizer: optimizer and LR schedule.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    first_layer_index: int = Field(default=0, ge=0)
    is_last: bool = False
    max_in_flight: int = Field(default=1, ge=1)
    update_every: int = Field(default=1, ge=1)
    recompute: bool = False
    loss: LossName = "cross_entropy"
    optimizer: OptimizerConfig = OptimizerConfig()


@dataclasses.dataclass(frozen=True)
class LossResult:
    """What the last stage returns for a micro-batch: its loss and the gradient for the stage before."""

    loss: float
    grad_input: Tensor | None
