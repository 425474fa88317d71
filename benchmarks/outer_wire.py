"""Replicas trained with their outer syncs through the real ring data plane (in-memory streams).

Unlike `outer_sim.py` (rings simulated by plain means, compression applied in process), every sync here
is an `OuterAverager` round over `RingAllReduce` servers joined by a `MemoryStreamHub`: the same
frames, codecs and checks as over the daemons, so `RoundMetrics.bytes_sent` counts the payload bytes a
daemon would carry (part headers, 20 B per part, and hellos excluded), and the loss includes what the
wire codec does (int8/int4 re-quantised at every hop, with error feedback of those roundings).

Each cluster splits the model into 2 stages at a different layer, so the shard map has several rings
(and staggered fragments have something to stagger).
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.outer_sim import Problem, _val_loss
from ravnest_p2p.averaging import (
    AveragerConfig,
    OuterAverager,
    OuterOptimizer,
    OuterOptimizerConfig,
    RingAllReduce,
    RingConfig,
    build_shard_map,
)
from ravnest_p2p.averaging.stagger import due_fragment, fragment_rings
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

__all__ = ["WireTrace", "train_over_rings"]


@dataclass
class WireTrace:
    val_loss: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    bytes_per_replica: list[int] = field(default_factory=list)  # cumulative, payload bytes sent
    sync_bytes: list[int] = field(default_factory=list)  # per sync: bytes all replicas sent together
    identical: bool = True  # parameters (unsent_stays_local: anchors) bit-identical after every sync


def _layer(name: str) -> int:
    return int(name.split(".")[0])


async def _train(
    problem: Problem,
    outer: OuterOptimizerConfig,
    period: int,
    num_replicas: int,
    num_steps: int,
    eval_every: int,
) -> WireTrace:
    models = [copy.deepcopy(problem.model) for _ in range(num_replicas)]
    inner = [torch.optim.Adam(m.parameters(), lr=problem.inner_lr) for m in models]
    gens = [torch.Generator().manual_seed(i) for i in range(num_replicas)]
    named = [dict(m.named_parameters()) for m in models]
    clusters, owner = [], {}
    layers = sorted({_layer(n) for n in named[0]})
    for c in range(num_replicas):  # cluster c's second stage starts at a different layer
        cut = layers[1 + c % (len(layers) - 1)] if len(layers) > 1 else layers[0] + 1
        stages = []
        for s in range(2):
            peer = f"c{c}s{s}"
            names = [n for n in named[c] if (_layer(n) < cut) == (s == 0)]
            stages.append((peer, [(n, named[c][n].numel()) for n in names]))
            owner[peer] = (c, names)
        clusters.append(stages)
    shard_map = build_shard_map(clusters, epoch=1)
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    config = RingConfig(step_timeout_s=30, round_timeout_s=300)
    averagers: dict[str, OuterAverager] = {}
    for peer, (c, names) in owner.items():
        rings = RingAllReduce(RpcEndpoint(net.create(peer), "bench"), config, streams=hub.streams(peer))
        await rings.start()
        state = OuterOptimizer(outer)
        state.initialise({n: named[c][n] for n in names})

        def read(c=c, names=tuple(names)):
            return {n: named[c][n].detach() for n in names}

        def write(values, c=c):
            with torch.no_grad():
                for n, v in values.items():
                    named[c][n].copy_(v)

        averagers[peer] = OuterAverager(
            AveragerConfig(period_steps=period),
            rings,
            outer=state,
            read=read,
            write=write,
            shard_map=lambda: shard_map,
        )
    fragments = fragment_rings(shard_map, outer.num_fragments)
    trace, sent, next_eval = WireTrace(), 0, eval_every
    for step in range(1, num_steps + 1):
        for model, opt, gen in zip(models, inner, gens, strict=True):
            idx = torch.randint(len(problem.train_x), (problem.batch_size,), generator=gen)
            loss = nn.functional.cross_entropy(model(problem.train_x[idx]), problem.train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        due = due_fragment(step, period, outer.num_fragments)
        if due is None:
            continue
        round_index, fragment = due
        metrics = await asyncio.gather(
            *(a.run_round(round_index, ring_ids=fragments[fragment]) for a in averagers.values())
        )
        this_sync = sum(m.bytes_sent for m in metrics if m is not None)
        trace.sync_bytes.append(this_sync)
        sent += this_sync
        if outer.num_fragments == 1 and outer.unsent_stays_local:  # weights differ by residuals
            anchors: dict[str, torch.Tensor] = {}
            for a in averagers.values():
                for n, theta in a.outer.theta.items():
                    trace.identical &= torch.equal(anchors.setdefault(n, theta), theta)
        elif outer.num_fragments == 1:
            trace.identical &= all(
                torch.equal(named[0][n], named[c][n]) for c in range(1, num_replicas) for n in named[0]
            )
        if step >= next_eval or step == num_steps:
            next_eval = (step // eval_every + 1) * eval_every
            trace.steps.append(step)
            trace.val_loss.append(_val_loss(models[0], problem))
            trace.bytes_per_replica.append(sent // num_replicas)
    for a in averagers.values():
        await a.rings.aclose()
    return trace


def train_over_rings(
    problem: Problem,
    outer: OuterOptimizerConfig,
    *,
    period: int,
    num_replicas: int = 4,
    num_steps: int = 1500,
    eval_every: int = 50,
) -> WireTrace:
    """Train `num_replicas` replicas, syncing every `period` steps over the in-memory rings."""
    return asyncio.run(_train(problem, outer, period, num_replicas, num_steps, eval_every))
