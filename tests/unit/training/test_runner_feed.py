"""The first stage's feed when a move in place brings new data: mid-way, as the data runs out, or too late."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ravnest_p2p.errors import RavnestError
from ravnest_p2p.training.role import role_for
from ravnest_p2p.training.runner import StageRunner
from ravnest_p2p.transport import FakeNetwork, RpcEndpoint

from .test_supervisor_runner import BASE

pytestmark = pytest.mark.timeout(60)


@dataclass
class _Stats:
    completed: int = 0
    backwards: int = 0


@dataclass
class FakeService:
    """Stands in for the first stage's `StageService`: takes every micro-batch it is given at once."""

    on_batch: object = None  # called with the count after each micro-batch
    on_train_end: object = None  # called once the data ran out, before `train` returns
    stats: _Stats = field(default_factory=_Stats)
    is_first: bool = True
    window_size: int = 4
    finished_calls: int = 0
    evaluated: int = 0

    async def wait_ready(self, timeout_s: float) -> None:
        pass

    async def train(self, batches) -> _Stats:
        for _ in batches:
            self.stats.completed += 1
            self.stats.backwards += 1
            if self.on_batch is not None:
                self.on_batch(self.stats.completed)
        if self.on_train_end is not None:
            hook, self.on_train_end = self.on_train_end, None
            hook()
        return self.stats

    async def evaluate(self, batches) -> tuple[float, float]:
        self.evaluated += 1
        return 1.0, 0.5

    async def finish(self) -> None:
        self.finished_calls += 1


def _runner() -> StageRunner:
    job = BASE.model_copy(update={"num_epochs": 2})
    role = role_for(job, None, "p0")
    assert role is not None
    return StageRunner(RpcEndpoint(FakeNetwork().create("p0"), "t"), None, job, role)


async def test_new_data_set_as_the_old_ran_out_is_fed_before_the_run_finishes():
    runner = _runner()
    service = FakeService()
    extra = [(None, None)] * 5

    def more_data() -> None:  # what `rebase` does to the first stage's data
        runner._batches = iter(extra)

    service.on_train_end = more_data
    await runner._drive(service)  # type: ignore[arg-type]
    first = runner.role.final_step
    assert first is not None
    assert service.stats.completed == first + len(extra)
    assert service.finished_calls == 1
    assert runner._finishing


async def test_new_data_set_mid_way_replaces_the_rest_of_the_old():
    runner = _runner()
    service = FakeService()
    extra = [(None, None)] * 7

    def more_data(count: int) -> None:
        if count == 3:
            runner._batches = iter(extra)

    service.on_batch = more_data
    await runner._drive(service)  # type: ignore[arg-type]
    assert service.stats.completed == 3 + len(extra)
    assert service.finished_calls == 1


async def test_a_move_in_place_after_the_data_ran_out_is_refused_so_the_stage_is_handed_over():
    runner = _runner()
    runner.service = FakeService()  # type: ignore[assignment]
    runner._finishing = True
    with pytest.raises(RavnestError, match="ran out of data"):
        await runner.rebase(runner.role)
