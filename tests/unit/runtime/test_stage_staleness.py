"""With several micro-batches in flight, each backward uses exactly the weights its forward used."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ravnest_p2p.models import TensorSpec, build_model
from ravnest_p2p.runtime import OptimizerConfig, StageConfig, StageExecutor
from ravnest_p2p.runtime.schedule import one_f_one_b_schedule

MLP = {"in_features": 8, "hidden_features": [16, 16, 16], "out_features": 4}


def _local(name: str, offset: int) -> str:
    index, _, rest = name.partition(".")
    return f"{int(index) - offset}.{rest}"


def test_each_gradient_is_taken_at_the_stashed_weights():
    layers = build_model("mlp", MLP, seed=0)[1:3]
    stage = StageExecutor(
        StageConfig(first_layer_index=1, max_in_flight=3, optimizer=OptimizerConfig(name="adam", lr=0.05)),
        copy.deepcopy(layers),
        input_spec=TensorSpec((16,), torch.float32),
    )
    generator = torch.Generator().manual_seed(0)
    num_micro_batches = 7
    inputs = [torch.randn(4, 16, generator=generator) for _ in range(num_micro_batches)]
    grads_out = [torch.randn(4, 16, generator=generator) for _ in range(num_micro_batches)]
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    version_of: dict[int, int] = {}
    stale = 0

    # stage 1 of a 3-stage 1F1B pipeline: two forwards ahead of its backwards
    for kind, mb in one_f_one_b_schedule(3, num_micro_batches)[1]:
        if kind == "F":
            version = stage.weight_version
            snapshots.setdefault(
                version, {n: p.detach().clone() for n, p in stage.parameters_by_name().items()}
            )
            version_of[mb] = version
            stage.forward(mb, inputs[mb])
            assert len(stage.stashed_versions) <= len(set(version_of[m] for m in stage.in_flight)) + 1
            continue
        stale += stage.weight_version != version_of[mb]
        grad_input = stage.backward(mb, grads_out[mb])

        fresh = nn.Sequential(*copy.deepcopy(layers))
        fresh.load_state_dict({_local(n, 1): v for n, v in snapshots[version_of[mb]].items()})
        x = inputs[mb].clone().requires_grad_(True)
        fresh(x).backward(grads_out[mb])
        assert grad_input is not None
        torch.testing.assert_close(grad_input, x.grad, atol=1e-6, rtol=1e-5)
        ours = stage.last_param_grads
        for name, p in fresh.named_parameters():
            index, _, rest = name.partition(".")
            torch.testing.assert_close(ours[f"{int(index) + 1}.{rest}"], p.grad)

    assert stale >= 3, "the schedule should have exercised stale weights"
    assert stage.in_flight == ()
    assert stage.stashed_versions == ()
    assert stage.weight_version == num_micro_batches


def test_external_parameter_change_is_a_new_version_and_keeps_old_stash():
    layers = build_model("mlp", MLP, seed=0)[1:2]
    stage = StageExecutor(
        StageConfig(first_layer_index=1, max_in_flight=2, optimizer=OptimizerConfig(name="sgd", lr=0.1)),
        layers,
        input_spec=TensorSpec((16,), torch.float32),
    )
    x = torch.randn(2, 16)
    stage.forward(0, x)
    before = {n: p.detach().clone() for n, p in stage.parameters_by_name().items()}
    with torch.no_grad():
        for p in stage.parameters_by_name().values():
            p.mul_(2.0)  # e.g. an averager writing in place
    stage.forward(1, x)
    assert stage.weight_version == 1
    assert stage.stashed_versions == (0, 1)
    stage.backward(0, torch.ones(2, 16))

    fresh = nn.Sequential(copy.deepcopy(layers[0]))
    fresh.load_state_dict({_local(n, 1): v for n, v in before.items()})
    fresh(x).backward(torch.ones(2, 16))
    torch.testing.assert_close(stage.last_param_grads["1.0.weight"], fresh[0][0].weight.grad)

    stage.assign_parameters({"1.0.bias": torch.zeros(16)})
    assert stage.weight_version == 3  # step after the backward, then the assignment
    assert torch.equal(stage.parameters_by_name()["1.0.bias"], torch.zeros(16))
