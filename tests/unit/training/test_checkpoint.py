"""Checkpoints: safetensors + manifest round trips, keep-last-K, announcements, the stage hook."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointConfig,
    CheckpointError,
    CheckpointRecord,
    CheckpointWriter,
    list_checkpoints,
    load_checkpoint,
    newest_complete,
    read_announcements,
    write_checkpoint,
)
from ravnest_p2p.training.stage_hook import StageStateHook, checkpoint_config_for
from ravnest_p2p.training.stage_state import capture_state, restore_state
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint
from ravnest_p2p.utils import TaskOwner, wait_until

from .stage_state_helpers import assert_bit_equal, build_split, resnet_job, train_step, union_state


def test_a_checkpoint_restores_a_stage_bit_for_bit_and_is_plain_safetensors(tmp_path):
    job = resnet_job()
    [stage] = build_split(job, [(0, 5)])
    for seed in range(3):
        train_step([stage], seed)
    state = capture_state(stage, progress={"samples": 12})
    path = write_checkpoint(
        tmp_path,
        state.tensors,
        job=job,
        step=3,
        first_layer=0,
        end_layer=5,
        meta=state.meta,
        progress={"samples": 12},
    )
    manifest, loaded = load_checkpoint(path, job=job)
    assert (manifest.step, manifest.first_layer, manifest.end_layer) == (3, 0, 5)
    assert manifest.progress == {"samples": 12}
    assert loaded.digests == state.digests
    with safe_open(str(path.with_suffix(".safetensors")), framework="pt") as f:
        assert set(f.keys()) == set(state.tensors)
        assert torch.equal(f.get_tensor("1.conv1.weight"), state.tensors["1.conv1.weight"])

    [fresh] = build_split(job, [(0, 5)])
    restore_state(fresh, loaded)
    train_step([stage], 9)
    train_step([fresh], 9)
    assert_bit_equal(union_state([stage]), union_state([fresh]))
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_the_writer_keeps_the_last_k_and_saves_when_due(tmp_path):
    job = resnet_job()
    [stage] = build_split(job, [(2, 5)])
    writer = CheckpointWriter(
        CheckpointConfig(every_steps=2, keep_last=2, dir=tmp_path), job, first_layer=2, end_layer=5
    )
    saved = []
    for step in range(1, 9):
        if writer.due(step):
            writer.save(capture_state(stage), step=step)
            saved.append(step)
    assert saved == [2, 4, 6, 8]
    assert not writer.due(8)  # once per step
    paths = list_checkpoints(writer.directory)
    assert [p.stem for p in paths] == ["step-0000000006", "step-0000000008"]
    assert sorted(p.name for p in writer.directory.iterdir()) == [
        "step-0000000006.json",
        "step-0000000006.safetensors",
        "step-0000000008.json",
        "step-0000000008.safetensors",
    ]
    assert [m.step for m in writer.saved()] == [6, 8]


def test_a_checkpoint_of_another_job_spec_is_refused(tmp_path):
    job = resnet_job()
    [stage] = build_split(job, [(0, 5)])
    state = capture_state(stage)
    path = write_checkpoint(
        tmp_path, state.tensors, job=job, step=0, first_layer=0, end_layer=5, meta=state.meta
    )
    with pytest.raises(CheckpointError, match="another job"):
        load_checkpoint(path, job=job.model_copy(update={"seed": 4}))
    manifest = json.loads(path.read_text())
    manifest["file"] = "../elsewhere.safetensors"
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="plain name"):
        load_checkpoint(path)


def _announce(peer, steps_ranges, job_id="j"):
    return CheckpointAnnouncement(
        job_id=job_id,
        job_digest="d",
        peer_id=peer,
        checkpoints=tuple(
            CheckpointRecord(step=s, first_layer=f, end_layer=e, manifest_digest=f"m{s}{f}")
            for s, f, e in steps_ranges
        ),
    )


def test_newest_complete_step_needs_every_layer_at_one_step():
    announcements = [
        _announce("a", [(10, 0, 2), (20, 0, 2), (30, 0, 2)]),
        _announce("b", [(10, 2, 5), (20, 2, 5)]),  # b has not written step 30 yet
        _announce("c", [(30, 0, 3), (40, 0, 3)]),  # another cluster, split elsewhere
        _announce("d", [(30, 3, 5)]),
        _announce("x", [(50, 0, 5)], job_id="other"),
    ]
    step, holders = newest_complete(announcements, job_id="j", num_layers=5)
    assert step == 30
    assert [(p, r.first_layer, r.end_layer) for p, r in holders] == [("c", 0, 3), ("d", 3, 5)]
    assert newest_complete(announcements[:2], job_id="j", num_layers=5)[0] == 20
    assert newest_complete(announcements[:1], job_id="j", num_layers=5) is None
    assert newest_complete(announcements, job_id="j", num_layers=5, job_digest="other") is None


class _FakeDHT:
    def __init__(self):
        self.values = {}

    async def store_own(self, name, value, *, ttl_s, pin_to_initial_peers=False):
        self.values[(name, "me")] = value
        self.pinned = pin_to_initial_peers
        return True

    async def get_signed(self, name, *, from_initial_peers=False):
        return {peer: (value, 0.0) for (n, peer), value in self.values.items() if n == name}


async def test_the_stage_hook_writes_announces_and_serves(tmp_path):
    job = resnet_job(checkpoint_every_steps=2, checkpoint_keep_last=2)
    config = checkpoint_config_for(job, tmp_path)
    assert config is not None
    assert checkpoint_config_for(resnet_job(), tmp_path) is None
    [stage] = build_split(job, [(0, 5)])
    rpc = RpcEndpoint(FakeNetwork().create("me"), "run")
    dht = _FakeDHT()
    tasks = TaskOwner("test")
    hook = StageStateHook(rpc, dht, job, stage, epoch=0, allowed={"x"}, tasks=tasks, checkpoint=config)
    await hook.start()
    for seed in range(4):
        train_step([stage], seed)
        await hook.on_step(stage.num_steps)
    assert hook.saved_steps == [2, 4]

    def announced_both():
        value = dht.values.get(("checkpoints", "me"))
        return value is not None and len(value["checkpoints"]) == 2

    await wait_until(announced_both, 10, message="the second announcement")
    assert dht.pinned  # at the initial peers too: a full restart may leave no replica holding it
    await tasks.aclose()
    [announcement] = await read_announcements(dht, job_id=job.job_id)
    assert [c.step for c in announcement.checkpoints] == [2, 4]
    _, loaded = load_checkpoint(list_checkpoints(hook.writer.directory)[-1], job=job)
    assert_bit_equal(loaded.tensors, union_state([stage]))


async def test_a_new_owner_pulls_the_newest_covering_checkpoint_from_the_peers_that_wrote_it(tmp_path):
    from ravnest_p2p.training.checkpoint import CheckpointAnnouncement as Announcement
    from ravnest_p2p.training.checkpoint_fetch import fetch_from_checkpoints
    from ravnest_p2p.training.handover import HandoverError, HandoverServer
    from ravnest_p2p.training.stage_state import expected_entries, merge_states

    job = resnet_job()
    old = build_split(job, [(0, 2), (2, 5)])
    for step in (1, 2):
        train_step(old, step)
    network = FakeNetwork()
    announcements = []
    for index, stage in enumerate(old):
        peer = f"owner{index}"
        first, end = stage.config.first_layer_index, stage.config.first_layer_index + len(stage.module)
        writer = CheckpointWriter(
            CheckpointConfig(every_steps=1, dir=tmp_path / peer), job, first_layer=first, end_layer=end
        )
        writer.save(capture_state(stage), step=7)
        server = HandoverServer.of(RpcEndpoint(network.create(peer), "run"))
        await server.start()
        server.serve_checkpoints(job.job_id, tmp_path / peer, allowed={"new"})
        announcements.append(Announcement.of(writer.saved(), peer_id=peer, updated_at=0.0))
    truth = merge_states([capture_state(s) for s in old])

    [new] = build_split(job, [(1, 4)])
    rpc = RpcEndpoint(network.create("new"), "run")
    state = await fetch_from_checkpoints(rpc, announcements, job, 1, 4, expected=expected_entries(new))
    assert state is not None
    restore_state(new, state)
    names = list(state.tensors)
    assert any(n.startswith("optim/") for n in names)
    assert_bit_equal(state.tensors, truth.subset(names).tensors)

    # an announcement that does not match what its holder serves is refused
    forged = announcements[1].model_copy(
        update={
            "checkpoints": (announcements[1].checkpoints[0].model_copy(update={"state_digest": "f" * 64}),)
        }
    )
    with pytest.raises(HandoverError, match="another checkpoint"):
        await fetch_from_checkpoints(rpc, [announcements[0], forged], job, 1, 4)
    assert await fetch_from_checkpoints(rpc, announcements[:1], job, 1, 4) is None


def test_the_validator_schema_takes_only_announcements_their_signer_wrote_about_itself():
    from ravnest_p2p.training.checkpoint import parse_announcement

    value = _announce("a", [(10, 0, 5)]).model_dump(mode="json")
    assert parse_announcement(value, "a").peer_id == "a"
    with pytest.raises(ValueError, match="signed by"):
        parse_announcement(value, "b")
    with pytest.raises(ValueError, match="validation"):
        parse_announcement({**value, "checkpoints": [{"step": -1}]}, "a")
