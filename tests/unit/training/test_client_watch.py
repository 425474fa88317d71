"""Readable progress: one-line summaries for callbacks, terminal lines, the history `watch` keeps."""

from __future__ import annotations

import io
from typing import Any

import pytest

from ravnest_p2p import JobSpec, ProgressSnapshot, RunClient, StageMetrics, summarize
from ravnest_p2p.client_watch import JobHistory, LineRenderer, in_notebook, make_renderer


def _stage(cluster: int, stage: int, **fields: Any) -> StageMetrics:
    values: dict[str, Any] = {
        "job_id": "digits-1",
        "peer_id": f"Qm{'x' * 40}{cluster}{stage}",
        "cluster": cluster,
        "stage": stage,
        "num_stages": 2,
        "step": 120,
        "optimizer_steps": 120,
        "updated_at": 1.0,
        "bytes_sent": 123_456_789,
        "param_digests": {f"layer{i}.weight": "ab" * 32 for i in range(8)},
    }
    return StageMetrics(**{**values, **fields})


def _poll(step: int = 120, done: bool = False) -> list[StageMetrics]:
    return [
        _stage(0, 0, step=step, samples_per_s=312.4, done=done, eval_accuracy=0.912 if done else None),
        _stage(0, 1, step=step, loss=0.4123, samples_per_s=300.0),
        _stage(1, 0, step=step - 10, samples_per_s=250.0, done=done),
        _stage(1, 1, step=step - 10, loss=0.5, samples_per_s=240.0),
    ]


def test_a_snapshot_prints_as_one_short_line_per_poll() -> None:
    snapshot = ProgressSnapshot(_poll(), "digits-1")
    text = str(snapshot)
    assert "\n" not in text
    assert len(text) < 200  # the raw list printed 1.5-2.5 KB
    assert len(repr(list(snapshot))) > 2000
    assert text == (
        "digits-1 epoch 0 | c0 step 120 312 samples/s loss 0.412 | c1 step 110 250 samples/s loss 0.500"
    )
    assert isinstance(snapshot, list)
    assert snapshot[0].stage == 0  # still the metrics, for callbacks that read them


def test_summary_reads_each_field_from_the_right_stage() -> None:
    summary = summarize(_poll(done=True))
    first = summary.clusters[0]
    assert (first.step, first.samples_per_s, first.loss) == (120, 312.4, 0.4123)
    assert first.eval_accuracy == 0.912
    assert summary.done
    assert "acc 91.2% done" in str(summary)


def test_summary_shows_only_the_newest_plan_epoch() -> None:
    old = _stage(0, 0, step=999, epoch=1)
    summary = summarize([old, _stage(0, 0, step=5, epoch=2)])
    assert summary.epoch == 2
    assert [c.step for c in summary.clusters] == [5]
    assert str(summarize([], "j")) == "j: waiting for the first metrics"


def test_lines_are_printed_only_when_progress_changed() -> None:
    stream = io.StringIO()
    renderer = LineRenderer(stream)
    history = JobHistory(job_id="digits-1")
    for step in (10, 10, 20):
        summary = summarize(_poll(step))
        history.add(summary)
        renderer.update(history, summary)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0][2] == ":"  # HH:MM:SS first
    assert "step 10 " in lines[0]


def test_history_series_and_plot() -> None:
    history = JobHistory(job_id="digits-1", started_at=100.0)
    history.add(summarize(_poll(10)), now=101.0)
    history.add(summarize(_poll(20)), now=103.0)
    assert history.clusters() == [0, 1]
    assert history.series(0, "step") == ([1.0, 3.0], [10.0, 20.0])
    assert history.series(1, "loss") == ([1.0, 3.0], [0.5, 0.5])
    assert history.series(1, "loss", x="loss_step") == ([0.0, 10.0], [0.5, 0.5])
    pytest.importorskip("matplotlib")
    assert history.png().startswith(b"\x89PNG")


def test_auto_display_outside_a_notebook_is_lines() -> None:
    assert not in_notebook()
    assert isinstance(make_renderer("auto"), LineRenderer)


async def test_watch_renders_each_poll_and_returns_the_history(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    polls = [([], False), (_poll(10), False), (_poll(20), False), (_poll(30, done=True), True)]

    async def poll(job: JobSpec) -> tuple[list[StageMetrics], bool]:
        return polls.pop(0)

    client = object.__new__(RunClient)  # no DHT: only the polling is exercised
    monkeypatch.setattr(client, "_poll_job", poll)
    history = await client.watch(JobSpec(job_id="digits-1"), display="lines", poll_s=0.0)
    assert history.final[0].step == 30
    assert history.eval_accuracy == 0.912
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5  # waiting, 10, 20, 30 (done), finished
    assert "finished: digits-1" in out[-1]
    assert "acc 91.2% done |" in out[-1]
