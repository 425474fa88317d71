"""The outer optimizer over the in-memory rings: H = 1 equals plain averaging bit for bit; replicas agree."""

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import (
    Averager,
    AveragerConfig,
    DeltaCompression,
    OuterAverager,
    OuterOptimizer,
    OuterOptimizerConfig,
    RingConfig,
)
from ravnest_p2p.training.replicas import tensor_digests
from tests.unit.averaging.helpers import fake_swarm, owned, replica

BUFFERS = {"2.running_mean", "2.running_var"}


async def make_swarm(num_clusters, outer_config, *, same_start, ring_config=None, nets=None):
    """Averagers (plain if `outer_config` is None) over one fake swarm; live values per peer.

    `nets`: if given, the fake network is appended to it (to kill peers).
    """
    net, shard_map, servers, cluster_of = await fake_swarm(num_clusters, ring_config or RingConfig())
    if nets is not None:
        nets.append(net)
    starts = [replica(0 if same_start else seed) for seed in range(num_clusters)]
    live = {p: {n: t.clone() for n, t in owned(shard_map, p, starts[cluster_of[p]]).items()} for p in servers}

    def make_write(p):
        def write(named):
            for name, value in named.items():
                live[p][name].copy_(value)

        return write

    averagers = {}
    for p in servers:
        common = dict(read=lambda p=p: live[p], write=make_write(p), shard_map=lambda: shard_map)
        if outer_config is None:
            averagers[p] = Averager(AveragerConfig(period_steps=1), servers[p], **common)
        else:
            outer = OuterOptimizer(outer_config, plain=BUFFERS)
            outer.initialise(live[p])
            averagers[p] = OuterAverager(AveragerConfig(period_steps=1), servers[p], outer=outer, **common)
    return live, averagers, cluster_of


def train_a_little(live, cluster_of, round_index):
    """A deterministic stand-in for H inner steps: each cluster drifts its own way."""
    for peer, params in live.items():
        gen = torch.Generator().manual_seed(1000 * round_index + cluster_of[peer])
        for name in sorted(params):
            value = params[name]
            value.add_(0.05 * torch.randn(value.shape, generator=gen))
            if name == "2.running_var":
                value.abs_()


def cluster_digests(live, cluster_of):
    """Per cluster: the digests of the whole model (its stages' tensors together)."""
    out = {}
    for peer, params in live.items():
        out.setdefault(cluster_of[peer], {}).update(tensor_digests(params))
    return out


async def run_rounds(live, averagers, cluster_of, num_rounds, check=None):
    for r in range(num_rounds):
        train_a_little(live, cluster_of, r)
        metrics = await asyncio.gather(*(a.run_round(r) for a in averagers.values()))
        assert all(m is not None and all(len(x.participants) > 1 for x in m.rings) for m in metrics)
        if check is not None:
            check(r)


async def test_h1_lr1_no_momentum_equals_plain_averaging_bit_for_bit():
    plain_live, plain, cluster_of = await make_swarm(3, None, same_start=False)
    config = OuterOptimizerConfig(lr=1.0, momentum=0.0)
    outer_live, outer, _ = await make_swarm(3, config, same_start=False)
    await run_rounds(plain_live, plain, cluster_of, 4)
    await run_rounds(outer_live, outer, cluster_of, 4)
    for peer in plain_live:
        assert tensor_digests(plain_live[peer]) == tensor_digests(outer_live[peer])
        for name, value in plain_live[peer].items():
            assert torch.equal(value, outer_live[peer][name])


@pytest.mark.parametrize("compression", list(DeltaCompression))
async def test_replicas_are_identical_after_every_outer_step(compression):
    config = OuterOptimizerConfig(compression=compression, chunk_numel=64, topk_fraction=0.1)
    live, averagers, cluster_of = await make_swarm(4, config, same_start=True)

    def check(round_index):
        digests = cluster_digests(live, cluster_of)
        assert all(d == digests[0] for d in digests.values()), f"round {round_index}"
        for peer, averager in averagers.items():  # the anchor is what training continues from
            assert isinstance(averager, OuterAverager)
            for name, theta in averager.outer.theta.items():
                assert torch.equal(theta, live[peer][name])

    await run_rounds(live, averagers, cluster_of, 4, check)
    some = next(iter(averagers.values()))
    assert isinstance(some, OuterAverager)
    assert some.outer.momentum  # momentum is really in use
    if compression is DeltaCompression.NONE:
        assert not some.outer.residual
    else:
        fp32_bytes = 4 * sum(t.numel() for t in some.outer.theta.values())
        assert some.outer.residual
        assert some.payload_bytes[-1] < fp32_bytes


async def test_outer_step_moves_further_than_the_average():
    # lr 0.7 with Nesterov momentum 0.9 differs from plain averaging after the first sync
    plain_live, plain, cluster_of = await make_swarm(2, None, same_start=True)
    outer_live, outer, _ = await make_swarm(2, OuterOptimizerConfig(), same_start=True)
    await run_rounds(plain_live, plain, cluster_of, 2)
    await run_rounds(outer_live, outer, cluster_of, 2)
    peer = next(iter(plain_live))
    assert not torch.allclose(plain_live[peer]["0.weight"], outer_live[peer]["0.weight"])
    for name in BUFFERS & set(plain_live[peer]):  # buffers are averaged plainly
        assert torch.equal(plain_live[peer][name], outer_live[peer][name])


async def test_the_closing_round_is_a_plain_average_so_replicas_agree_even_with_diverged_anchors():
    live, averagers, cluster_of = await make_swarm(3, OuterOptimizerConfig(), same_start=True)
    for peer, averager in averagers.items():  # cluster 0's anchors fell behind (left out of a sync)
        if cluster_of[peer] == 0:
            assert isinstance(averager, OuterAverager)
            for theta in averager.outer.theta.values():
                theta.add_(0.5)
    train_a_little(live, cluster_of, 0)
    expected = {c: dict(d) for c, d in cluster_digests(live, cluster_of).items()}
    await asyncio.gather(*(a.run_round(7, wait_for_all=True) for a in averagers.values()))
    digests = cluster_digests(live, cluster_of)
    assert digests[0] == digests[1] == digests[2]
    assert digests[0] != expected[0]
    assert all(isinstance(a, OuterAverager) and not a.payload_bytes for a in averagers.values())
