"""Wire messages of the pipeline: activations forward, gradients backward, evaluation results, finish.

Every message names the plan epoch and the micro-batch; receivers refuse a wrong epoch, an unexpected
sender, an unknown micro-batch, a wrong shape/dtype or non-finite values before anything touches state.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from ravnest_p2p.transport.rpc import RpcMethod

__all__ = [
    "BACKWARD",
    "DROP",
    "EVAL_RESULT",
    "FINISH",
    "FORWARD",
    "PING",
    "READY",
    "Ack",
    "BackwardRequest",
    "DropNotice",
    "EvalResult",
    "FinishRequest",
    "ForwardRequest",
    "Mode",
    "PingReply",
    "PingRequest",
    "ReadyReply",
    "ReadyRequest",
]

# Activations of one micro-batch; beyond this a sender must use smaller micro-batches.
MAX_ACTIVATION_BYTES = 256 * 2**20
_ID = Field(ge=0, le=2**62)


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


class Mode(StrEnum):
    TRAIN = "train"
    EVAL = "eval"


class ForwardRequest(_Msg):
    """Tensors: [activations, labels]."""

    epoch: int = _ID
    micro_batch_id: int = _ID
    mode: Mode = Mode.TRAIN
    weight_version: int = _ID


class BackwardRequest(_Msg):
    """Tensors: [gradient w.r.t. the receiver's output]. `loss` travels back to the first stage."""

    epoch: int = _ID
    micro_batch_id: int = _ID
    loss: float | None = None


class EvalResult(_Msg):
    """From the last stage to the first: summed loss and correct predictions of an eval micro-batch."""

    epoch: int = _ID
    micro_batch_id: int = _ID
    loss_sum: float = Field(ge=0)
    num_correct: int = Field(ge=0)
    num_samples: int = Field(ge=1, description="batch size (weights the loss)")
    num_targets: int = Field(ge=1, description="labels predicted (e.g. tokens; weights accuracy)")


class FinishRequest(_Msg):
    epoch: int = _ID


class Ack(_Msg):
    queued: int = Field(default=0, ge=0)


FORWARD = RpcMethod(
    "forward",
    ForwardRequest,
    Ack,
    max_request_bytes=MAX_ACTIVATION_BYTES,
    max_tensors=2,
    handler_timeout_s=120,
)
BACKWARD = RpcMethod(
    "backward",
    BackwardRequest,
    Ack,
    max_request_bytes=MAX_ACTIVATION_BYTES,
    max_tensors=1,
    handler_timeout_s=120,
)
EVAL_RESULT = RpcMethod("eval_result", EvalResult, Ack, max_request_bytes=4096, max_tensors=0)
FINISH = RpcMethod("finish", FinishRequest, Ack, max_request_bytes=4096, max_tensors=0)


class ReadyRequest(_Msg):
    epoch: int = _ID


class ReadyReply(_Msg):
    """`next_micro_batch_id`: the lowest micro-batch id this stage takes as new (above every id it took).

    A first stage that starts again on a plan where the rest of its cluster moved in place (e.g. it had
    run out of data as the plan changed) numbers its micro-batches from the highest of these: the
    others still hold the ids they took before, and refuse a repeat of one as a replay.
    """

    stage: int = Field(ge=0)
    next_micro_batch_id: int = Field(default=0, ge=0, le=2**61)


# the first stage asks every other stage this before admitting micro-batches: peers pick up a job on
# their own schedule, and a forward sent before the next stage serves it would be lost
READY = RpcMethod("stage_ready", ReadyRequest, ReadyReply, max_request_bytes=4096, max_tensors=0)


class DropNotice(_Msg):
    """Back along the pipeline: micro-batch `micro_batch_id` was dropped downstream (refused or poisoned).

    Each stage that holds it releases it and passes the notice on; the first stage re-issues or skips it.
    """

    epoch: int = _ID
    micro_batch_id: int = _ID
    reason: Annotated[str, StringConstraints(max_length=200)] = ""


DROP = RpcMethod("stage_drop", DropNotice, Ack, max_request_bytes=4096, max_tensors=0)


class PingRequest(_Msg):
    epoch: int = _ID


class PingReply(_Msg):
    """A neighbour's heartbeat answer: alive, and whether its stage gave up (naming its suspect)."""

    stage: int = Field(ge=0)
    lost_peer_id: Annotated[str, StringConstraints(max_length=128)] | None = None


# every stage answers this while it serves an epoch; neighbours call it to tell dead from slow
PING = RpcMethod(
    "stage_ping", PingRequest, PingReply, max_request_bytes=4096, max_tensors=0, handler_timeout_s=5.0
)
