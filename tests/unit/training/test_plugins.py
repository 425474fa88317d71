"""Models and data sets from a throwaway package's entry points: loaded, validated, advertised, planned."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ravnest_p2p.discovery.records import PeerRecord, Serving
from ravnest_p2p.models import available_models, build_model
from ravnest_p2p.models.plugins import plugin_model_problems, reload_plugins
from ravnest_p2p.training.datasets import (
    available_datasets,
    check_job,
    load_job_data,
    missing_parts,
    plugin_dataset_problems,
    reload_dataset_plugins,
)
from ravnest_p2p.training.job import JobSpec
from ravnest_p2p.training.placement import capacities_from_records, job_serving
from ravnest_p2p.training.plugins import advertised_plugins
from ravnest_p2p.types import PeerState
from tests._plugin_pkg import DEMO_MODULE, write_plugin_package

PEER = "QmPeerAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"


def _reload() -> None:
    reload_plugins()
    reload_dataset_plugins()


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Path]]:
    """Install (put on sys.path) throwaway plugin packages; all removed again afterwards."""
    modules: list[str] = []

    def _install(name: str = "pkg", **kwargs: object) -> Path:
        root = write_plugin_package(tmp_path / name, **kwargs)  # type: ignore[arg-type]
        modules.append(str(kwargs.get("module", "ravnest_demo_plugin")))
        monkeypatch.syspath_prepend(str(root))
        _reload()
        return root

    yield _install
    monkeypatch.undo()
    for module in modules:
        sys.modules.pop(module, None)
    _reload()


def test_a_plugin_registers_a_model_and_a_data_set(install: Callable[..., Path]) -> None:
    install()
    assert "demo_mlp" in available_models()
    assert "demo_blobs" in available_datasets()
    layers = build_model("demo_mlp", {"hidden": 8}, seed=1)
    assert len(layers) == 2
    job = JobSpec(model="demo_mlp", model_params={"hidden": 8}, dataset="demo_blobs")
    check_job(job)
    assert missing_parts(job) is None
    train, held_out = load_job_data(job)
    assert (len(train), len(held_out)) == (480, 120)
    assert advertised_plugins() == (("demo_mlp",), ("demo_blobs",))
    assert job_serving(job) == Serving("job", frozenset({"demo_mlp"}), frozenset({"demo_blobs"}))


def test_without_the_plugin_the_peer_says_what_is_missing() -> None:
    job = JobSpec(model="demo_mlp", dataset="demo_blobs")
    why = missing_parts(job)
    assert why is not None
    assert "model 'demo_mlp'" in why
    assert "data set 'demo_blobs'" in why
    with pytest.raises(ValueError, match="unknown model 'demo_mlp'"):
        check_job(job)
    assert missing_parts(JobSpec()) is None  # built-ins: digits_cnn on digits


BROKEN = {
    "raises_on_import": "ravnest_broken_plugin:NOT_THERE",
    "wrong_type": "ravnest_broken_plugin:NOT_A_SPEC",
    "misnamed": "ravnest_broken_plugin:MISNAMED",
    "mlp": "ravnest_broken_plugin:SHADOWS",
    "loose_config": "ravnest_broken_plugin:LOOSE",
    "bad_loss": "ravnest_broken_plugin:BAD_LOSS",
    "fine": "ravnest_broken_plugin:FINE",
}
BROKEN_SOURCE = (
    DEMO_MODULE.replace("ravnest_demo_plugin", "ravnest_broken_plugin")
    + """
import dataclasses

NOT_A_SPEC = {"key": "wrong_type"}
MISNAMED = dataclasses.replace(MODEL, key="something_else")
SHADOWS = dataclasses.replace(MODEL, key="mlp")

class LooseConfig(BaseModel):
    hidden: int = 4

LOOSE = dataclasses.replace(MODEL, key="loose_config", config_cls=LooseConfig)
BAD_LOSS = dataclasses.replace(MODEL, key="bad_loss", loss=lambda c: "hinge")
FINE = dataclasses.replace(MODEL, key="fine")
"""
)


def test_broken_plugins_are_skipped_with_a_reason_naming_them(install: Callable[..., Path]) -> None:
    install(
        "broken",
        module="ravnest_broken_plugin",
        source=BROKEN_SOURCE,
        entry_points={"ravnest_p2p.models": BROKEN, "ravnest_p2p.datasets": {"blobs": "nowhere_at_all:X"}},
        dist_name="ravnest-broken-plugin",
    )
    models = available_models()  # never raises: the good plugin and the built-ins are there
    assert "fine" in models
    assert "mlp" in models
    problems = {p.name: p for p in plugin_model_problems()}
    assert set(problems) == set(BROKEN) - {"fine"}
    assert "AttributeError" in problems["raises_on_import"].reason
    assert "expected a ModelSpec" in problems["wrong_type"].reason
    assert "calls itself 'something_else'" in problems["misnamed"].reason
    assert "built-in model" in problems["mlp"].reason
    assert "extra='forbid'" in problems["loose_config"].reason
    assert "must be one of" in problems["bad_loss"].reason
    assert "ravnest-broken-plugin 0.1" in problems["bad_loss"].describe()
    assert "blobs" not in available_datasets()
    assert [p.name for p in plugin_dataset_problems()] == ["blobs"]
    assert "ModuleNotFoundError" in plugin_dataset_problems()[0].reason


def test_the_same_name_from_two_distributions_is_refused(install: Callable[..., Path]) -> None:
    install("one")
    install(
        "two",
        module="ravnest_demo_plugin2",
        source=DEMO_MODULE,
        entry_points={"ravnest_p2p.models": {"demo_mlp": "ravnest_demo_plugin2:MODEL"}},
        dist_name="ravnest-demo-two",
    )
    assert "demo_mlp" not in available_models()
    assert any("more than one distribution" in p.reason for p in plugin_model_problems())


def _record(peer_id: str, **fields: object) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        flops=1e9,
        free_memory_bytes=2**30,
        state=PeerState.READY,
        updated_at=1.0,
        **fields,  # type: ignore[arg-type]
    )


def test_planning_leaves_out_peers_that_do_not_serve_the_job() -> None:
    job = JobSpec(job_id="j", model="demo_mlp", dataset="demo_blobs")
    serving = job_serving(job)
    has = _record("QmHas" + "a" * 40, plugin_models=("demo_mlp", "x"), plugin_datasets=("demo_blobs",))
    lacks_data = _record("QmLacksData" + "a" * 40, plugin_models=("demo_mlp",))
    lacks_all = _record("QmNothing" + "a" * 40)
    said_unfit = _record(
        "QmUnfit" + "a" * 40,
        plugin_models=("demo_mlp",),
        plugin_datasets=("demo_blobs",),
        unfit_job="j",
        unfit_reason="data: digest differs",
    )
    records = [has, lacks_data, lacks_all, said_unfit]
    assert [r.peer_id for r in records if serving.met_by(r)] == [has.peer_id]
    assert [c.peer_id for c in capacities_from_records(records, serving=serving)] == [has.peer_id]
    # built-in model and data: only a peer that said it cannot serve this very job is left out
    builtin = job_serving(JobSpec(job_id="j"))
    assert [r.peer_id for r in records if builtin.met_by(r)] == [r.peer_id for r in records[:3]]
    other_job = job_serving(JobSpec(job_id="other"))
    assert all(other_job.met_by(r) for r in records)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"plugin_models": ("has space",)}, "plugin_models"),
        ({"plugin_models": tuple(f"m{i}" for i in range(9))}, "plugin_models"),
        ({"plugin_datasets": ("x" * 49,)}, "plugin_datasets"),
        ({"unfit_reason": "x" * 201}, "unfit_reason"),
        ({"unfit_job": "bad job id"}, "unfit_job"),
    ],
)
def test_hostile_plugin_fields_refuse_the_record(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _record(PEER, **fields)


def test_the_job_names_a_data_set_by_a_plain_name() -> None:
    assert JobSpec(dataset="demo_blobs").dataset == "demo_blobs"  # not installed: still parses
    with pytest.raises(ValueError, match="dataset"):
        JobSpec(dataset="../etc/passwd")
    with pytest.raises(ValueError, match="invalid config for data set 'digits': bogus"):
        check_job(JobSpec(dataset="digits", dataset_config={"bogus": 1}))
    with pytest.raises(ValueError, match="unknown data set 'nope'"):
        check_job(JobSpec(dataset="nope"))
