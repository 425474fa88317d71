"""Encoded Δ over real p2p daemons: after every outer step all replicas hold the same bits; real bytes."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import DeltaCompression, OuterOptimizerConfig
from ravnest_p2p.training.replicas import tensor_digests
from tests.integration.averaging.helpers import drift, outer_averagers

pytestmark = pytest.mark.timeout(180)


async def test_every_codec_leaves_identical_replicas_and_sends_its_real_bytes(swarm):
    _, servers, shard_map, owner_values, _ = swarm
    cluster_of = {p: c for p, (c, _) in owner_values.items()}
    sent: dict[DeltaCompression, int] = {}
    round_index = 0
    for kind in DeltaCompression:
        outer = OuterOptimizerConfig(compression=kind, topk_fraction=0.05)
        live, averagers = outer_averagers(servers, shard_map, owner_values, outer)
        sent[kind] = 0
        for _ in range(2):
            drift(live, cluster_of, round_index)
            metrics = await asyncio.gather(*(a.run_round(round_index) for a in averagers.values()))
            round_index += 1
            assert all(m is not None and all(len(r.participants) == 3 for r in m.rings) for m in metrics)
            sent[kind] += sum(m.bytes_sent for m in metrics if m is not None)
            models: dict[int, dict[str, str]] = {}
            for p, params in live.items():
                models.setdefault(cluster_of[p], {}).update(tensor_digests(params))
            assert models[0] == models[1] == models[2], kind
            for p, averager in averagers.items():
                assert all(torch.equal(t, live[p][n]) for n, t in averager.outer.theta.items())
    fp32 = sent[DeltaCompression.NONE]
    assert 0.25 <= sent[DeltaCompression.INT8] / fp32 < 0.26  # 1 byte + 4 per 1024 elements, of 4
    assert 0.125 <= sent[DeltaCompression.INT4] / fp32 < 0.135
    assert sent[DeltaCompression.TOPK] / fp32 < 0.3  # 5 % kept, 8 bytes each, partial sums denser
