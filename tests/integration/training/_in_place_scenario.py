"""A re-plan where one cluster re-forms and the other is unchanged, over real p2p daemons (one process).

Five loopback hosts, one `JobSupervisor` each (real `StageRunner`s, real hand-over, real averaging
rings); the agreed plan is scripted (each peer's `FakePlans`, switched a fraction of a second apart, as
peers' polls see a new plan at different moments): plan 1 is A = (a0, a1) and B = (b0, b1), two stages
each; plan 2 is B' = (b0, c, b1) — a peer joined cluster B, which re-forms — and A unchanged (now
cluster 1). Measured on A's first stage: the longest time without an optimizer step around the re-plan,
against its median step interval before it; whether A's runner is the same object throughout.

Run both ways (`in_place=False` hides `StageRunner.rebase`, i.e. the path before in-place moves):

    PYTHONPATH=src python -m tests.integration.training._in_place_scenario

All stages share this process's one compute thread (`utils.run_in_compute_thread`), so B's hand-over
and resumption evaluation also delay A here; with one process per peer they would not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from ravnest_p2p.runtime.optim import OptimizerConfig
from ravnest_p2p.training.handover import HandoverServer
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.local import local_hosts
from ravnest_p2p.training.progress import read_progress
from ravnest_p2p.training.role import StageRole
from ravnest_p2p.training.runner import JOB_KEY, StageRunner
from ravnest_p2p.training.stage_state import StageState
from ravnest_p2p.training.state_source import HandoverStateSource
from ravnest_p2p.training.supervisor import JobSupervisor, SupervisorConfig
from ravnest_p2p.transport import RpcEndpoint
from tests.unit.training._fakes import FakeDHT, FakePlans, make_plan


def scenario_job(max_steps: int, eval_every_steps: int = 16) -> JobSpec:
    return JobSpec(
        job_id="in-place",
        model="digits_cnn",
        dataset="digits",
        batch_size=32,
        until_stopped=True,
        max_steps=max_steps,
        eval_every_steps=eval_every_steps,
        averaging_period_steps=8,
        optimizer=OptimizerConfig(name="adam", lr=2e-3),
    )


class _Frozen(StageRunner):
    """The runner as it was before in-place moves: a new plan always stops and restarts it."""

    rebase = None  # type: ignore[assignment]


@dataclass
class Outcome:
    in_place: bool
    replan_at: float = 0.0
    a_runners: int = 0  # runners A's first stage went through (1: never restarted)
    a_moved_in_place: int = 0
    median_step_s: float = 0.0  # A's first stage, before the re-plan
    stall_s: float = 0.0  # A's longest time without an optimizer step from the re-plan until B trains
    b_resumed_after_s: float = 0.0  # re-plan -> B's first optimizer step on the new plan
    accuracy: dict[str, float] = field(default_factory=dict)  # final held-out accuracy per first stage
    b_resumed_loss: float | None = None
    steps: list[tuple[float, int]] = field(default_factory=list)

    def summary(self) -> str:
        accuracy = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.accuracy.items()))
        return (
            f"in_place={self.in_place}: A's runners {self.a_runners} "
            f"(moved in place {self.a_moved_in_place}x); "
            f"A median step {self.median_step_s:.3f}s, longest gap around the re-plan {self.stall_s:.2f}s; "
            f"B trains again after {self.b_resumed_after_s:.1f}s (resumed at loss {self.b_resumed_loss}); "
            f"final accuracy {accuracy}"
        )


async def run_scenario(
    *, in_place: bool, max_steps: int = 160, replan_after: int = 48, eval_every_steps: int = 16
) -> Outcome:
    """Train, re-plan once B has fed `replan_after` micro-batches, and finish at `max_steps` per cluster.

    `eval_every_steps=0` also drops the resumption's evaluation of a restarted first stage (a pass over
    the held-out set that, in one process, holds the shared compute thread: it delays A too).
    """
    job = scenario_job(max_steps, eval_every_steps)
    outcome = Outcome(in_place=in_place)
    store: dict[str, Any] = {}
    async with local_hosts(5) as hosts:
        ids = [h.peer_id for h in hosts]
        a0, a1, b0, b1, c = ids
        plan1 = make_plan(1, [(a0, 0, 2), (a1, 2, 4)], [(b0, 0, 2), (b1, 2, 4)])
        plan2 = make_plan(2, [(b0, 0, 1), (c, 1, 3), (b1, 3, 4)], [(a0, 0, 2), (a1, 2, 4)])
        await FakeDHT("owner", store).store_own(JOB_KEY, job.to_wire(), ttl_s=3600)
        plans = {p: FakePlans() for p in ids}
        sups: dict[str, JobSupervisor] = {}
        for host in hosts:
            peer = host.peer_id
            rpc = RpcEndpoint(host, "job")
            dht = FakeDHT(peer, store)
            plans[peer].active_workload = job.job_id

            def start(job: JobSpec, role: StageRole, state: StageState | None, rpc=rpc, dht=dht) -> Any:
                kind = StageRunner if in_place else _Frozen
                return kind(rpc, dht, job, role, initial_state=state, metrics_period_s=1.0)

            def serve_to(job_id: str, epoch: int, peers: frozenset[str], rpc=rpc) -> None:
                HandoverServer.of(rpc).allow(job_id, peers, epoch=epoch)

            sups[peer] = JobSupervisor(
                SupervisorConfig(poll_s=0.5),
                peer_id=peer,
                dht=dht,
                plans=plans[peer],
                workload=_workload,
                start_runner=start,
                state_source=HandoverStateSource(rpc, dht=dht),
                serve_to=serve_to,
            )
        tasks = [asyncio.create_task(s.run()) for s in sups.values()]
        sampler: asyncio.Task[None] | None = None
        try:
            for p in (a0, a1, b0, b1):
                plans[p].active_plan = plan1
            await _until(lambda: _fed(sups[b0]) >= replan_after and _fed(sups[a0]) >= replan_after, 300)
            a_runner = sups[a0].runner
            sampler = asyncio.create_task(_sample(sups[a0], outcome.steps))
            await asyncio.sleep(2.0)  # some steps before the re-plan, to compare with
            outcome.replan_at = time.monotonic()
            for p in (b0, a1, c, a0, b1):  # each peer's poll sees the new plan at its own moment
                plans[p].active_plan = plan2
                await asyncio.sleep(0.2)
            await _until(lambda: _epoch_steps(sups[b0], 2) > 0, 300)
            outcome.b_resumed_after_s = time.monotonic() - outcome.replan_at
            b_runner = sups[b0].runner
            outcome.b_resumed_loss = getattr(b_runner, "eval_loss", None)
            outcome.a_runners = len({id(r) for r in (a_runner, sups[a0].runner)})
            outcome.a_moved_in_place = sups[a0].moved_in_place
            await _until(lambda: all(job.job_id in sups[p].finished for p in (a0, a1, b0, c, b1)), 600)
            view = await read_progress(FakeDHT("x", store), job.job_id, owner_peer_id=None)
            assert view is not None
            assert view.done, view
            for name, peer in (("A", a0), ("B", b0)):
                runner = sups[peer].runner
                if isinstance(runner, StageRunner) and runner.eval_accuracy is not None:
                    outcome.accuracy[name] = runner.eval_accuracy
        finally:
            if sampler is not None:
                sampler.cancel()
            for sup in sups.values():
                await sup.aclose()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    _measure(outcome)
    return outcome


async def _workload(job: JobSpec) -> tuple[Any, list[Any]]:
    from ravnest_p2p.planning import JobParams

    return JobParams(micro_batch_size=job.batch_size), []


def _fed(sup: JobSupervisor) -> int:
    runner = sup.runner
    service = getattr(runner, "service", None)
    return service.stats.completed if service is not None else 0


def _epoch_steps(sup: JobSupervisor, epoch: int) -> int:
    runner = sup.runner
    service = getattr(runner, "service", None)
    if service is None or runner is None or runner.role.epoch != epoch:  # type: ignore[attr-defined]
        return 0
    return service.stats.completed


async def _sample(sup: JobSupervisor, out: list[tuple[float, int]]) -> None:
    """Record (time, optimizer steps) of A's first stage at every change (polls every 10 ms)."""
    last = -1
    while True:
        service = getattr(sup.runner, "service", None)
        steps = service.executor.num_steps if service is not None else last
        if steps != last:
            out.append((time.monotonic(), steps))
            last = steps
        await asyncio.sleep(0.01)  # a sampler: polls on purpose


async def _until(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"scenario step not reached in {timeout_s:.0f}s")
        await asyncio.sleep(0.1)


def _measure(outcome: Outcome) -> None:
    times = [t for t, _ in outcome.steps]
    before = [b - a for a, b in itertools.pairwise(times) if b <= outcome.replan_at]
    outcome.median_step_s = statistics.median(before) if before else 0.0
    end = outcome.replan_at + outcome.b_resumed_after_s + 2.0
    around = [t for t in times if outcome.replan_at - 5.0 <= t <= end]
    gaps = [b - a for a, b in itertools.pairwise(around)]
    # also the time from the last step until the window's end, if A stopped stepping for good
    tail = end - around[-1] if around else end - outcome.replan_at
    outcome.stall_s = max([*gaps, min(tail, end - outcome.replan_at)], default=0.0)


async def _main() -> None:
    for eval_every_steps in (16, 0):
        for in_place in (False, True):
            with contextlib.suppress(KeyboardInterrupt):
                outcome = await run_scenario(in_place=in_place, eval_every_steps=eval_every_steps)
                print(f"eval_every_steps={eval_every_steps}", outcome.summary(), flush=True)


if __name__ == "__main__":
    asyncio.run(_main())
