"""A full restart's state: the newest checkpoint step complete across stages, own disk first, else the
plan members that announced it, refusing corrupt, truncated, stranger's and other jobs' checkpoints.

Real stages, real checkpoint files, `HandoverStateSource` over the in-memory network and DHT fakes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from ravnest_p2p.training import checkpoint_fetch
from ravnest_p2p.training.checkpoint import (
    CheckpointAnnouncement,
    CheckpointConfig,
    CheckpointError,
    CheckpointWriter,
    announce_checkpoints,
    checkpoint_manifest_path,
    complete_steps,
    job_digest,
    load_checkpoint,
    read_announcements,
)
from ravnest_p2p.training.handover import CheckpointRef, HandoverRefused, fetch_state
from ravnest_p2p.training.job import JobSpec, StagePlacement
from ravnest_p2p.training.resume import CheckpointQuery
from ravnest_p2p.training.stage_state import StageState, capture_state, merge_states, names_in_layers
from ravnest_p2p.training.state_source import HandoverStateSource
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from ._fakes import FakeDHT
from .stage_state_helpers import assert_bit_equal, build_split, resnet_job, train_step

pytestmark = pytest.mark.timeout(60)

JOB = resnet_job(checkpoint_every_steps=1, checkpoint_keep_last=5)
MEMBERS = frozenset({"a", "b", "d", "e", "new"})


def placed(job: JobSpec, peer: str) -> JobSpec:
    """The job as a runner writes it: with its plan's assignment (checkpoints must not depend on it)."""
    return job.model_copy(
        update={"assignment": ((StagePlacement(peer_id=peer, first_layer=0, end_layer=5),),)}
    )


class Swarm:
    """Peers with checkpoint folders under `root`, one DHT store and one in-memory network."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.network = FakeNetwork()
        self.dht = FakeDHT("nobody")
        self.sources: dict[str, HandoverStateSource] = {}

    def source(self, peer: str) -> HandoverStateSource:
        if peer not in self.sources:
            rpc = RpcEndpoint(self.network.create(peer), "run")
            self.sources[peer] = HandoverStateSource(
                rpc, dht=self.dht.as_signer(peer), checkpoint_dir=self.root / peer, timeout_s=10
            )
        return self.sources[peer]

    async def save(
        self, peer: str, state: StageState, first: int, end: int, *steps: int, share: bool = True
    ) -> None:
        """`peer` writes `state` of layers [first, end) as checkpoints `steps`, announces and serves them."""
        job = placed(JOB, peer)
        writer = CheckpointWriter(
            CheckpointConfig(every_steps=1, keep_last=5, dir=self.root / peer),
            job,
            first_layer=first,
            end_layer=end,
        )
        for step in steps:
            writer.save(state.subset(names_in_layers(state.tensors, first, end)), step=step)
        announcement = CheckpointAnnouncement.of(writer.saved(), peer_id=peer, updated_at=0.0)
        await announce_checkpoints(self.dht.as_signer(peer), announcement)
        if share:
            await self.source(peer).share_checkpoints(JOB.job_id, MEMBERS)

    async def restore(
        self, peer: str, first: int, end: int, *, members: frozenset[str] = MEMBERS
    ) -> StageState | None:
        query = CheckpointQuery(job=JOB, num_layers=5, members=members)
        return await self.source(peer).from_checkpoint(query, first_layer=first, end_layer=end)

    def path(self, peer: str, step: int, first: int, end: int) -> Path:
        manifest = checkpoint_manifest_path(
            self.root / peer, JOB.job_id, step=step, first_layer=first, end_layer=end
        )
        return manifest.with_suffix(".safetensors")


def trained(steps: int) -> list[StageState]:
    """The whole model's state after each of `steps` training steps."""
    stages = build_split(JOB, [(0, 2), (2, 5)])
    out = []
    for seed in range(steps):
        train_step(stages, seed)
        out.append(merge_states([capture_state(s) for s in stages]))
    return out


def layers(state: StageState, first: int, end: int) -> dict[str, torch.Tensor]:
    return state.subset(names_in_layers(state.tensors, first, end)).tensors


def fetched_from(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Peers asked over the network for a checkpoint piece (own files are read, never asked)."""
    asked: list[str] = []
    real = checkpoint_fetch._fetch_piece

    async def spy(rpc, peer_id, *args, **kwargs):
        asked.append(peer_id)
        return await real(rpc, peer_id, *args, **kwargs)

    monkeypatch.setattr(checkpoint_fetch, "_fetch_piece", spy)
    return asked


def test_the_job_digest_ties_a_checkpoint_to_the_job_not_to_its_placement():
    assert job_digest(placed(JOB, "a")) == job_digest(JOB) == job_digest(placed(JOB, "b"))
    assert job_digest(JOB.model_copy(update={"seed": 9})) != job_digest(JOB)
    assert job_digest(JOB.model_copy(update={"model_params": {"width": 8}})) != job_digest(JOB)


async def test_every_stage_resumes_from_the_newest_step_complete_across_stages(tmp_path, monkeypatch):
    one, two, three = trained(3)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("a", two, 0, 2, 2)
    await swarm.save("a", three, 0, 2, 3)
    await swarm.save("b", one, 2, 5, 1)
    await swarm.save("b", two, 2, 5, 2)  # b died before it wrote step 3: 3 is not complete
    asked = fetched_from(monkeypatch)

    # a new peer owns layers the two of them wrote: step 2 from both, over the network
    state = await swarm.restore("new", 1, 4)
    assert state is not None
    assert state.meta is not None
    assert_bit_equal(state.tensors, layers(two, 1, 4))
    assert state.meta.num_steps == 2
    assert sorted(asked) == ["a", "b"]

    # a restarted peer takes the layers it wrote from its own disk (not its newer step 3), the rest from b
    asked.clear()
    state = await swarm.restore("a", 0, 5)
    assert state is not None
    assert_bit_equal(state.tensors, layers(two, 0, 5))
    assert asked == ["b"]
    assert any(n.startswith("optim/") for n in state.tensors)


async def test_own_disk_counts_every_layer_range_it_ever_wrote(tmp_path, monkeypatch):
    (one,) = trained(1)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("a", one, 2, 5, 1)  # an older plan's range: no longer in a's published value
    await swarm.save("b", one, 0, 5, 1)
    asked = fetched_from(monkeypatch)
    state = await swarm.restore("a", 0, 5)
    assert state is not None
    assert_bit_equal(state.tensors, layers(one, 0, 5))
    assert asked == []


async def test_a_restarted_peer_announces_every_checkpoint_on_its_disk_so_others_choose_the_same_step(
    tmp_path,
):
    """b's newest save was never announced (a SIGTERM ended its run right after the save), and its value
    named only its last plan's range: a peer without b's disk saw step 3 incomplete and would resume from
    an older step than a stage that read b's disk (a full-restart run mixed steps 64 and 48). Once b
    announces its disk, as a restarted peer does before it plans the job, every reader chooses step 3."""
    _, two, three = trained(3)
    swarm = Swarm(tmp_path)
    await swarm.save("a", three, 0, 2, 3)
    await swarm.save("b", two, 2, 5, 2)
    CheckpointWriter(
        CheckpointConfig(every_steps=1, keep_last=5, dir=tmp_path / "b"),
        placed(JOB, "b"),
        first_layer=2,
        end_layer=5,
    ).save(three.subset(names_in_layers(three.tensors, 2, 5)), step=3)
    query = CheckpointQuery(job=JOB, num_layers=5, members=MEMBERS)
    before = await swarm.source("new").from_checkpoint(query, first_layer=2, end_layer=5)
    assert before is not None
    assert_bit_equal(before.tensors, layers(two, 2, 5))  # the older step: all it could see

    await swarm.source("b").announce_checkpoints(JOB)
    [announced] = [a for a in await read_announcements(swarm.dht, job_id=JOB.job_id) if a.peer_id == "b"]
    assert sorted(c.step for c in announced.checkpoints) == [2, 3]
    after = await swarm.restore("new", 2, 5)
    assert after is not None
    assert_bit_equal(after.tensors, layers(three, 2, 5))


async def test_strangers_and_other_jobs_are_not_counted(tmp_path):
    one, two = trained(2)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 5, 1)
    await swarm.save("x", two, 0, 5, 7)  # not a member of the plan: its newer step is ignored
    other = JOB.model_copy(update={"seed": 99})
    forged = CheckpointAnnouncement.of(
        [
            CheckpointWriter(CheckpointConfig(dir=tmp_path / "b"), other, first_layer=0, end_layer=5).save(
                two.subset(list(two.tensors)), step=9
            )
        ],
        peer_id="b",
        updated_at=0.0,
    )
    await announce_checkpoints(swarm.dht.as_signer("b"), forged)  # a member, but another job spec
    announcements = [*(await swarm.source("new")._announcements(CheckpointQuery(JOB, 5, MEMBERS)))]
    assert {a.peer_id for a in announcements} == {"a", "b"}
    assert complete_steps(announcements, job_id=JOB.job_id, num_layers=5, job_digest=job_digest(JOB)) == [1]
    state = await swarm.restore("new", 0, 5)
    assert state is not None
    assert_bit_equal(state.tensors, layers(one, 0, 5))
    # and a member's checkpoints are not served to a stranger
    ref = CheckpointRef(step=1, first_layer=0, end_layer=5)
    with pytest.raises(HandoverRefused) as refused:
        await fetch_state(swarm.source("x").rpc, "a", JOB.job_id, layers=(0, 5), checkpoint=ref, timeout_s=5)
    assert refused.value.code == "not_allowed"


async def test_a_corrupt_or_truncated_piece_costs_its_holder_and_a_replica_serves_it(tmp_path, monkeypatch):
    (one,) = trained(1)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("b", one, 2, 5, 1)
    await swarm.save("e", one, 2, 5, 1)  # b's replica in another cluster
    data = swarm.path("b", 1, 2, 5)
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # one flipped byte in b's file, same size
    data.write_bytes(bytes(raw))
    asked = fetched_from(monkeypatch)
    state = await swarm.restore("new", 0, 5)
    assert state is not None
    assert_bit_equal(state.tensors, layers(one, 0, 5))
    assert asked == ["a", "b", "e"]  # b reaches as far as e and sorts first; its bytes fail, e's do not

    # a truncated file on this peer's own disk is refused too, and the replica's is fetched instead
    own = swarm.path("a", 1, 0, 2)
    own.write_bytes(own.read_bytes()[:-100])
    await swarm.save("d", one, 0, 2, 1)
    asked.clear()
    state = await swarm.restore("a", 0, 2)
    assert state is not None
    assert_bit_equal(state.tensors, layers(one, 0, 2))
    assert asked == ["d"]


async def test_an_unusable_step_falls_back_to_the_previous_complete_one_never_to_a_stitched_one(tmp_path):
    one, two = trained(2)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("a", two, 0, 2, 2)
    await swarm.save("b", one, 2, 5, 1)
    await swarm.save("b", two, 2, 5, 2)
    # b serves something other than it announced for step 2 (its file was replaced after announcing)
    manifest = swarm.path("b", 2, 2, 5).with_suffix(".json")
    value = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**value, "created_at": value["created_at"] + 1}))
    state = await swarm.restore("new", 0, 5)
    assert state is not None
    assert state.meta is not None
    assert state.meta.num_steps == 1  # not step 2's first layers with step 1's last ones
    assert_bit_equal(state.tensors, layers(one, 0, 5))
    # no usable complete step at all: no state (the layers start from the initial weights)
    for peer, first, end in (("a", 0, 2), ("b", 2, 5)):
        swarm.path(peer, 1, first, end).write_bytes(b"\0" * 16)
    assert await swarm.restore("new", 0, 5) is None


async def test_a_holder_that_does_not_serve_yet_is_asked_again_until_it_does(tmp_path):
    """After a full restart a peer serves its files once it knows its role; the others may ask sooner."""
    (one,) = trained(1)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("b", one, 2, 5, 1, share=False)  # restarted, not yet on the plan: not serving
    swarm.source("new").checkpoint_wait_s = 0.0
    assert await swarm.restore("new", 0, 5) is None  # no waiting: the only complete step is not to be had
    swarm.source("new").checkpoint_wait_s = 20.0
    later = asyncio.get_running_loop().call_later(
        0.3, lambda: asyncio.ensure_future(swarm.source("b").share_checkpoints(JOB.job_id, MEMBERS))
    )
    try:
        state = await swarm.restore("new", 0, 5)
    finally:
        later.cancel()
    assert state is not None
    assert_bit_equal(state.tensors, layers(one, 0, 5))


async def test_with_no_complete_step_the_newest_covering_checkpoint_is_used(tmp_path):
    one, two = trained(2)
    swarm = Swarm(tmp_path)
    await swarm.save("a", one, 0, 2, 1)
    await swarm.save("a", two, 0, 2, 2)
    state = await swarm.restore("new", 0, 2)
    assert state is not None
    assert state.meta is not None
    assert state.meta.num_steps == 2
    assert_bit_equal(state.tensors, layers(two, 0, 2))
    assert await swarm.restore("new", 0, 3) is None  # nobody wrote layer 2


def test_a_partial_read_keeps_only_the_asked_layers_and_still_checks_the_whole_file(tmp_path):
    (one,) = trained(1)
    writer = CheckpointWriter(CheckpointConfig(dir=tmp_path), JOB, first_layer=0, end_layer=5)
    writer.save(one, step=1)
    manifest = checkpoint_manifest_path(tmp_path, JOB.job_id, step=1, first_layer=0, end_layer=5)
    _, state = load_checkpoint(manifest, job=JOB, layers=(1, 2))
    assert set(state.tensors) == set(names_in_layers(one.tensors, 1, 2))
    assert_bit_equal(state.tensors, layers(one, 1, 2))
    data = manifest.with_suffix(".safetensors")
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # in the last layer's tensors, which this read does not keep
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(manifest, job=JOB, layers=(0, 1))
