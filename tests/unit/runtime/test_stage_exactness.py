"""A chain of executors with max_in_flight=1 is exactly single-process training."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from ravnest_p2p.models import build_model
from ravnest_p2p.runtime import OptimizerConfig, build_optimizer
from ravnest_p2p.training import iterate_batches, load_digits
from tests.unit.runtime.helpers import all_params, make_stages, run_micro_batch

OPTIMIZERS = {
    "sgd": OptimizerConfig(name="sgd", lr=0.05, momentum=0.9),
    "adam": OptimizerConfig(name="adam", lr=3e-3),
    "adamw_cosine": OptimizerConfig(
        name="adamw", lr=3e-3, weight_decay=0.01, schedule="warmup_cosine", warmup_steps=2, total_steps=6
    ),
}


@pytest.fixture(scope="module")
def digits_batches():
    train, _ = load_digits()
    return list(itertools.islice(iterate_batches(train, batch_size=16, seed=1, epoch=0), 8))


@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_three_stage_chain_matches_single_process(digits_batches, opt_name, update_every):
    opt_config = OPTIMIZERS[opt_name]
    layers = build_model("digits_cnn", {}, seed=0)
    stages = make_stages("digits_cnn", {}, layers, [1, 3], opt_config, update_every=update_every)
    reference = nn.Sequential(*copy.deepcopy(layers))
    optimizer, scheduler = build_optimizer(reference.parameters(), opt_config)

    for mb, (x, y) in enumerate(digits_batches):
        loss = run_micro_batch(stages, mb, x, y)
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        (ref_loss / update_every).backward()
        if (mb + 1) % update_every == 0:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), abs=1e-5)

    assert [s.num_steps for s in stages] == [len(digits_batches) // update_every] * 3
    assert [s.weight_version for s in stages] == [len(digits_batches) // update_every] * 3
    ours = all_params(stages)
    theirs = dict(reference.named_parameters())
    assert set(theirs) <= set(ours)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value.detach(), atol=1e-5, rtol=0)
        assert not torch.equal(value.detach(), dict(nn.Sequential(*layers).named_parameters())[name])
