"""A stage's weights and their versions (a mixin; `runtime.stage` runs the pipeline and owns the state).

What creates or consumes a weight version: the stash (`_Stash`: a leaf copy of the trainable
parameters per live version, refcounted by the in-flight micro-batches, `_InFlight`), the functional
forward and the recompute replay against a stash, the backward that adds a micro-batch's gradients into
the live parameters, the optimizer step every ``update_every`` backwards, and overwriting, saving and
restoring the parameters (`assign_parameters`, `state_dict`, `load_state_dict`).

Why separate: `stage.py` reads as the pipeline's surface (forward, backward, validation, release);
the weight-stashing machinery it describes in its docstring is this mixin, so each module stays small.
`StageExecutor` declares and owns every attribute listed here.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ravnest_p2p.runtime.config import NonFiniteResult, StageConfig
from ravnest_p2p.transport.codec_values import all_finite

__all__ = ["StageWeights"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stash:
    params: dict[str, Tensor]  # local name -> leaf copy requiring grad
    live_versions: tuple[int, ...]  # autograd version counters of the live params when copied
    refcount: int = 0


@dataclasses.dataclass
class _InFlight:
    version: int
    inputs: Tensor
    output: Tensor | None  # graph output (stored mode) or None (recompute mode)
    output_shape: torch.Size
    output_dtype: torch.dtype
    rng_state: Tensor | None


class StageWeights:
    """The weights half of `StageExecutor` (which owns the state declared here)."""

    config: StageConfig
    module: nn.Sequential
    _trainable: dict[str, nn.Parameter]
    _optimizer: torch.optim.Optimizer | None
    _scheduler: torch.optim.lr_scheduler.LRScheduler | None
    _weight_version: int
    _num_steps: int
    _num_accumulated: int
    _stash: dict[int, _Stash]
    _in_flight: dict[int, _InFlight]
    _last_param_grads: dict[str, Tensor]

    @property
    def is_first(self) -> bool:
        raise NotImplementedError

    @property
    def in_flight(self) -> tuple[int, ...]:
        raise NotImplementedError

    def global_name(self, local_name: str) -> str:
        raise NotImplementedError

    def parameters_by_name(self) -> dict[str, nn.Parameter]:
        raise NotImplementedError

    def buffers_by_name(self) -> dict[str, Tensor]:
        raise NotImplementedError

    # ----- parameters and checkpoints ------------------------------------------------------------
    def assign_parameters(self, named: Mapping[str, Tensor]) -> None:
        """Overwrite live parameters/buffers by global name (e.g. with an average); a new version.

        Raises:
            ValueError: unknown name or shape mismatch (nothing is changed then).
        """
        targets = {**self.parameters_by_name(), **self.buffers_by_name()}
        for name, value in named.items():
            if name not in targets:
                raise ValueError(f"unknown parameter {name!r} for this stage")
            if tuple(value.shape) != tuple(targets[name].shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(targets[name].shape)}")
        with torch.no_grad():
            for name, value in named.items():
                targets[name].copy_(value)
        self._new_version()

    def state_dict(self) -> dict[str, Any]:
        """Parameters, buffers (global names), optimizer and scheduler state, counters."""
        tensors = {
            n: t.detach().clone() for n, t in {**self.parameters_by_name(), **self.buffers_by_name()}.items()
        }
        return {
            "weight_version": self._weight_version,
            "num_steps": self._num_steps,
            "tensors": tensors,
            # deep copies: optimizer state tensors are updated in place by later steps
            "optimizer": copy.deepcopy(self._optimizer.state_dict()) if self._optimizer else None,
            "scheduler": copy.deepcopy(self._scheduler.state_dict()) if self._scheduler else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` of a stage with the same layers; drops pending gradients.

        Raises:
            RuntimeError: micro-batches are in flight.
            ValueError: names or shapes do not match this stage.
        """
        if self._in_flight:
            raise RuntimeError(f"cannot load state with micro-batches in flight: {self.in_flight}")
        tensors = state["tensors"]
        expected = {**self.parameters_by_name(), **self.buffers_by_name()}
        if set(tensors) != set(expected):
            raise ValueError(f"state names differ from this stage: {sorted(set(tensors) ^ set(expected))}")
        self.assign_parameters(tensors)
        if self._optimizer is not None and self._scheduler is not None:
            self._optimizer.load_state_dict(state["optimizer"])
            self._scheduler.load_state_dict(state["scheduler"])
            self._optimizer.zero_grad(set_to_none=True)
        self._num_accumulated = 0
        self._num_steps = int(state["num_steps"])
        self._weight_version = int(state["weight_version"])
        self._stash.clear()

    # ----- internals -----------------------------------------------------------------------------
    def _call(self, params: dict[str, Tensor], x: Tensor, buffers: dict[str, Tensor] | None = None) -> Tensor:
        out: Tensor = functional_call(self.module, {**params, **(buffers or {})}, (x,))
        return out

    def _leaf_input(self, x: Tensor) -> Tensor:
        needs_grad = not self.is_first and x.is_floating_point()
        return x.detach().requires_grad_(needs_grad)

    def _live_versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._trainable.values())

    def _current_stash(self) -> tuple[int, _Stash]:
        live_versions = self._live_versions()
        stash = self._stash.get(self._weight_version)
        if stash is not None and stash.live_versions != live_versions:
            logger.debug("live parameters changed outside the executor; new weight version")
            self._new_version()
            stash = None
        if stash is None:
            params = {n: p.detach().clone().requires_grad_(True) for n, p in self._trainable.items()}
            stash = _Stash(params, live_versions)
            self._stash[self._weight_version] = stash
        return self._weight_version, stash

    def _recompute(self, record: _InFlight, stash: _Stash) -> Tensor:
        throwaway_buffers = {n: b.clone() for n, b in self.module.named_buffers()}
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            assert record.rng_state is not None
            torch.set_rng_state(record.rng_state)
            return self._call(stash.params, record.inputs, throwaway_buffers)

    def _backprop(self, output: Tensor, grad: Tensor | None, x_in: Tensor, stash: _Stash) -> Tensor | None:
        # the previous micro-batch's gradients go first: with them alive, a backward would hold two
        # gradient copies at once (`planning.memory` budgets one)
        self._last_param_grads = {}
        names = list(stash.params)
        wrt = [stash.params[n] for n in names] + ([x_in] if x_in.requires_grad else [])
        if not wrt:  # nothing trainable and no input gradient wanted (e.g. a lone pooling layer)
            self._last_param_grads = {}
            return None
        grads = torch.autograd.grad(output, wrt, grad_outputs=grad, allow_unused=True)
        if not all(g is None or all_finite(g, remember=False) for g in grads):
            raise NonFiniteResult("a gradient computed from this micro-batch is not finite")
        param_grads = {
            n: g if g is not None else torch.zeros_like(stash.params[n])
            for n, g in zip(names, grads[: len(names)], strict=True)
        }
        self._last_param_grads = {self.global_name(n): g for n, g in param_grads.items()}
        for n, g in param_grads.items():
            p = self._trainable[n]
            if p.grad is None:
                # no copy: the kept `last_param_grads` and `.grad` share it until the next backward,
                # which replaces the former before adding into the latter; nothing steps it in place
                p.grad = g
            else:
                p.grad.add_(g)
        return grads[-1] if x_in.requires_grad else None

    def _after_backward(self) -> None:
        self._num_accumulated += 1
        if self._num_accumulated < self.config.update_every:
            return
        if self._optimizer is not None and self._scheduler is not None:
            if self.config.update_every > 1:
                for p in self._trainable.values():
                    if p.grad is not None:
                        p.grad.div_(self.config.update_every)
            self._optimizer.step()
            self._scheduler.step()
            self._optimizer.zero_grad(set_to_none=True)
        self._num_accumulated = 0
        self._num_steps += 1
        self._new_version()

    def _new_version(self) -> None:
        self._weight_version += 1
        for version in [v for v, s in self._stash.items() if s.refcount == 0]:
            del self._stash[version]
