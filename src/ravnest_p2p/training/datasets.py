"""Data sets by name: the built-ins, the local sources, and installed packages' ``ravnest_p2p.datasets``.

A job names its data set (`JobSpec.dataset`) and gives a plain config (`JobSpec.dataset_config`); this
module validates the config against the data set's pydantic class (unknown fields refused) and loads
``(train, held_out)`` `ArrayDataset`s.

Plugin protocol (docs/your-model-and-data.md): a distribution declares
``[project.entry-points."ravnest_p2p.datasets"] my_data = "my_pkg.data:MY_DATA"`` where ``MY_DATA`` is
a `DatasetSpec` named ``my_data`` (or a callable returning one). ``load(config, seed=job.seed)`` gets the
validated config and returns ``(train, held_out)``. Broken plugins are skipped with a warning, exactly as
model plugins are (`models.plugins`).

Same data everywhere. Every stage of every cluster loads the data itself, so peers must derive the very
same samples. `data_digest` hashes the loaded tensors (dtype, shape, bytes); a config with a ``sha256``
field set (every local source has one; plugins may add one) is refused on a peer whose data hashes
otherwise, with both digests in the error. `pin_digest` fills it in on the researcher's machine before
the job is published.

Why the job's name is not checked when the job is parsed: a peer that lacks a plugin must still read the
job to say in its record that it cannot serve it; the names are checked where the job is built
(`check_job`) and where a peer decides whether it can serve it (`missing_parts`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from ravnest_p2p.models import available_models, get_model_spec, parse_config
from ravnest_p2p.models.plugins import PLUGIN_NAME_RE as _NAME_RE
from ravnest_p2p.models.plugins import (
    InvalidPlugin,
    PluginProblem,
    check_config_cls,
    load_entry_points,
)
from ravnest_p2p.training.data import (
    ArrayDataset,
    load_char_corpus,
    load_digits,
    make_classification,
    make_regression,
)
from ravnest_p2p.training.datasets_local import (
    HFDiskConfig,
    NumpyArraysConfig,
    TextFilesConfig,
    load_hf_disk,
    load_numpy_arrays,
    load_text_files,
)
from ravnest_p2p.training.job import JobSpec

__all__ = [
    "BUILTIN_DATASETS",
    "DATASETS_GROUP",
    "DatasetSpec",
    "available_datasets",
    "check_job",
    "data_digest",
    "get_dataset_spec",
    "load_job_data",
    "missing_parts",
    "parse_dataset_config",
    "pin_digest",
    "plugin_dataset_problems",
    "plugin_datasets",
    "reload_dataset_plugins",
]

logger = logging.getLogger(__name__)

DATASETS_GROUP = "ravnest_p2p.datasets"
Loader = Callable[..., tuple[ArrayDataset, ArrayDataset]]


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A named data set.

    Attributes:
        name: what `JobSpec.dataset` says.
        config_cls: pydantic class of `JobSpec.dataset_config` (must forbid unknown fields).
        load: ``load(config, *, seed)`` -> ``(train, held_out)``; ``seed`` is the job's seed.
    """

    name: str
    config_cls: type[BaseModel]
    load: Loader


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class DigitsConfig(_Config):
    split_seed: int = Field(default=0, ge=0, le=2**31)


class CharCorpusConfig(_Config):
    block_size: int = Field(default=64, ge=1, le=1 << 16)
    # a big model's end-of-run evaluation of the whole split can take longer than its training
    max_eval_samples: int | None = Field(default=None, ge=1)


class SyntheticClassificationConfig(_Config):
    num_samples: int = Field(default=2048, ge=10, le=10_000_000)
    in_features: int = Field(default=16, ge=1, le=1 << 20)
    num_classes: int = Field(default=4, ge=2, le=1 << 20)


class SyntheticRegressionConfig(_Config):
    num_samples: int = Field(default=2048, ge=10, le=10_000_000)
    in_features: int = Field(default=16, ge=1, le=1 << 20)
    out_features: int = Field(default=1, ge=1, le=1 << 20)


def _split(full: ArrayDataset) -> tuple[ArrayDataset, ArrayDataset]:
    cut = int(len(full) * 0.8)
    return ArrayDataset(full.inputs[:cut], full.labels[:cut]), ArrayDataset(
        full.inputs[cut:], full.labels[cut:]
    )


def _digits(c: DigitsConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    return load_digits(seed=c.split_seed)


def _char_corpus(c: CharCorpusConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    corpus = load_char_corpus()
    held_out = corpus.windows("val", c.block_size)
    if c.max_eval_samples is not None and c.max_eval_samples < len(held_out):
        held_out = ArrayDataset(held_out.inputs[: c.max_eval_samples], held_out.labels[: c.max_eval_samples])
    return corpus.windows("train", c.block_size), held_out


def _classification(c: SyntheticClassificationConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    return _split(
        make_classification(
            num_samples=c.num_samples, in_features=c.in_features, num_classes=c.num_classes, seed=seed
        )
    )


def _regression(c: SyntheticRegressionConfig, *, seed: int) -> tuple[ArrayDataset, ArrayDataset]:
    return _split(
        make_regression(
            num_samples=c.num_samples, in_features=c.in_features, out_features=c.out_features, seed=seed
        )
    )


BUILTIN_DATASETS: Mapping[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec("digits", DigitsConfig, _digits),
        DatasetSpec("char_corpus", CharCorpusConfig, _char_corpus),
        DatasetSpec("synthetic_classification", SyntheticClassificationConfig, _classification),
        DatasetSpec("synthetic_regression", SyntheticRegressionConfig, _regression),
        DatasetSpec("text_files", TextFilesConfig, load_text_files),
        DatasetSpec("numpy_arrays", NumpyArraysConfig, load_numpy_arrays),
        DatasetSpec("hf_disk", HFDiskConfig, load_hf_disk),
    )
}


def _validate_dataset_spec(name: str, obj: Any) -> DatasetSpec:
    if callable(obj) and not isinstance(obj, DatasetSpec):
        obj = obj()
    if not isinstance(obj, DatasetSpec):
        raise InvalidPlugin(f"expected a DatasetSpec (or a callable returning one), got {type(obj).__name__}")
    if not _NAME_RE.match(name):
        raise InvalidPlugin(f"data set name {name!r} must match {_NAME_RE.pattern}")
    if obj.name != name:
        raise InvalidPlugin(f"the entry point is named {name!r} but the data set calls itself {obj.name!r}")
    if name in BUILTIN_DATASETS:
        raise InvalidPlugin(f"{name!r} is a built-in data set; pick another name")
    check_config_cls("data set", obj.config_cls)
    if not callable(obj.load):
        raise InvalidPlugin("DatasetSpec.load must be callable")
    return obj


_lock = threading.Lock()
_plugins: tuple[dict[str, DatasetSpec], list[PluginProblem]] | None = None


def plugin_datasets() -> Mapping[str, DatasetSpec]:
    """Valid plugin data sets by name (loaded on first use)."""
    global _plugins
    with _lock:
        if _plugins is None:
            _plugins = load_entry_points(DATASETS_GROUP, _validate_dataset_spec)
        return _plugins[0]


def plugin_dataset_problems() -> list[PluginProblem]:
    """Data-set plugins that were skipped, and why (empty until `plugin_datasets` ran)."""
    return list(_plugins[1]) if _plugins is not None else []


def reload_dataset_plugins() -> None:
    """Forget the loaded data-set plugins (and cached data): the next lookup scans again."""
    global _plugins
    with _lock:
        _plugins = None
    _load_cached.cache_clear()


def available_datasets() -> list[str]:
    """Names of every data set this peer can load (built-in or plugin), sorted."""
    return sorted({**plugin_datasets(), **BUILTIN_DATASETS})


def get_dataset_spec(name: str) -> DatasetSpec:
    """Raises: ValueError naming the installed data sets, if `name` is unknown here."""
    spec = BUILTIN_DATASETS.get(name) or plugin_datasets().get(name)
    if spec is None:
        raise ValueError(f"unknown data set {name!r}; available: {available_datasets()}")
    return spec


def parse_dataset_config(name: str, config: Mapping[str, Any] | None = None) -> BaseModel:
    """Validate a data set's config. Raises: ValueError naming the data set and the field."""
    spec = get_dataset_spec(name)
    try:
        return spec.config_cls.model_validate(dict(config or {}))
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ValueError(f"invalid config for data set {name!r}: {problems}") from None


def data_digest(train: ArrayDataset, held_out: ArrayDataset) -> str:
    """sha256 over both splits' tensors (dtype, shape and bytes, in order)."""
    h = hashlib.sha256(b"ravnest-data-v1")
    for tensor in (train.inputs, train.labels, held_out.inputs, held_out.labels):
        array = tensor.detach().cpu().contiguous().numpy()
        h.update(f"{array.dtype.str}{tuple(array.shape)}".encode())
        h.update(array.reshape(-1).view(np.uint8).data)  # no copy of a large data set
    return h.hexdigest()


def _unpinned_json(config: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in config.items() if k != "sha256"}, sort_keys=True)


@functools.lru_cache(maxsize=2)
def _load_cached(name: str, unpinned_json: str, seed: int) -> tuple[ArrayDataset, ArrayDataset, str]:
    """Every role of a job and its runner ask: load once per process (the cache holds the tensors)."""
    spec = get_dataset_spec(name)
    config = parse_dataset_config(name, json.loads(unpinned_json))
    train, held_out = spec.load(config, seed=seed)
    if not (isinstance(train, ArrayDataset) and isinstance(held_out, ArrayDataset)):
        raise ValueError(f"data set {name!r} returned {type(train).__name__}, not two ArrayDatasets")
    return train, held_out, data_digest(train, held_out)


_warned: set[str] = set()


def _warn_once(name: str) -> bool:
    first = name not in _warned
    _warned.add(name)
    return first


def load_job_data(job: JobSpec) -> tuple[ArrayDataset, ArrayDataset]:
    """(train, held-out) of the job's data set, checked against the digest the job pins (if any).

    Raises:
        ValueError: unknown data set, bad config, unreadable data, or a digest other than the pinned one.
    """
    config = parse_dataset_config(job.dataset, job.dataset_config)
    train, held_out, digest = _load_cached(job.dataset, _unpinned_json(job.dataset_config), job.seed)
    pinned = getattr(config, "sha256", None)
    if pinned is not None and digest != pinned:
        raise ValueError(
            f"data set {job.dataset!r}: this peer's data has digest {digest[:16]}…, the job pins "
            f"{str(pinned)[:16]}… (its files, tokenizer or library versions differ from the researcher's)"
        )
    if pinned is None and "sha256" in type(config).model_fields and _warn_once(job.dataset):
        logger.warning(
            "data set %r is not pinned (sha256): peers cannot check they hold the same data", job.dataset
        )
    return train, held_out


def pin_digest(job: JobSpec) -> JobSpec:
    """The job with ``dataset_config.sha256`` set to this machine's data digest (for pinnable data sets).

    Raises:
        ValueError: the data set has no ``sha256`` field, or the data cannot be loaded here.
    """
    config = parse_dataset_config(job.dataset, job.dataset_config)
    if "sha256" not in type(config).model_fields:
        raise ValueError(f"data set {job.dataset!r} has no sha256 field to pin")
    unpinned = {k: v for k, v in job.dataset_config.items() if k != "sha256"}
    digest = _load_cached(job.dataset, _unpinned_json(unpinned), job.seed)[2]
    return job.model_copy(update={"dataset_config": {**unpinned, "sha256": digest}})


def missing_parts(job: JobSpec) -> str | None:
    """Why this peer cannot serve `job` (its model or data set is not installed here), or None."""
    missing = []
    if job.model not in available_models():
        missing.append(f"model {job.model!r}")
    if job.dataset not in available_datasets():
        missing.append(f"data set {job.dataset!r}")
    if not missing:
        return None
    return f"{' and '.join(missing)} not installed here (install the package that provides it)"


def check_job(job: JobSpec) -> None:
    """Where a job is built or published: its model and data set exist here and their configs validate.

    Raises:
        ValueError: naming what is wrong.
    """
    if job.model not in available_models():
        raise ValueError(f"unknown model {job.model!r}; available: {available_models()}")
    parse_config(job.model, job.model_params)
    get_model_spec(job.model)
    parse_dataset_config(job.dataset, job.dataset_config)
