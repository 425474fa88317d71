"""A bad message raises InvalidMessage and leaves every piece of stage state untouched."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ravnest_p2p.errors import InvalidMessage
from ravnest_p2p.models import build_model
from ravnest_p2p.runtime import OptimizerConfig, PipelineFull, StageExecutor
from tests.unit.runtime.helpers import make_stages

ADAM = OptimizerConfig(name="adam", lr=1e-2)
GPT = {"vocab_size": 11, "block_size": 6, "num_layers": 2, "embed_dim": 8, "num_heads": 2}


def _snapshot(stage: StageExecutor) -> dict[str, Any]:
    return {
        "state": copy.deepcopy(stage.state_dict()),
        "grads": {
            n: None if p.grad is None else p.grad.clone() for n, p in stage.parameters_by_name().items()
        },
        "in_flight": stage.in_flight,
        "stash": stage.stashed_versions,
        "version": stage.weight_version,
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.fixture
def gpt_stages():
    layers = build_model("char_gpt", GPT, seed=0)
    stages = make_stages("char_gpt", GPT, layers, [1, 3], ADAM, max_in_flight=2)
    tokens = torch.randint(0, 11, (3, 6))
    # one full micro-batch (so the optimizers have state), then one in flight on stages 0 and 1
    h0 = stages[0].forward(0, tokens)
    h1 = stages[1].forward(0, h0)
    g = stages[2].forward_loss(0, h1, tokens).grad_input
    stages[0].backward(0, stages[1].backward(0, g))
    stages[1].forward(1, stages[0].forward(1, tokens))
    return stages, tokens, h1


def test_bad_messages_change_no_state(gpt_stages):
    first, middle, last = gpt_stages[0]
    tokens, act = gpt_stages[1], gpt_stages[2]
    nan_act = act.clone()
    nan_act[0, 0, 0] = float("nan")
    inf_act = act.clone()
    inf_act[1, 2, 3] = float("inf")
    bad_calls = [
        (first, lambda: first.forward(2, tokens.float())),  # wrong dtype
        (first, lambda: first.forward(2, tokens[:, :5])),  # wrong shape
        (first, lambda: first.forward(2, tokens + 11)),  # token id out of range
        (first, lambda: first.forward(2, -tokens - 1)),  # negative token id
        (first, lambda: first.forward(2, tokens[:0])),  # empty batch
        (first, lambda: first.forward(2, tokens.numpy())),  # not a tensor
        (first, lambda: first.forward(-1, tokens)),  # bad id
        (first, lambda: first.forward(True, tokens)),  # bool is not an id
        (first, lambda: first.forward(1, tokens)),  # duplicate id
        (first, lambda: first.backward(7, act)),  # unknown id
        (first, lambda: first.forward_loss(2, tokens, tokens)),  # not last
        (middle, lambda: middle.forward(2, nan_act)),  # NaN
        (middle, lambda: middle.forward(2, inf_act)),  # inf
        (middle, lambda: middle.forward(2, act.double())),  # wrong dtype
        (middle, lambda: middle.backward(1, act[:2])),  # gradient of the wrong shape
        (middle, lambda: middle.backward(1, nan_act)),  # non-finite gradient
        (middle, lambda: middle.backward(0, act)),  # already backwarded
        (last, lambda: last.forward(2, act)),  # last stage takes forward_loss
        (last, lambda: last.backward(0, act)),  # nothing in flight on the last stage
        (last, lambda: last.forward_loss(2, act, tokens[:2])),  # label batch mismatch
        (last, lambda: last.forward_loss(2, act, tokens + 20)),  # label out of range
        (last, lambda: last.forward_loss(2, act, tokens.float())),  # label dtype
        (last, lambda: last.forward_loss(2, nan_act, tokens)),  # NaN activations
    ]
    for stage, call in bad_calls:
        before = _snapshot(stage)
        with pytest.raises(InvalidMessage):
            call()
        _assert_same(before, _snapshot(stage))


def test_max_in_flight_is_enforced(gpt_stages):
    first, tokens = gpt_stages[0][0], gpt_stages[1]
    first.forward(2, tokens)
    before = _snapshot(first)
    with pytest.raises(PipelineFull, match="max_in_flight"):
        first.forward(3, tokens)
    _assert_same(before, _snapshot(first))
    assert PipelineFull.code == "pipeline_full"
    assert issubclass(PipelineFull, InvalidMessage)


def test_state_dict_round_trip_continues_identically():
    config = {"hidden_features": [16], "dropout": 0.0}
    layers = build_model("mlp", config, seed=0)
    a = make_stages("mlp", config, layers, [1], ADAM)
    b = make_stages("mlp", config, build_model("mlp", config, seed=1), [1], ADAM)
    x, y = torch.randn(4, 64), torch.randint(0, 10, (4,))
    for mb in range(2):
        a[0].backward(mb, a[1].forward_loss(mb, a[0].forward(mb, x), y).grad_input)
    for sa, sb in zip(a, b, strict=True):
        sb.load_state_dict(copy.deepcopy(sa.state_dict()))
        assert sb.weight_version == sa.weight_version == 2
    for stages in (a, b):
        for mb in range(2, 4):
            stages[0].backward(mb, stages[1].forward_loss(mb, stages[0].forward(mb, x), y).grad_input)
    for sa, sb in zip(a, b, strict=True):
        for name, p in sa.parameters_by_name().items():
            assert torch.equal(p, sb.parameters_by_name()[name])
    a[0].forward(9, x)
    with pytest.raises(RuntimeError, match="in flight"):
        a[0].load_state_dict(a[0].state_dict())
    with pytest.raises(ValueError, match="unknown parameter"):
        a[1].assign_parameters({"0.0.weight": torch.zeros(16, 64)})
