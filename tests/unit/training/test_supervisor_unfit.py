"""A peer that cannot serve the run's job (model or data missing, data differs) says so and stays out."""

from __future__ import annotations

from pathlib import Path

import pytest

from ravnest_p2p.discovery.records import Serving
from ravnest_p2p.training.datasets import pin_digest, reload_dataset_plugins
from ravnest_p2p.training.job import JobSpec

from ._fakes import FakeDHT, FakePlans, FakeRunners
from .test_supervisor import JOB, publish, supervisor

pytestmark = pytest.mark.timeout(30)


async def test_a_peer_without_the_jobs_plugin_says_why_and_does_not_plan_it():
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    told: list[None] = []
    await publish(dht, JOB.model_copy(update={"model": "not_installed_lm", "dataset": "not_installed_text"}))
    sup, _ = supervisor(dht, runners, plans=plans, on_unfit=lambda: told.append(None))
    assert await sup.step() is None
    assert await sup.step() is None  # judged once per job
    assert sup.unfit is not None
    job_id, why = sup.unfit
    assert job_id == "j"
    assert "model 'not_installed_lm' and data set 'not_installed_text' not installed here" in why
    assert len(told) == 1
    assert plans.workloads == []  # it never plans a workload it cannot run
    assert runners.made == []

    await publish(dht, JOB)  # the owner publishes a job this peer can serve
    assert await sup.step() is None  # no agreed plan yet
    assert sup.unfit is None
    assert len(told) == 2
    assert plans.workloads == ["j"]
    assert plans.serving == [Serving("j")]  # built-ins: nothing beyond the software


async def test_a_peer_whose_data_differs_from_the_pinned_digest_refuses(tmp_path: Path):
    (tmp_path / "t.txt").write_text("abcdefgh" * 100)
    job = JobSpec(
        job_id="text",
        model="char_gpt",
        model_params={"vocab_size": 256, "block_size": 8},
        dataset="text_files",
        dataset_config={"path": str(tmp_path / "t.txt"), "block_size": 8},
    )
    job = pin_digest(job)
    (tmp_path / "t.txt").write_text("ABCDEFGH" * 100)  # this peer's copy is another text
    reload_dataset_plugins()  # (and forget the data this process loaded)
    dht, runners, plans = FakeDHT("me"), FakeRunners(), FakePlans()
    await publish(dht, job)
    sup, _ = supervisor(dht, runners, plans=plans)
    assert await sup.step() is None
    assert sup.unfit is not None
    assert sup.unfit[1].startswith("data: data set 'text_files': this peer's data has digest")
    assert plans.workloads == []
