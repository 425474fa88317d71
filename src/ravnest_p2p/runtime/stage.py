"""One pipeline stage: forward, backward and optimizer steps with weight stashing. Pure compute.

Why weight stashing. In an asynchronous 1F1B pipeline (PipeDream, Narayanan et al., SOSP 2019) a
stage admits up to ``max_in_flight`` micro-batches before the first gradient comes back and steps
its optimizer as soon as it has gradients, with no pipeline flush. Without care, a micro-batch's
backward pass would then use weights different from those its forward pass used, so its gradient is
not the gradient of any function at all. PipeDream's fix: keep the weight version each forward used
and compute that micro-batch's backward against it. Updates are then "delayed" gradient steps,
``w(t+1) = w(t) - lr * grad f(w(t - k))``, which is what the paper analyses. We do not implement
PipeDream's "vertical sync" (all stages using the same version for a micro-batch): each stage is
consistent with itself, as in the paper's default.

How. Forward runs the layers through ``torch.func.functional_call`` on a *stash* copy of the
trainable parameters (leaf tensors of their own), never on the live ``nn.Parameter``s, so the
optimizer can step the live parameters in place while older micro-batches still hold graphs (or, in
recompute mode, only their inputs) built on the stash. Stash entries are keyed by weight version,
refcounted by in-flight micro-batches, and freed when no micro-batch needs them and the live
weights have moved on. Gradients come from ``torch.autograd.grad`` (nothing accumulates into the
stash), are added into the live parameters' ``.grad`` and averaged over ``update_every`` backwards. The
stash, the steps and the parameters' state are the `StageWeights` half (`runtime.stage_weights`).

Alternatives rejected: swapping ``param.data`` before each backward (autograd saved tensors alias
the live storage, so in-place steps corrupt pending graphs); deep-copying the whole module per
version (copies buffers too, and BatchNorm statistics must stay single and live).

Recompute mode (activation checkpointing at stage granularity, Chen et al. 2016) keeps only the
input and the RNG state, and replays forward in backward against the same stash; BatchNorm running
statistics are updated once (in the first forward), the replay writes into throwaway copies.

Poison. A loss or gradient that comes out NaN/inf (finite inputs can still overflow) raises
`NonFiniteResult` *before* any gradient is accumulated or any step taken; the caller drops the
micro-batch (`release`). Checking costs one pass over each gradient, on the compute thread.

Limits: one stage is driven by one thread (the compute thread); the executor is not thread-safe.
BatchNorm statistics are not versioned. The stash costs one parameter copy per live version.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models.spec import TensorSpec, make_loss
from ravnest_p2p.runtime.config import LossResult, NonFiniteResult, PipelineFull, StageConfig
from ravnest_p2p.runtime.optim import build_optimizer
from ravnest_p2p.runtime.stage_weights import StageWeights, _InFlight, _Stash
from ravnest_p2p.runtime.validation import check_matches, check_micro_batch_id, check_tensor

__all__ = ["LossResult", "NonFiniteResult", "PipelineFull", "StageConfig", "StageExecutor"]

logger = logging.getLogger(__name__)


class StageExecutor(StageWeights):
    """Forward/backward/step of one pipeline stage with weight stashing (see module docstring).

    Args:
        config: stage config.
        layers: the stage's contiguous slice of the model's cuttable layers.
        input_spec: what the stage accepts (model input for stage 0, previous layer's output else).
        label_spec: what the last stage accepts as labels (required iff ``config.is_last``).
        device: where the layers live; inputs are moved there after validation.
    """

    def __init__(
        self,
        config: StageConfig,
        layers: Sequence[nn.Module],
        *,
        input_spec: TensorSpec,
        label_spec: TensorSpec | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not layers:
            raise ValueError("a stage needs at least one layer")
        if config.is_last and label_spec is None:
            raise ValueError("the last stage needs a label_spec")
        self.config = config
        self.input_spec = input_spec
        self.label_spec = label_spec
        self.device = torch.device(device)
        self.module = nn.Sequential(*layers).to(self.device).train()
        self._loss_fn = make_loss(config.loss)
        self._trainable: dict[str, nn.Parameter] = {
            n: p for n, p in self.module.named_parameters() if p.requires_grad
        }
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if self._trainable:
            self._optimizer, self._scheduler = build_optimizer(self._trainable.values(), config.optimizer)
        self._weight_version = 0
        self._num_steps = 0
        self._num_accumulated = 0
        self._stash: dict[int, _Stash] = {}
        self._in_flight: dict[int, _InFlight] = {}
        self._last_param_grads: dict[str, Tensor] = {}

    # ----- introspection -------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        """Whether this stage holds the model's first layer (it returns no input gradient)."""
        return self.config.first_layer_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the loss."""
        return self.config.is_last

    @property
    def weight_version(self) -> int:
        """Version of the live weights: +1 per optimizer step or external parameter change."""
        return self._weight_version

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken."""
        return self._num_steps

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Ids of micro-batches forwarded and waiting for their backward, sorted."""
        return tuple(sorted(self._in_flight))

    @property
    def stashed_versions(self) -> tuple[int, ...]:
        """Weight versions currently held in the stash, sorted."""
        return tuple(sorted(self._stash))

    @property
    def last_param_grads(self) -> dict[str, Tensor]:
        """Per-parameter gradient (global names) of the most recent backward, before averaging."""
        return dict(self._last_param_grads)

    def global_name(self, local_name: str) -> str:
        """Map ``"1.weight"`` in this stage to ``"<first_layer_index + 1>.weight"``."""
        index, _, rest = local_name.partition(".")
        return f"{int(index) + self.config.first_layer_index}.{rest}"

    def parameters_by_name(self) -> dict[str, nn.Parameter]:
        """The live parameters keyed by global name (layer index in the whole model + attribute path).

        Change them only through `assign_parameters` or in place under ``torch.no_grad()`` (e.g.
        ``p.copy_(avg)``, never ``p.data.copy_``) so the executor sees a new weight version.
        """
        return {self.global_name(n): p for n, p in self.module.named_parameters()}

    def buffers_by_name(self) -> dict[str, Tensor]:
        """The live buffers (e.g. BatchNorm statistics) keyed by global name."""
        return {self.global_name(n): b for n, b in self.module.named_buffers()}

    def trainable_by_name(self) -> dict[str, nn.Parameter]:
        """The parameters the optimizer steps, keyed by global name."""
        return {self.global_name(n): p for n, p in self._trainable.items()}

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The stage's optimizer (None without trainable parameters); for state capture and restore."""
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The stage's LR scheduler (None without trainable parameters)."""
        return self._scheduler

    def set_num_steps(self, num_steps: int) -> None:
        """Set the optimizer step count after a state restore; drops pending gradients; a new version.

        Raises:
            RuntimeError: micro-batches are in flight.
        """
        if self._in_flight:
            raise RuntimeError(f"cannot restore state with micro-batches in flight: {self.in_flight}")
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        self._num_accumulated = 0
        self._num_steps = int(num_steps)
        self._new_version()
        self._stash.clear()

    # ----- the pipeline --------------------------------------------------------------------------
    def forward(self, micro_batch_id: int, inputs: Tensor) -> Tensor:
        """Run the stage forward for a micro-batch and keep what its backward needs.

        Returns:
            The stage output, detached (to send to the next stage).

        Raises:
            InvalidMessage: last stage, duplicate id, bad input; `PipelineFull` at ``max_in_flight``.
        """
        mb = check_micro_batch_id(micro_batch_id)
        if self.is_last:
            raise InvalidMessage("the last stage takes forward_loss, not forward")
        if mb in self._in_flight:
            raise InvalidMessage(f"micro-batch {mb} is already in flight")
        if len(self._in_flight) >= self.config.max_in_flight:
            raise PipelineFull(f"{len(self._in_flight)} micro-batches in flight (max_in_flight reached)")
        x = check_tensor(inputs, self.input_spec, f"input of micro-batch {mb}").to(self.device)
        version, stash = self._current_stash()
        x_in = self._leaf_input(x)
        if self.config.recompute:
            rng_state = torch.get_rng_state()
            with torch.no_grad():
                output = self._call(stash.params, x_in)
            record = _InFlight(version, x_in, None, output.shape, output.dtype, rng_state)
        else:
            with torch.enable_grad():
                output = self._call(stash.params, x_in)
            record = _InFlight(version, x_in, output, output.shape, output.dtype, None)
        stash.refcount += 1
        self._in_flight[mb] = record
        logger.debug("forward mb=%d version=%d in_flight=%d", mb, version, len(self._in_flight))
        return output.detach()

    def backward(self, micro_batch_id: int, grad_output: Tensor) -> Tensor | None:
        """Backward of an in-flight micro-batch against the weights its forward used.

        Returns:
            Gradient w.r.t. the stage input, or None for the first stage.

        Raises:
            InvalidMessage: unknown id or a gradient not matching the forward's output.
        """
        mb = check_micro_batch_id(micro_batch_id)
        record = self._in_flight.get(mb)
        if record is None:
            raise InvalidMessage(f"micro-batch {mb} is not in flight at this stage")
        grad = check_matches(
            grad_output, record.output_shape, record.output_dtype, f"gradient of micro-batch {mb}"
        ).to(self.device)
        stash = self._stash[record.version]
        output = record.output if record.output is not None else self._recompute(record, stash)
        try:
            grad_input = self._backprop(output, grad, record.inputs, stash)
        except NonFiniteResult:
            self.release(mb)  # dropped: nothing was accumulated
            raise
        del self._in_flight[mb]
        stash.refcount -= 1
        self._after_backward()
        logger.debug("backward mb=%d version=%d", mb, record.version)
        return grad_input

    def forward_loss(self, micro_batch_id: int, inputs: Tensor, labels: Tensor) -> LossResult:
        """Last stage: forward, loss and backward at once.

        Returns:
            The micro-batch's mean loss and the gradient w.r.t. the stage input (None if first).

        Raises:
            InvalidMessage: not the last stage, id in flight, bad input or labels.
        """
        mb = check_micro_batch_id(micro_batch_id)
        if not self.is_last:
            raise InvalidMessage("forward_loss is only valid on the last stage")
        if mb in self._in_flight:
            raise InvalidMessage(f"micro-batch {mb} is already in flight")
        x = check_tensor(inputs, self.input_spec, f"input of micro-batch {mb}").to(self.device)
        assert self.label_spec is not None
        y = check_tensor(labels, self.label_spec, f"labels of micro-batch {mb}", batch_size=x.shape[0])
        _, stash = self._current_stash()
        x_in = self._leaf_input(x)
        with torch.enable_grad():
            loss = self._loss_fn(self._call(stash.params, x_in), y.to(self.device))
        loss_value = float(loss.detach())  # the scalar is read once, for the check and the result
        if not math.isfinite(loss_value):
            raise NonFiniteResult(f"loss of micro-batch {mb} is not finite")
        grad_input = self._backprop(loss, None, x_in, stash)
        self._after_backward()
        return LossResult(loss=loss_value, grad_input=grad_input)

    def validate_forward(
        self,
        micro_batch_id: int,
        inputs: Tensor,
        labels: Tensor | None = None,
        *,
        max_abs: float | None = None,
    ) -> None:
        """Check a forward (or, on the last stage, forward_loss) message without changing any state.

        Lets a network handler refuse a bad message in its reply instead of failing later on the
        compute thread. Raises `InvalidMessage` whenever `forward`/`forward_loss` would, and also for
        float values beyond ``max_abs`` (the handler's magnitude bound).
        """
        mb = check_micro_batch_id(micro_batch_id)
        if mb in self._in_flight:
            raise InvalidMessage(f"micro-batch {mb} is already in flight")
        x = check_tensor(inputs, self.input_spec, f"input of micro-batch {mb}", max_abs=max_abs)
        if self.is_last:
            assert self.label_spec is not None
            check_tensor(
                labels, self.label_spec, f"labels of micro-batch {mb}", batch_size=x.shape[0], max_abs=max_abs
            )

    def validate_backward(
        self, micro_batch_id: int, grad_output: Tensor, *, max_abs: float | None = None
    ) -> None:
        """Check a backward message without changing any state (see `validate_forward`)."""
        mb = check_micro_batch_id(micro_batch_id)
        record = self._in_flight.get(mb)
        if record is None:
            raise InvalidMessage(f"micro-batch {mb} is not in flight at this stage")
        check_matches(
            grad_output,
            record.output_shape,
            record.output_dtype,
            f"gradient of micro-batch {mb}",
            max_abs=max_abs,
        )

    def release(self, micro_batch_id: int) -> bool:
        """Forget an in-flight micro-batch without a backward (it was dropped); frees its stash share.

        Returns:
            Whether it was in flight.
        """
        record = self._in_flight.pop(micro_batch_id, None)
        if record is None:
            return False
        stash = self._stash.get(record.version)
        if stash is not None:
            stash.refcount -= 1
            if stash.refcount <= 0 and record.version != self._weight_version:
                del self._stash[record.version]
        logger.debug("released mb=%d version=%d", micro_batch_id, record.version)
        return True

    def release_all(self) -> int:
        """Release every in-flight micro-batch (the pipeline failed); returns how many there were."""
        ids = list(self._in_flight)
        for mb in ids:
            self.release(mb)
        return len(ids)

    def predict(self, inputs: Tensor) -> Tensor:
        """Evaluation forward with the live weights (eval mode, no grad, no state kept)."""
        x = check_tensor(inputs, self.input_spec, "input").to(self.device)
        self.module.eval()
        try:
            with torch.no_grad():
                return self.module(x)
        finally:
            self.module.train()
