"""A sync_backup worker's compute: its parameters as shard pieces, and what it pushes for one step.

Split from `training.sync_runner` (the worker's protocol loop) so that each file stays one concern.

- Pieces (`piece_views`): the layout's shard entries are parameter tensors or row ranges of the large
  ones (`strategies.sync_layout.row_pieces`); a piece here is a view of the parameter's storage, so
  installing an owner's reply writes the model in place and a push slices the gradient without a copy of
  the whole tensor.
- One step's push (`step_push`). With ``sync_backup.local_steps`` K = 1 it is the gradient of the
  worker's batch of step t (synchronous SGD). With K > 1 it is local SGD: the worker takes K plain SGD
  steps from θ_t on its batches of data steps t·K .. t·K + K - 1 (the slots IST uses for round t) at the
  job's LR, then pushes the pseudo-gradient (θ_t - θ_local) / lr and restores θ_t. The owners apply the
  job's optimizer to the mean of the N pseudo-gradients: with plain SGD at that LR (no momentum, no
  weight decay, constant schedule) θ_{t+1} = mean of the N local models, i.e. model averaging every K
  steps; with another optimizer it is an outer step on averaged pseudo-gradients (as in DiLoCo).
  BatchNorm running statistics stay per worker, as in synchronous mode.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ravnest_p2p.models import LossFn
from ravnest_p2p.runtime.optim import OptimizerConfig, lr_factor
from ravnest_p2p.strategies.sync_layout import row_pieces
from ravnest_p2p.training.sync_shard import SyncBatches

__all__ = ["piece_views", "step_push"]

_PIECE = re.compile(r"(.+)\[(\d+):(\d+)\]")


def piece_views(params: Mapping[str, nn.Parameter], num_shards: int) -> dict[str, Tensor]:
    """Piece name -> a view of its rows of the parameter (model order; see `row_pieces`)."""
    shapes = {
        name: (p.numel() * p.element_size(), p.shape[0] if p.dim() > 0 else 1) for name, p in params.items()
    }
    views = {}
    for piece in row_pieces(shapes, num_shards):
        whole = params[piece.tensor].detach()
        views[piece.name] = whole if piece.name == piece.tensor else whole[piece.start : piece.end]
    return views


def _gradient_of(pieces: Mapping[str, Tensor], params: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
    grads = {}
    for name, view in pieces.items():
        if name in params:
            tensor, rows = name, None
        else:  # a row range, named by `row_pieces`
            match = _PIECE.fullmatch(name)
            assert match is not None, name
            tensor, rows = match[1], slice(int(match[2]), int(match[3]))
        grad = params[tensor].grad
        if grad is None:
            grads[name] = torch.zeros_like(view)
        else:
            grads[name] = (grad.detach() if rows is None else grad.detach()[rows]).clone()
    return grads


def step_push(
    model: nn.Module,
    params: Mapping[str, nn.Parameter],
    pieces: Mapping[str, Tensor],
    *,
    batches: SyncBatches,
    loss_fn: LossFn,
    worker: int,
    step: int,
    local_steps: int,
    num_data_steps: int,
    optimizer: OptimizerConfig,
) -> tuple[float, dict[str, Tensor]]:
    """(mean loss, piece name -> tensor to push) for sync step `step` (see module docstring)."""
    model.train()
    if local_steps == 1:
        inputs, labels = batches.batch(step, worker)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        return float(loss.detach()), _gradient_of(pieces, params)
    start = {name: view.clone() for name, view in pieces.items()}
    losses = []
    for data_step in range(step * local_steps, min(num_data_steps, (step + 1) * local_steps)):
        inputs, labels = batches.batch(data_step, worker)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        losses.append(float(loss.detach()))
        lr = optimizer.lr * lr_factor(data_step, optimizer)
        with torch.no_grad():
            for param in params.values():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-lr)
    pushed = {}
    with torch.no_grad():
        for name, view in pieces.items():
            pushed[name] = (start[name] - view) / optimizer.lr
            view.copy_(start[name])
    return sum(losses) / max(1, len(losses)), pushed
