"""ReplicaAverager's staggered syncs: one fragment per spacing, fragments overlap, a busy one skips."""

import asyncio

import pytest

from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.replicas import FINAL_ROUND, ReplicaAverager
from ravnest_p2p.utils import TaskOwner


async def test_fragments_start_in_turn_overlap_each_other_and_a_busy_one_skips():
    replicas = ReplicaAverager.__new__(ReplicaAverager)  # only the scheduling matters here
    replicas._round, replicas.skipped, replicas.final_done = None, 0, False
    replicas._tasks = TaskOwner("test")
    replicas.period_steps, replicas.final_step, replicas.num_fragments = 4, 100, 2
    replicas._fragment_rings = [frozenset({"a"}), frozenset({"b", "c"})]
    replicas._fragment_tasks = {}
    ran: list[tuple[int, frozenset[str] | None]] = []
    release = asyncio.Event()

    async def run(index: int, *, ring_ids: frozenset[str] | None = None) -> None:
        ran.append((index, ring_ids))
        if index == 1:
            await release.wait()  # fragment 1's first sync is slow

    replicas._run = run  # type: ignore[method-assign]
    for step in range(1, 9):
        await replicas.on_step(step)
        await asyncio.sleep(0)
    # spacing 4 / 2 = 2 steps: rounds 1..4 at steps 2, 4, 6, 8, fragments 1, 0, 1, 0
    assert ran == [(1, frozenset({"b", "c"})), (2, frozenset({"a"})), (4, frozenset({"a"}))]
    assert replicas.skipped == 1  # round 3 (fragment 1) came due while its round 1 still ran
    release.set()
    await replicas.on_step(100)  # the closing round waits for every fragment's sync, then all rings
    assert ran[-1] == (FINAL_ROUND, None)
    await replicas._tasks.aclose()


def test_jobspec_staggered_syncs_need_a_step_period_at_least_the_fragment_count():
    job = JobSpec.model_validate({"averaging_period_steps": 50, "outer_optimizer": {"num_fragments": 4}})
    assert job.outer_optimizer is not None
    assert job.outer_optimizer.num_fragments == 4
    with pytest.raises(ValueError, match="must not exceed"):
        JobSpec.model_validate({"averaging_period_steps": 3, "outer_optimizer": {"num_fragments": 4}})
    with pytest.raises(ValueError, match="by step"):
        JobSpec.model_validate({"averaging_period_s": 10.0, "outer_optimizer": {"num_fragments": 2}})


def test_jobspec_picks_the_periodic_averaging_wire_dtype_and_refuses_the_rest():
    job = JobSpec.model_validate({"averaging_period_steps": 8, "averaging_compression": "fp16"})
    assert job.averaging_compression == "fp16"
    assert JobSpec.model_validate({"averaging_period_steps": 8}).averaging_compression == "none"
    with pytest.raises(ValueError, match="'none' or 'fp16', not 'uniform8bit'"):
        JobSpec.model_validate({"averaging_period_steps": 8, "averaging_compression": "uniform8bit"})
    with pytest.raises(ValueError, match="averaging_compression"):
        JobSpec.model_validate({"averaging_period_steps": 8, "averaging_compression": "fp8"})
    with pytest.raises(ValueError, match=r"outer_optimizer\.compression"):
        JobSpec.model_validate(
            {"averaging_period_steps": 8, "averaging_compression": "fp16", "outer_optimizer": {}}
        )
