"""The asynchronous (stale, weight-stashed) 1F1B pipeline still learns digits."""

from __future__ import annotations

import torch
from torch import nn

from ravnest_p2p.models import build_model
from ravnest_p2p.runtime import OptimizerConfig
from ravnest_p2p.training import iterate_batches, load_digits
from tests.unit.runtime.helpers import drive_1f1b, make_stages


def test_three_stage_async_pipeline_learns_digits():
    train, test = load_digits()
    layers = build_model("digits_cnn", {}, seed=0)
    stages = make_stages(
        "digits_cnn", {}, layers, [1, 3], OptimizerConfig(name="adam", lr=2e-3), max_in_flight=3
    )
    for epoch in range(4):
        batches = list(iterate_batches(train, batch_size=32, seed=0, epoch=epoch))
        xs, ys = [x for x, _ in batches], [y for _, y in batches]
        _, _, losses = drive_1f1b(stages, xs, ys)
    assert all(stage.in_flight == () for stage in stages)
    assert losses[-1] < 0.5
    model = nn.Sequential(*(layer for stage in stages for layer in stage.module)).eval()
    with torch.no_grad():
        accuracy = (model(test.inputs).argmax(dim=1) == test.labels).float().mean().item()
    assert accuracy >= 0.95
