"""A real hand-over: a new owner, split elsewhere, pulls its layers from two stage owners of a finished
job over real p2p daemons; the stages wrote checkpoints while they trained."""

from __future__ import annotations

import asyncio

import pytest

from ravnest_p2p.training.checkpoint import CheckpointAnnouncement, list_checkpoints, load_checkpoint
from ravnest_p2p.training.checkpoint_fetch import fetch_from_checkpoints
from ravnest_p2p.training.handover import HandoverServer, fetch_state
from ravnest_p2p.training.job import StagePlacement
from ravnest_p2p.training.local import local_hosts
from ravnest_p2p.training.runner import StageRunner, find_placement
from ravnest_p2p.training.stage_state import (
    expected_entries,
    live_tensors,
    merge_states,
    names_in_layers,
    restore_state,
    sources_for_range,
)
from ravnest_p2p.training.stages import build_stage
from ravnest_p2p.transport import RpcEndpoint
from tests.unit.training.stage_state_helpers import assert_bit_equal, resnet_job

pytestmark = pytest.mark.timeout(180)


async def test_a_new_owner_takes_layers_from_two_owners_of_a_trained_job(tmp_path):
    async with local_hosts(3) as (a, b, newcomer):
        split = [(a.peer_id, 0, 2), (b.peer_id, 2, 5)]
        job = resnet_job(
            job_id="handover",
            batch_size=32,
            max_steps=8,
            checkpoint_every_steps=3,
            checkpoint_keep_last=2,
            state_readers=(newcomer.peer_id,),  # in a re-plan: the next plan's members
            assignment=((tuple(StagePlacement(peer_id=p, first_layer=f, end_layer=e) for p, f, e in split)),),
        )
        runners = []
        for transport in (a, b):
            runner = StageRunner(
                RpcEndpoint(transport, "job"), None, job, find_placement(job, transport.peer_id)
            )
            runner.checkpoint_dir = tmp_path / transport.peer_id  # type: ignore[attr-defined]
            runners.append(runner)
        finals = await asyncio.gather(*(r.run() for r in runners))
        assert all(m.done for m in finals)

        # the new owner of layers [1, 4) asks each previous owner for its part, checked against the
        # digests the owner published with its final metrics
        new = build_stage(job, 1, 4, max_in_flight=1)
        expected = expected_entries(new)
        rpc = RpcEndpoint(newcomer, "job")
        published = {m.peer_id: m.param_digests for m in finals}
        parts = [
            await fetch_state(
                rpc,
                peer,
                job.job_id,
                layers=(lo, hi),
                expected=expected,
                expected_digests=published[peer],
                timeout_s=30,
            )
            for peer, lo, hi in sources_for_range(1, 4, split)
        ]
        restore_state(new, merge_states(parts))
        truth = {}
        for runner in runners:
            assert runner.service is not None
            truth.update(live_tensors(runner.service.executor))
        received = live_tensors(new)
        assert any(n.startswith("optim/") for n in received)
        assert_bit_equal(received, {n: truth[n] for n in names_in_layers(truth, 1, 4)})
        assert new.num_steps == runners[0].service.executor.num_steps == 8
        assert HandoverServer.of(runners[0].rpc).refused == 0

        # the same layers from the checkpoints the owners wrote and serve (step 6: the newest kept)
        announcements = [
            CheckpointAnnouncement.of(
                [
                    load_checkpoint(p)[0]
                    for p in list_checkpoints(tmp_path / peer / job.job_id / f"layers-{f}-{e}")
                ],
                peer_id=peer,
                updated_at=0.0,
            )
            for peer, f, e in split
        ]
        from_disk = await fetch_from_checkpoints(
            rpc, announcements, job, 1, 4, expected=expected, timeout_s=30
        )
        assert from_disk is not None
        assert from_disk.meta is not None
        assert from_disk.meta.num_steps == 6
        assert set(from_disk.tensors) == set(received)

    # checkpoints were written while training: steps 3 and 6 of each stage, both verified
    for transport, (_, first, end) in zip((a, b), split, strict=True):
        directory = tmp_path / transport.peer_id / job.job_id / f"layers-{first}-{end}"
        manifests = [load_checkpoint(p, job=job)[0] for p in list_checkpoints(directory)]
        assert [m.step for m in manifests] == [3, 6]
        assert all((m.first_layer, m.end_layer) == (first, end) for m in manifests)
