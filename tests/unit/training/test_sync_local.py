"""sync_backup over the in-memory transport: large tensors cut into row pieces, and local SGD (K > 1)."""

from __future__ import annotations

import asyncio
import copy
import functools

import pytest
import torch
from torch import nn

from ravnest_p2p.models import build_model, make_loss
from ravnest_p2p.strategies.sync_layout import row_pieces
from ravnest_p2p.training import sync_compute
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.stages import load_dataset
from ravnest_p2p.training.sync_shard import SyncBatches
from tests.unit.training.test_sync_backup import _reference, _runners

pytestmark = pytest.mark.timeout(60)


def test_row_pieces_cut_the_large_tensors_into_quarters_of_a_fair_shard() -> None:
    shapes = {"big": (16_000, 100), "small": (1_000, 10), "bias": (400, 100)}
    pieces = row_pieces(shapes, 1, min_piece_bytes=100)  # a quarter of the only shard: 4350 bytes
    names = [p.name for p in pieces]
    assert names == ["big[0:25]", "big[25:50]", "big[50:75]", "big[75:100]", "small", "bias"]
    assert [(p.tensor, p.start, p.end) for p in pieces[:2]] == [("big", 0, 25), ("big", 25, 50)]
    assert len(row_pieces(shapes, 4, min_piece_bytes=100)) == 15 + 2  # pieces of <= 1088 bytes
    # the minimum keeps small models whole; one row cannot be cut
    assert [p.name for p in row_pieces(shapes, 4)] == ["big", "small", "bias"]
    assert [p.name for p in row_pieces({"v": (10_000, 1)}, 4, min_piece_bytes=1)] == ["v"]
    with pytest.raises(ValueError, match="num_shards"):
        row_pieces(shapes, 0)


async def test_b0_with_cut_tensors_equals_single_process_sgd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sync_compute, "row_pieces", functools.partial(row_pieces, min_piece_bytes=64))
    _, runners = _runners(3, n=3, b=0, max_steps=5)
    cut = [name for shard in runners[0].layout.shards for name in shard if "[" in name]
    assert cut, "the test model's weight should be cut into row pieces"
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done and m.step == 5 for m in results)
    reference = _reference(runners[0].job, 3, 5)
    for runner in runners:
        for name, expected in reference.items():
            torch.testing.assert_close(runner.params[name].detach(), expected, atol=1e-5, rtol=0)


def _local_sgd_reference(job: JobSpec, num_workers: int, data_steps: int, k: int) -> dict[str, torch.Tensor]:
    """Model averaging every k plain SGD steps, each worker on its own batch slots."""
    model = nn.Sequential(*build_model(job.model, job.model_params, seed=job.seed))
    batches = SyncBatches(
        load_dataset(job)[0], batch_size=job.batch_size, seed=job.seed, num_workers=num_workers
    )
    loss_fn = make_loss("cross_entropy")
    for sync in range(-(-data_steps // k)):
        replicas = []
        for w in range(num_workers):
            replica = copy.deepcopy(model).train()
            optimizer = torch.optim.SGD(replica.parameters(), lr=job.optimizer.lr)
            for step in range(sync * k, min(data_steps, (sync + 1) * k)):
                inputs, labels = batches.batch(step, w)
                optimizer.zero_grad()
                loss_fn(replica(inputs), labels).backward()
                optimizer.step()
            replicas.append(dict(replica.named_parameters()))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.stack([r[name].detach() for r in replicas]).mean(0))
    return {name: p.detach() for name, p in model.named_parameters()}


async def test_local_steps_average_the_models_every_k_steps() -> None:
    _, runners = _runners(2, n=2, b=0, max_steps=7, local_steps=3)
    assert runners[0].final_step == 3  # 7 data steps in syncs of 3: 3, 3, 1
    results = await asyncio.gather(*(r.run() for r in runners))
    assert all(m.done and m.step == 3 for m in results)
    reference = _local_sgd_reference(runners[0].job, 2, 7, 3)
    for runner in runners:
        for name, expected in reference.items():
            torch.testing.assert_close(runner.params[name].detach(), expected, atol=1e-5, rtol=0)
