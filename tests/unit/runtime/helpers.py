"""Build chains of stage executors from a registered model, for the runtime tests."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ravnest_p2p.models import get_model_spec, parse_config, sample_input, trace_output_specs
from ravnest_p2p.runtime import OptimizerConfig, StageConfig, StageExecutor, one_f_one_b_schedule


def make_stages(
    key: str,
    config: dict[str, Any],
    layers: Sequence[nn.Module],
    cuts: Sequence[int],
    optimizer: OptimizerConfig,
    **stage_kwargs: Any,
) -> list[StageExecutor]:
    """Split deep copies of ``layers`` at ``cuts`` (e.g. ``[1, 3]``) into executors."""
    spec = get_model_spec(key)
    parsed = parse_config(key, config)
    out_specs = trace_output_specs(list(layers), sample_input(key, config))
    bounds = [0, *cuts, len(layers)]
    stages = []
    for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        stages.append(
            StageExecutor(
                StageConfig(
                    first_layer_index=start,
                    is_last=last,
                    loss=spec.loss(parsed),
                    optimizer=optimizer,
                    **stage_kwargs,
                ),
                [copy.deepcopy(layer) for layer in layers[start:stop]],
                input_spec=spec.input_spec(parsed) if start == 0 else out_specs[start - 1],
                label_spec=spec.label_spec(parsed) if last else None,
            )
        )
    return stages


def run_micro_batch(stages: Sequence[StageExecutor], mb: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward through every stage, loss on the last, backward through all (max_in_flight=1 order)."""
    h = x
    for stage in stages[:-1]:
        h = stage.forward(mb, h)
    result = stages[-1].forward_loss(mb, h, y)
    grad = result.grad_input
    for stage in reversed(stages[:-1]):
        grad = stage.backward(mb, grad)  # type: ignore[arg-type]
    assert grad is None
    return result.loss


def all_params(stages: Sequence[StageExecutor]) -> dict[str, torch.Tensor]:
    """Live parameters and buffers of every stage by global name."""
    named: dict[str, torch.Tensor] = {}
    for stage in stages:
        named.update(stage.parameters_by_name())
        named.update(stage.buffers_by_name())
    return named


def drive_1f1b(
    stages: Sequence[StageExecutor], xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor | None], list[dict[str, torch.Tensor]], list[float]]:
    """Run micro-batches through the stages in a valid 1F1B interleaving, as a network would.

    Each stage follows its own 1F1B op list; stages take turns round-robin and an op runs as soon
    as its input has arrived. Returns per-backward input gradients and parameter gradients (in
    execution order) and the losses by micro-batch.
    """
    num_stages = len(stages)
    schedules = one_f_one_b_schedule(num_stages, len(xs))
    activations: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor | None] = {}
    input_grads: list[torch.Tensor | None] = []
    param_grads: list[dict[str, torch.Tensor]] = []
    losses = [float("nan")] * len(xs)
    cursor = [0] * num_stages
    last = num_stages - 1
    while any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if cursor[s] == len(schedules[s]):
                continue
            kind, mb = schedules[s][cursor[s]]
            source = xs[mb] if s == 0 else activations.get((s - 1, mb))
            if kind == "F" and source is not None and s == last:
                result = stages[s].forward_loss(mb, source, ys[mb])
                grads[(s, mb)], losses[mb] = result.grad_input, result.loss
            elif kind == "F" and source is not None:
                activations[(s, mb)] = stages[s].forward(mb, source)
            elif kind == "B" and s == last:
                pass  # the last stage did its backward inside forward_loss
            elif kind == "B" and (s + 1, mb) in grads:
                grads[(s, mb)] = stages[s].backward(mb, grads[(s + 1, mb)])  # type: ignore[arg-type]
                input_grads.append(grads[(s, mb)])
                param_grads.append(stages[s].last_param_grads)
            else:
                continue
            cursor[s] += 1
            progressed = True
        assert progressed, "1F1B driver deadlocked"
    return input_grads, param_grads, losses
