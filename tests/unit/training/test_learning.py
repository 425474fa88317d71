"""Learning smoke test: the digits CNN reaches >= 97% test accuracy in a few CPU seconds."""

from __future__ import annotations

import torch
from torch import nn

from ravnest_p2p.models import build_model
from ravnest_p2p.runtime import OptimizerConfig, build_optimizer
from ravnest_p2p.training import iterate_batches, load_digits, num_batches


def test_digits_cnn_reaches_97_percent():
    train, test = load_digits()
    model = nn.Sequential(*build_model("digits_cnn", {}, seed=0))
    epochs = 10
    steps = epochs * num_batches(len(train), batch_size=32)
    config = OptimizerConfig(
        name="adam", lr=3e-3, schedule="warmup_cosine", warmup_steps=20, total_steps=steps
    )
    optimizer, scheduler = build_optimizer(model.parameters(), config)
    for epoch in range(epochs):
        for x, y in iterate_batches(train, batch_size=32, seed=0, epoch=epoch):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(test.inputs).argmax(dim=1) == test.labels).float().mean().item()
    assert accuracy >= 0.97
