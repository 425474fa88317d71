"""The outer optimizer's state moves with the stage: hand-over (capture/restore) and checkpoints."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ravnest_p2p.averaging import (
    AveragerConfig,
    DeltaCompression,
    OuterAverager,
    OuterOptimizer,
    OuterOptimizerConfig,
    RingAllReduce,
    RingConfig,
)
from ravnest_p2p.averaging.shards import build_shard_map
from ravnest_p2p.averaging.streams import MemoryStreamHub
from ravnest_p2p.runtime.stage import StageExecutor
from ravnest_p2p.training.checkpoint import load_checkpoint, write_checkpoint
from ravnest_p2p.training.stage_state import (
    StageState,
    StateMismatch,
    attach_extra_state,
    capture_state,
    check_state,
    outer_tensors,
    restore_state,
    tensor_digest,
)
from ravnest_p2p.training.stages import build_stage
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from .stage_state_helpers import SGD, build_split, resnet_job, train_step

OUTER = OuterOptimizerConfig(compression=DeltaCompression.INT8, chunk_numel=64)  # residuals, buffer anchors
PEERS = ("c0", "c1")


def held(executor: StageExecutor) -> dict[str, torch.Tensor]:
    return {**executor.parameters_by_name(), **executor.buffers_by_name()}


def outer_of(executor: StageExecutor, imported: dict[str, torch.Tensor] | None = None) -> OuterOptimizer:
    outer = OuterOptimizer(OUTER, plain=executor.buffers_by_name())
    if imported:
        outer.import_state(imported, shapes={n: t.shape for n, t in held(executor).items()})
    outer.initialise(held(executor))  # anchors only what was not imported
    return outer


async def train_with_outer_syncs(*, replan_after: int | None, take_outer_state: bool = True):
    """2 clusters x 1 stage, 3 outer syncs; cluster 0's stage moves to a new executor after a sync."""
    job = resnet_job(SGD, averaging_period_steps=1, outer_optimizer=OUTER.model_dump())
    executors = {p: build_split(job, [(0, 5)])[0] for p in PEERS}  # the job's seed: the same start
    floating = [(n, t.numel()) for n, t in held(executors["c0"]).items() if t.is_floating_point()]
    shard_map = build_shard_map([[(p, floating)] for p in PEERS], epoch=1)
    net = FakeNetwork()
    hub = MemoryStreamHub(net)
    config = RingConfig(part_size_bytes=4096, step_timeout_s=2.0, probe_timeout_s=0.5)
    servers = {
        p: RingAllReduce(RpcEndpoint(net.create(p), "run"), config, streams=hub.streams(p)) for p in PEERS
    }
    for server in servers.values():
        await server.start()

    def averager(p: str, outer: OuterOptimizer) -> OuterAverager:
        executor = executors[p]
        return OuterAverager(
            AveragerConfig(period_steps=1),
            servers[p],
            outer=outer,
            read=lambda: held(executor),
            write=executor.assign_parameters,
            shard_map=lambda: shard_map,
        )

    averagers = {p: averager(p, outer_of(executors[p])) for p in PEERS}
    for r in range(3):
        for i, p in enumerate(PEERS):
            train_step([executors[p]], 1000 * r + i)  # each cluster its own data
        await asyncio.gather(*(a.run_round(r) for a in averagers.values()))
        if r == replan_after:  # the old owner hands its stage over; the new owner starts from it
            old = executors["c0"]
            attach_extra_state(old, lambda o=averagers["c0"].outer: o.export_state(copy=False))
            state = capture_state(old)
            new = build_stage(job, 0, 5, max_in_flight=1)
            restore_state(new, state)
            executors["c0"] = new
            imported = outer_tensors(state) if take_outer_state else None
            averagers["c0"] = averager("c0", outer_of(new, imported))
    for server in servers.values():
        await server.aclose()
    outer = averagers["c0"].outer
    return {n: t.clone() for n, t in held(executors["c0"]).items()}, outer.theta, outer.momentum


async def test_a_replan_mid_job_keeps_the_outer_momentum_and_the_next_steps_are_unchanged():
    params, theta, momentum = await train_with_outer_syncs(replan_after=None)
    moved, moved_theta, moved_momentum = await train_with_outer_syncs(replan_after=1)
    for name in params:
        assert torch.equal(moved[name], params[name]), name
    for name in theta:
        assert torch.equal(moved_theta[name], theta[name]), name
    for name in momentum:
        assert torch.equal(moved_momentum[name], momentum[name]), name
    # without the outer state the new owner anchors at its weights and loses the momentum: it differs
    lost, _, _ = await train_with_outer_syncs(replan_after=1, take_outer_state=False)
    assert any(not torch.equal(lost[n], params[n]) for n in params)


def test_a_checkpoint_round_trip_restores_the_outer_state(tmp_path):
    job = resnet_job(SGD, averaging_period_steps=1, outer_optimizer=OUTER.model_dump())
    [stage] = build_split(job, [(0, 5)])
    outer = outer_of(stage)
    for r in range(2):  # two syncs of one replica with itself: momentum, residuals, buffer anchors
        train_step([stage], r)
        deltas = outer.outgoing_deltas({n: t for n, t in held(stage).items() if t.is_floating_point()})
        lost = {n: 0.01 * torch.ones_like(d) for n, d in deltas.items()}
        stage.assign_parameters(outer.step_deltas({n: 0.5 * d for n, d in deltas.items()}, lost))
    assert outer.momentum
    assert outer.residual
    attach_extra_state(stage, lambda: outer.export_state(copy=False))
    state = capture_state(stage)
    assert outer_tensors(state)
    path = write_checkpoint(
        tmp_path, state.tensors, job=job, step=2, first_layer=0, end_layer=5, meta=state.meta
    )
    _, loaded = load_checkpoint(path, job=job)
    [fresh] = build_split(job, [(0, 5)])
    restore_state(fresh, loaded)  # the executor takes parameters, buffers and optimizer state only
    back = outer_of(fresh, outer_tensors(loaded))
    for table, restored in [
        (outer.theta, back.theta),
        (outer.momentum, back.momentum),
        (outer.residual, back.residual),
    ]:
        assert set(table) == set(restored)
        assert all(torch.equal(table[n], restored[n]) for n in table)


def test_outer_entries_are_checked_like_every_other_tensor():
    job = resnet_job(SGD, averaging_period_steps=1, outer_optimizer=OUTER.model_dump())
    [stage] = build_split(job, [(0, 5)])
    name = next(iter(stage.parameters_by_name()))
    good = stage.parameters_by_name()[name].detach().float().clone()
    key = f"outer/{name}/theta"
    check_state(stage, StageState({key: good}, {key: tensor_digest(good)}), complete=False)
    for tensor, digest, why in [
        (good, "0" * 16, "digest"),
        (good.flatten()[:3].clone(), None, "!="),
        (good.double(), None, "!="),
        (torch.full_like(good, float("nan")), None, "non-finite"),
    ]:
        with pytest.raises(StateMismatch, match=why):
            check_state(
                stage, StageState({key: tensor}, {key: digest or tensor_digest(tensor)}), complete=False
            )
    with pytest.raises(StateMismatch, match="not part"):
        check_state(stage, StageState({"outer/99.weight/theta": good}, {}), complete=False)
